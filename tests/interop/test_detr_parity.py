"""Hugging Face DetrForObjectDetection folders (transformers' own ResNet backbone) -> qkv DETR: logits and
boxes equal transformers' on random weights (every parameter and BatchNorm statistic redrawn, so nothing is
near zero), with and without auxiliary_loss (which changes transformers' decoder), bottleneck and basic
backbones, a backbone read before its last stage, a padded batch (pixel_mask), in float32 and in float64;
the auxiliary outputs equal transformers'; the loss equals transformers' on the same targets; the in-memory
key names load too; what cannot load is one clear error naming why."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import qkv
from qkv.models.detr import DETR
from qkv.storage import CheckpointError

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy")


def hf_detr(aux: bool, layer_type: str = "basic", out_stage: int = 2, **kw):
    torch.manual_seed(0)
    widths = [8, 16, 24] if layer_type == "basic" else [16, 32, 48]
    backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=widths, depths=[1, 2, 1],
                                         layer_type=layer_type, out_features=[f"stage{out_stage}"])
    cfg = transformers.DetrConfig(backbone_config=backbone, d_model=16, encoder_layers=2, decoder_layers=3,
                                  encoder_ffn_dim=24, decoder_ffn_dim=40, encoder_attention_heads=2,
                                  decoder_attention_heads=4, num_queries=5, num_labels=3, auxiliary_loss=aux,
                                  **kw)
    model = transformers.DetrForObjectDetection(cfg).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if "running_var" in name:
                t.uniform_(0.5, 2.0)
            elif t.dim() > 1:  # unit gain per layer: values neither vanish nor explode through the layers
                t.copy_(torch.randn_like(t) / (t[0].numel() ** 0.5 if "embeddings" not in name else 1.0))
            elif t.is_floating_point():  # norm gains around 1, biases and statistics around 0
                t.copy_(torch.randn_like(t) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    return model


def save(model, folder):
    model.save_pretrained(folder)
    return folder


def targets():
    return [{"class_labels": torch.tensor([0, 2]),
             "boxes": torch.tensor([[0.25, 0.3, 0.3, 0.3], [0.7, 0.7, 0.35, 0.4]])},
            {"class_labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.6, 0.2]])}]


@pytest.mark.parametrize("aux,layer_type,out_stage", [(False, "basic", 3), (True, "basic", 2),
                                                      (True, "bottleneck", 3)])
def test_outputs_equal_transformers(tmp_path, aux, layer_type, out_stage):
    ref = hf_detr(aux, layer_type, out_stage)
    model = qkv.from_pretrained(save(ref, tmp_path / "detr"))
    assert isinstance(model, DETR) and not model.training
    assert len(model.backbone.stages) == out_stage and model.config.backbone.block == layer_type
    x = torch.randn(2, 3, 48, 64)
    with torch.no_grad():
        want = ref(pixel_values=x, labels=targets())
        got = model(x, labels=targets())
    assert want.logits.abs().max() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.pred_boxes, want.pred_boxes, rtol=1e-4, atol=1e-5)
    assert len(got.aux_outputs) == (2 if aux else 0)
    for (lg, bx), ref_aux in zip(got.aux_outputs, want.auxiliary_outputs or [], strict=True):
        torch.testing.assert_close(lg, ref_aux["logits"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(bx, ref_aux["pred_boxes"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-4)
    if aux:  # the comparison sees the decoder's renormalisation: without it the outputs differ
        model.config.renorm_intermediate = False
        with torch.no_grad():
            assert not torch.allclose(model(x).logits, want.logits, rtol=1e-3, atol=1e-3)


def test_padded_batch_equals_transformers(tmp_path):
    ref = hf_detr(False, "basic", 3)
    model = qkv.from_pretrained(save(ref, tmp_path / "detr"))
    x = torch.randn(2, 3, 64, 64)
    mask = torch.ones(2, 64, 64, dtype=torch.long)
    mask[1, 40:], mask[1, :, 24:] = 0, 0  # the second image is 40 x 24, padded to the batch's 64 x 64
    x[1] *= mask[1]
    with torch.no_grad():
        want, got = ref(pixel_values=x, pixel_mask=mask), model(x, pixel_mask=mask)
        unmasked = model(x).logits
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.pred_boxes, want.pred_boxes, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(unmasked[1], want.logits[1], rtol=1e-3, atol=1e-3)  # the mask mattered


def test_a_loaded_folder_fine_tunes_with_its_batch_norms_frozen(tmp_path):
    model = qkv.from_pretrained(save(hf_detr(True), tmp_path / "detr")).train()
    stats = {k: v.clone() for k, v in model.backbone.state_dict().items() if "bn." in k}
    assert stats and not any("bn." in name for name, _ in model.backbone.named_parameters())
    conv = model.backbone.stages[0][0].branch[0].conv.weight
    before = conv.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 3, 32, 32), labels=targets()).loss.backward()
    opt.step()
    assert not torch.equal(conv, before)  # the convolutions train
    for k, v in model.backbone.state_dict().items():
        if k in stats:
            assert torch.equal(v, stats[k]), k  # the BatchNorms do not, in train mode either


def test_float64_outputs_equal_transformers_to_rounding(tmp_path):
    ref = hf_detr(True, "bottleneck", 3).double()
    model = qkv.from_pretrained(save(ref, tmp_path / "detr")).double()
    x = torch.randn(1, 3, 40, 56, dtype=torch.float64)
    with torch.no_grad():
        want, got = ref(pixel_values=x), model(x)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.pred_boxes, want.pred_boxes, rtol=1e-10, atol=1e-10)


def test_in_memory_key_names_load(tmp_path):
    ref = hf_detr(False)
    folder = save(ref, tmp_path / "detr")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}  # o_proj, mlp.fc1, backbone.model
    assert any(".o_proj." in k for k in state) and any(".mlp.fc1." in k for k in state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(qkv.from_pretrained(folder)(x).logits, ref(pixel_values=x).logits,
                                   rtol=1e-4, atol=1e-4)


def edit_config(folder, **changes):
    meta = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    (folder / "config.json").write_text(json.dumps(meta))


def test_what_cannot_load_is_one_clear_error(tmp_path):
    folder = save(hf_detr(False), tmp_path / "detr")
    edit_config(folder, backbone_config={"model_type": "timm_backbone", "backbone": "resnet50"})
    with pytest.raises(CheckpointError, match="timm backbone.*resnet50.*use_timm_backbone=false"):
        qkv.from_pretrained(folder)
    edit_config(folder, backbone_config=None, use_timm_backbone=True, backbone="resnet50")
    with pytest.raises(CheckpointError, match="timm backbone"):
        qkv.from_pretrained(folder)

    folder = save(hf_detr(False), tmp_path / "learned")
    edit_config(folder, position_embedding_type="learned")
    with pytest.raises(CheckpointError, match="position_embedding_type 'learned'"):
        qkv.from_pretrained(folder)
    edit_config(folder, position_embedding_type="sine", decoder_layers=4)
    with pytest.raises(CheckpointError, match="decoder_layers is 4, but .* holds 3 layers"):
        qkv.from_pretrained(folder)

    edit_config(folder, decoder_layers=3)
    state = load_file(folder / "model.safetensors")
    save_file({f"detr.{k}": v for k, v in state.items()}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="DetrForSegmentation"):
        qkv.from_pretrained(folder)
    save_file({k: v for k, v in state.items() if "classifier" not in k and "bbox" not in k},
              folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="without detection heads"):
        qkv.from_pretrained(folder)
