"""LoRA: the trainable count is the formula, merged == unmerged, only adapters train, the decoding step
agrees with the forward pass, and the fused q/k/v projection is adapted slice by slice."""

from __future__ import annotations

import pytest
import torch

from qkv.config import ConfigError
from qkv.finetune.lora import (
    LoRAConfig,
    LoRALinear,
    apply_lora,
    lora_layers,
    merge_lora,
    resolve_targets,
    set_merged,
)
from qkv.models.gpt import GPT, GPTConfig

D, H, L, V, FF = 32, 4, 2, 50, 64


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, n_layers=L, d_model=D, n_heads=H, d_ff=FF, context_length=24, ffn="gelu_tanh")
    return GPT(GPTConfig(**{**cfg, **kw})).eval()


def _perturb(model) -> None:
    """B starts at zero (the adapter is a no-op): give it values so that the comparisons mean something."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in lora_layers(model):
            for B in m.lora_B:
                B.copy_(torch.randn(B.shape, generator=g) * 0.1)


@pytest.mark.parametrize("targets,kv_heads,per_layer", [
    # the formula r * (in + out) per adapted matrix, written from the shapes, not read from the code
    (["q", "v"], None, [(D, D), (D, D)]),
    (["q_proj", "k_proj", "v_proj", "o_proj"], 2, [(D, D), (D, D // 2), (D, D // 2), (D, D)]),  # GQA 2:1
    # all-linear: the fused qkv_proj as its q, k, v slices (the HF model's q_proj, k_proj, v_proj), not one
    # adapter
    (["all-linear"], None, [(D, D), (D, D), (D, D), (D, D), (D, FF), (FF, D)]),
    (["all-linear"], 2, [(D, D), (D, D // 2), (D, D // 2), (D, D), (D, FF), (FF, D)]),
    (["qkv_proj", "up"], None, [(D, 3 * D), (D, FF)]),
])
def test_trainable_count_is_the_formula(targets, kv_heads, per_layer):
    r = 4
    model = _gpt(n_kv_heads=kv_heads)
    info = apply_lora(model, LoRAConfig(rank=r, alpha=8, targets=targets))
    assert info["trainable"] == L * sum(r * (i + o) for i, o in per_layer)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_a_fresh_adapter_changes_nothing_and_only_adapters_get_gradients():
    model = _gpt()
    x = torch.randint(0, V, (2, 12))
    before = model(x).logits
    apply_lora(model, LoRAConfig(rank=4, targets=["all-linear"]))
    assert torch.equal(model(x).logits, before)  # B = 0
    model.train()
    model(x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, n
        else:
            assert p.grad is None, n
    # B = 0 at start, so A's gradient is zero and B's is not (Hu et al.: the update starts from zero)
    assert all(m.lora_B[0].grad.abs().sum() > 0 for _, m in lora_layers(model))


@pytest.mark.parametrize("targets", [["q", "v"], ["all-linear"], ["k", "out_proj", "down"]])
def test_merged_weights_give_the_adapter_logits(targets):
    model = _gpt(n_kv_heads=2)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoRAConfig(rank=4, alpha=16, targets=targets))
    _perturb(model)
    x = torch.randint(0, V, (3, 16))
    unmerged = model(x).logits
    assert (unmerged - _gpt(n_kv_heads=2)(x).logits).abs().max() > 1e-3  # the adapter does something
    set_merged(model, True)
    torch.testing.assert_close(model(x).logits, unmerged, atol=1e-5, rtol=0)
    set_merged(model, False)  # unmerge restores the frozen weights
    for k, v in base.items():
        torch.testing.assert_close(model.state_dict()[k], v, atol=1e-6, rtol=0)
    merge_lora(model)  # adapters folded in and removed: an ordinary model with the original keys
    assert not lora_layers(model) and set(model.state_dict()) == set(base)
    torch.testing.assert_close(model(x).logits, unmerged, atol=1e-5, rtol=0)


def test_slices_adapt_only_their_columns():
    """targets=['k'] on a fused qkv_proj with GQA: the output changes only on the key columns."""
    model = _gpt(n_kv_heads=2)
    attn = model.decoder.blocks[0].attn
    C, kv = attn.d_model, attn.n_kv_heads * attn.head_dim
    x = torch.randn(2, 5, D)
    ref = attn.qkv_proj(x)
    apply_lora(model, LoRAConfig(rank=2, targets=["k"]))
    _perturb(model)
    diff = (attn.qkv_proj(x) - ref).abs().amax(dim=(0, 1))
    assert diff[C:C + kv].min() > 0
    assert diff[:C].max() == 0 and diff[C + kv:].max() == 0


def test_decoding_step_with_an_unmerged_adapter():
    """Linear.step is the generation path: with an adapter it must give the forward pass's logits, and
    greedy generation equals the merged model's."""
    model = _gpt(n_kv_heads=2)
    apply_lora(model, LoRAConfig(rank=4, targets=["q", "v", "up", "out_proj"]))
    _perturb(model)
    ids = torch.randint(0, V, (2, 8))
    full = model(ids).logits[:, -1]
    cache = model.make_cache(2, 24)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
        step = model.step(ids[:, -1:], cache)
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
    out_adapter = model.generate(ids, max_new_tokens=10, do_sample=False)
    merge_lora(model)
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), out_adapter)


def test_gated_ffn_step_keeps_unmerged_adapters_on_gate_and_up():
    """An unmerged adapter on a gated FFN's gate or up is used by the decoding step: greedy generation equals
    the greedy loop over full forward passes and the merged model's generation."""
    model = _gpt(n_kv_heads=2, ffn="swiglu")
    apply_lora(model, LoRAConfig(rank=4, targets=["gate", "up"]))
    _perturb(model)
    ids = torch.randint(0, V, (1, 6))
    cache = model.make_cache(1, 24)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
        step = model.step(ids[:, -1:], cache)
        torch.testing.assert_close(step, model(ids).logits[:, -1], atol=1e-5, rtol=1e-5)
    got = model.generate(ids, max_new_tokens=12, do_sample=False)
    ref = ids
    with torch.no_grad():
        for _ in range(12):
            ref = torch.cat([ref, model(ref).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got, ref)
    set_merged(model, True)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), ref)


def test_bad_targets_are_clear_errors():
    with pytest.raises(ConfigError, match="matches no linear layer.*layer names: .*qkv_proj"):
        apply_lora(_gpt(), LoRAConfig(targets=["c_attn"]))
    with pytest.raises(ConfigError, match="shares its weight with tok_emb.weight"):
        apply_lora(_gpt(), LoRAConfig(targets=["lm_head"]))
    with pytest.raises(ConfigError, match="--lora-rank must be at least 1"):
        apply_lora(_gpt(), LoRAConfig(rank=0))
    plan = resolve_targets(_gpt(), ["*.blocks.1.ffn.*"])
    assert sorted(plan) == ["decoder.blocks.1.ffn.down", "decoder.blocks.1.ffn.up"]
    assert isinstance(LoRALinear, type)
