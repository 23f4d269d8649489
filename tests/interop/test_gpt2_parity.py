"""HF GPT2LMHeadModel with tiny random configs, saved to tmp_path (no download), loaded through
qkv.from_pretrained: logits equal HF's within 1e-4 (fp32), with and without padding masks; greedy
generation equals HF generate() token for token; the exporter writes a folder HF loads back."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from qkv.models.gpt import GPT  # noqa: E402

VOCAB = 97


def _hf_gpt2(noise: float = 0.05, **kw) -> transformers.GPT2LMHeadModel:
    cfg = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=48, layer_norm_epsilon=1e-5,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg.update(kw)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()
    # HF init zeros the biases and sets LayerNorms to (1, 0): perturb every tensor so each one is checked
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model


@pytest.mark.parametrize("kw", [
    {},
    {"n_inner": 40, "layer_norm_epsilon": 1e-6, "activation_function": "gelu_pytorch_tanh"},
    {"activation_function": "relu", "tie_word_embeddings": False},
    {"scale_attn_weights": False, "n_layer": 3},
], ids=["default", "n_inner-eps", "relu-untied", "unscaled"])
def test_gpt2_logits_parity(tmp_path, kw):
    hf = _hf_gpt2(**kw)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    assert isinstance(ours, GPT) and not ours.training
    assert ours.config.n_layers == hf.config.n_layer and ours.config.d_ff == (hf.config.n_inner or 128)
    assert ours.num_parameters() == hf.num_parameters()
    # 160 rows: the linears take oneDNN where "auto" does (AVX-512; see qkv.nn.linear)
    x = torch.randint(0, VOCAB, (4, 40))
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x).logits
    assert ref.std() > 0.1  # non-degenerate outputs: the comparison below means something
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_gpt2_loss_and_gradients_equal_hf(tmp_path):
    """Training parity: same loss and same parameter gradients (the benchmark's claim of computing the
    same function rests on this)."""
    hf = _hf_gpt2()
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path).train()
    hf.train()
    x = torch.randint(0, VOCAB, (4, 40))
    lo, lh = ours(x, labels=x).loss, hf(x, labels=x).loss
    torch.testing.assert_close(lo, lh, atol=1e-5, rtol=1e-5)
    lo.backward()
    lh.backward()
    pairs = {"tok_emb.weight": "transformer.wte.weight", "decoder.position.weight": "transformer.wpe.weight",
             "decoder.blocks.1.ffn.up.weight": "transformer.h.1.mlp.c_fc.weight",
             "decoder.blocks.0.attn.qkv_proj.weight": "transformer.h.0.attn.c_attn.weight",
             "decoder.blocks.0.attn.qkv_proj.bias": "transformer.h.0.attn.c_attn.bias"}
    ours_p, hf_p = dict(ours.named_parameters()), dict(hf.named_parameters())
    for o, h in pairs.items():
        want = hf_p[h].grad
        want = want.t() if want.dim() == 2 and "h." in h else want  # Conv1D stores (in, out)
        torch.testing.assert_close(ours_p[o].grad, want, atol=1e-5, rtol=1e-4)


def test_gpt2_right_padding_mask(tmp_path):
    """Right padding with attention_mask: every real position equals HF's."""
    hf = _hf_gpt2()
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    x = torch.randint(0, VOCAB, (3, 12))
    mask = torch.ones_like(x)
    mask[1, 8:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        ref = hf(x, attention_mask=mask).logits
        got = ours(x, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=1e-4)


def test_gpt2_left_padding_with_position_offsets(tmp_path):
    """Left padding: HF takes position_ids = cumsum(mask) - 1; we take a per-sequence negative offset.
    Real tokens must see the same positions and the same keys, so their logits agree."""
    hf = _hf_gpt2()
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    x = torch.randint(0, VOCAB, (3, 10))
    pads = torch.tensor([0, 4, 7])
    mask = (torch.arange(10).unsqueeze(0) >= pads.unsqueeze(1)).long()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, position_ids=pos).logits
        got = ours(x, attention_mask=mask, offset=-pads).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=1e-4)
    # and the unpadded row equals the same sequence run alone
    with torch.no_grad():
        alone = hf(x[:1]).logits
    torch.testing.assert_close(got[0], alone[0], atol=1e-4, rtol=1e-4)


def test_gpt2_greedy_generation_equals_hf_generate(tmp_path):
    hf = _hf_gpt2(noise=0.2, n_layer=3, n_positions=64)  # larger weights: a varied continuation
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    prompt = torch.randint(1, VOCAB, (2, 7))
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=20)
    got = ours.generate(prompt, 20)
    assert ref.shape == (2, 27)
    assert torch.equal(got, ref)
    assert len(set(ref[0, 7:].tolist())) > 1  # not a constant continuation


