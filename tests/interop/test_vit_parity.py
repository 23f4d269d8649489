"""HF ViTModel / ViTForImageClassification with tiny random configs, saved to tmp_path, load into qkv.ViT:
outputs equal within 1e-4 (also at a new image size through position interpolation)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkv.interop import load_hf  # noqa: E402


def _cfg(**kw):
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=48, image_size=8,
                patch_size=2, num_channels=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base.update(kw)
    return transformers.ViTConfig(**base)


def _randomise(model):
    # HF init zeros the biases and sets LayerNorm to (1, 0): perturb everything so each weight is checked
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def test_vit_classifier_parity(tmp_path):
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(_cfg(num_labels=5)).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        ref = hf(pixel_values=x).logits
        got = ours(x).logits
    assert got.shape == (3, 5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_vit_model_hidden_and_pooler_parity(tmp_path, act):
    torch.manual_seed(1)
    hf = transformers.ViTModel(_cfg(hidden_act=act, num_channels=3)).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.config.head == "none" and ours.config.pooler
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref = hf(pixel_values=x)
        out = ours(x)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.pooled, ref.pooler_output, atol=1e-4, rtol=1e-4)


def test_vit_interpolated_positions_match_hf(tmp_path):
    torch.manual_seed(2)
    hf = transformers.ViTForImageClassification(_cfg(num_labels=3)).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    x = torch.randn(2, 1, 12, 12)  # a 6x6 patch grid instead of the trained 4x4
    with torch.no_grad():
        ref = hf(pixel_values=x, interpolate_pos_encoding=True).logits
        got = ours(x).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_vit_unsupported_layouts_are_clear_errors(tmp_path):
    from qkv.checkpoint import CheckpointError

    torch.manual_seed(3)
    transformers.ViTModel(_cfg(qkv_bias=False)).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="qkv_bias"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf(tmp_path)


@pytest.mark.parametrize("option, message", [({"pooler_act": "relu"}, "pooler_act is 'relu'"),
                                              ({"pooler_output_size": 24}, "pooler_output_size")])
def test_vit_pooler_options_are_refused_not_ignored(tmp_path, option, message):
    # a relu pooler loaded as tanh gave pooled outputs 0.19 away from transformers' with no word
    from qkv.checkpoint import CheckpointError

    transformers.ViTModel(_cfg(**option)).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        load_hf(tmp_path)


def test_vit_folders_of_another_architecture_or_more_layers_are_refused(tmp_path):
    # the loader picked keys by name: a masked-image-modeling folder loaded as a plain ViT with its decoder
    # dropped, and a 3-layer file under a 2-layer config.json loaded truncated
    import json

    from qkv.checkpoint import CheckpointError

    transformers.ViTForMaskedImageModeling(_cfg()).save_pretrained(tmp_path / "mim")
    with pytest.raises(CheckpointError, match="unexpected key"):
        load_hf(tmp_path / "mim")
    transformers.ViTForImageClassification(_cfg(num_hidden_layers=3)).save_pretrained(tmp_path / "three")
    meta = json.loads((tmp_path / "three" / "config.json").read_text())
    (tmp_path / "three" / "config.json").write_text(json.dumps({**meta, "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers is 2, but .* holds 3 layers"):
        load_hf(tmp_path / "three")


def test_vit_half_sharded_and_corrupt_folders(tmp_path):
    from qkv.checkpoint import CheckpointError

    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(_cfg()).eval()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # every other family loaded these already
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "sharded")(x).logits, hf(pixel_values=x).logits,
                                   atol=1e-5, rtol=1e-5)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    # was loaded as fp32
    assert {p.dtype for p in load_hf(tmp_path / "bf16").parameters()} == {torch.bfloat16}
    f = tmp_path / "bf16" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:300])
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):  # was a raw SafetensorError
        load_hf(tmp_path / "bf16")