def test_gpt2_pytorch_model_bin_and_legacy_keys(tmp_path):
    """An older-style folder: pytorch_model.bin (read with weights_only=True), the tied lm_head stored,
    and GPT2Attention's causal-mask buffers present; all of that loads to the same model."""
    hf = _hf_gpt2()
    hf.config.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    assert "lm_head.weight" in state
    for i in range(hf.config.n_layer):
        state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(48, 48, dtype=torch.bool)).view(1, 1,
                                                                                                      48, 48)
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, tmp_path / "pytorch_model.bin")
    ours = qkv.from_pretrained(tmp_path)
    x = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-4, rtol=1e-4)


def test_gpt2_base_model_folder_and_sharded_safetensors(tmp_path):
    """A GPT2Model folder (no 'transformer.' prefix, no head), written in several shards."""
    lm = _hf_gpt2()
    base = lm.transformer
    base.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = qkv.from_pretrained(tmp_path)
    x = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).last_hidden_state, base(x).last_hidden_state, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours(x).logits, lm(x).logits, atol=1e-4, rtol=1e-4)


def test_export_roundtrip_through_hf(tmp_path):
    """qkv GPT -> HF folder -> GPT2LMHeadModel.from_pretrained gives our logits."""
    from qkv.interop.gpt2 import export_gpt2

    ours = qkv.build("gpt-nano", dropout=0.0).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export_gpt2(ours, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    x = torch.randint(0, ours.config.vocab_size, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x).logits, atol=1e-4, rtol=1e-4)


def test_export_refuses_non_gpt2_shapes(tmp_path):
    from qkv.checkpoint import CheckpointError
    from qkv.interop.gpt2 import export_gpt2

    with pytest.raises(CheckpointError, match="GPT-2-shaped"):
        export_gpt2(qkv.build("gpt-nano", position="rope"), tmp_path)


def test_gpt2_last_only_equals_hf_logits_to_keep(tmp_path):
    """The prefill path (last_only: the top block works on the last position only) against transformers'
    logits_to_keep=1 (benchmarks/prefill.py times these two calls)."""
    hf = _hf_gpt2(n_layer=3)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        ref = hf(x, logits_to_keep=1).logits[:, -1]
        got = ours(x, last_only=True).logits[:, -1]
    assert ref.std() > 0.1
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_token_ids_of_config_json_are_kept_and_exported(tmp_path):
    """A GPT-2 folder without generation_config.json: generate() stops at config.json's eos as transformers
    does, and an export writes the model's ids back, not vocab_size - 1."""
    from qkv.interop.gpt2 import export_gpt2

    cfg = transformers.GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                  bos_token_id=5, eos_token_id=7)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "in")
    (tmp_path / "in" / "generation_config.json").unlink(missing_ok=True)
    ours = qkv.from_pretrained(tmp_path / "in")
    defaults = ours.generation_defaults()
    assert defaults["eos_token_id"] == 7 and defaults["bos_token_id"] == 5
    export_gpt2(ours, tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta["eos_token_id"] == 7 and meta["bos_token_id"] == 5
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").eos_token_id == 7


@pytest.mark.parametrize("early_stopping", [False, "never"])
def test_beam_search_with_several_eos_ids_equals_hf(tmp_path, early_stopping):
    """Three eos ids among the best first candidates: every beam still gets an open candidate (transformers
    keeps (1 + number of eos ids) x num_beams of them, as qkv now does), so both return the same beams and
    scores."""
    hf = _hf_gpt2(noise=0.3, n_layer=2, n_positions=64)
    hf.save_pretrained(tmp_path)
    ours = qkv.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(3)
    for _ in range(12):
        prompt = torch.randint(1, VOCAB, (1, 5), generator=g)
        with torch.no_grad():
            first = hf(prompt).logits[0, -1].topk(4).indices.tolist()
        eos = first[1:]  # the 2nd..4th best first tokens: 2 x num_beams candidates would leave one open beam
        # not 0: transformers fills with eos for a pad of 0
        pad = next(i for i in range(1, VOCAB) if i not in eos)
        # length_penalty 2: long open beams beat the one-token eos hypotheses, so the open beams decide the
        # result
        kw = dict(num_beams=2, eos_token_id=eos, pad_token_id=pad, max_new_tokens=4,
                  early_stopping=early_stopping, num_return_sequences=2, length_penalty=2.0)
        with torch.no_grad():
            ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              output_scores=True, return_dict_in_generate=True, **kw)
        got = ours.generate(prompt, return_dict=True, **kw)
        assert got.sequences.tolist() == ref.sequences.tolist()
        torch.testing.assert_close(got.scores, ref.sequences_scores, atol=1e-5, rtol=0)
