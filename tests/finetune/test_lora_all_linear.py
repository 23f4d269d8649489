"""LoRA all-linear == listing every Linear's Hugging Face name: a fused q/k/v projection gets one adapter per
q / k / v slice (as PEFT's all-linear puts one on each of the transformers model's q_proj, k_proj, v_proj),
not one shared adapter over the fused rows. Same modules and slices, same count, same merged weights."""

from __future__ import annotations

import pytest
import torch

from qkv.finetune.lora import LoRAConfig, apply_lora, lora_layers, merge_lora, set_merged
from qkv.models.encdec import EncoderDecoder, EncoderDecoderConfig

HF_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R = 4


def _perturb(model, seed: int = 1) -> None:
    """B starts at zero (the adapter is a no-op): random B so that the comparisons mean something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_layers(model):
            for B in m.lora_B:
                B.copy_(torch.randn(B.shape, generator=g) * 0.1)


def _hf_linears(folder) -> list[tuple[str, int, int]]:
    """(name, in, out) of every nn.Linear of the transformers model except its output head (PEFT's
    all-linear)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    head = hf.get_output_embeddings()
    return [(n, m.in_features, m.out_features) for n, m in hf.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head]


def _adapted(model) -> set[tuple[str, tuple[int, int]]]:
    return {(n, s) for n, m in lora_layers(model) for s in m.slices}


def test_all_linear_on_a_llama_folder_is_every_hf_linear(llama_chat):
    """Tiny Llama (hidden 64, 4 heads x 16, 2 KV heads, ffn 128, 2 layers, untied head)."""
    from qkv import from_pretrained

    a, b = from_pretrained(llama_chat), from_pretrained(llama_chat)
    info_a = apply_lora(a, LoRAConfig(rank=R, targets=["all-linear"]))
    info_b = apply_lora(b, LoRAConfig(rank=R, targets=HF_NAMES))
    # the formula, written from the shapes: q 64->64, k 64->32, v 64->32, o 64->64, gate/up 64->128, down
    # 128->64
    per_layer = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]
    expected = 2 * sum(R * (i + o) for i, o in per_layer)
    assert expected == 8192
    assert info_a["trainable"] == info_b["trainable"] == expected
    # ... and read from the transformers model: one adapter r * (in + out) per Linear but lm_head
    hf = _hf_linears(llama_chat)
    assert len(hf) == 2 * 7 and sum(R * (i + o) for _, i, o in hf) == expected
    # the same (module, output slice) pairs: the fused qkv_proj as its q, k, v slices, the head left alone
    assert info_a["modules"] == info_b["modules"]
    assert _adapted(a) == _adapted(b)
    for blk in range(2):
        assert info_a["modules"][f"decoder.blocks.{blk}.attn.qkv_proj"] == [(0, 64), (64, 96), (96, 128)]
    assert not any("lm_head" in n for n in info_a["modules"])
    assert len(_adapted(a)) == len(hf)


def test_all_linear_merged_weights_are_the_explicit_names_and_give_the_adapter_logits(llama_chat):
    from qkv import from_pretrained

    a, b = from_pretrained(llama_chat).float().eval(), from_pretrained(llama_chat).float().eval()
    apply_lora(a, LoRAConfig(rank=R, alpha=8, targets=["all-linear"]))
    apply_lora(b, LoRAConfig(rank=R, alpha=8, targets=HF_NAMES))
    _perturb(a)
    b.load_state_dict(a.state_dict())  # same keys (same adapters), so the same A and B values
    x = torch.randint(0, 400, (2, 20))
    with torch.no_grad():
        unmerged = a(x).logits
        assert (unmerged - from_pretrained(llama_chat).float().eval()(x).logits).abs().max() > 1e-3
        torch.testing.assert_close(b(x).logits, unmerged, atol=1e-6, rtol=0)
        set_merged(a, True)
        torch.testing.assert_close(a(x).logits, unmerged, atol=1e-5, rtol=0)
        merge_lora(a), merge_lora(b)
        sa, sb = a.state_dict(), b.state_dict()
        assert set(sa) == set(sb)
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], atol=0, rtol=0)
        torch.testing.assert_close(a(x).logits, unmerged, atol=1e-5, rtol=0)


def test_all_linear_count_is_peft_on_the_transformers_model(llama_chat):
    peft = pytest.importorskip("peft")
    import transformers

    from qkv import from_pretrained

    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_chat)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=R, lora_alpha=8, target_modules="all-linear"))
    n_peft = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    info = apply_lora(from_pretrained(llama_chat), LoRAConfig(rank=R, targets=["all-linear"]))
    assert info["trainable"] == n_peft


def test_all_linear_splits_cross_attention_kv_too():
    """An encoder-decoder: the cross-attention's fused kv_proj is its k and v slices (transformers' T5, BART,
    Marian and Whisper have separate k_proj / v_proj there); its q_proj is a whole Linear already."""
    torch.manual_seed(0)
    D, FF, KV = 32, 64, 16
    cfg = EncoderDecoderConfig(src_vocab_size=50, n_encoder_layers=1, n_decoder_layers=1, d_model=D,
                               n_heads=4, n_kv_heads=2, d_ff=FF, context_length=16, dropout=0.0)
    a, b = EncoderDecoder(cfg).eval(), EncoderDecoder(cfg).eval()
    info_a = apply_lora(a, LoRAConfig(rank=R, targets=["all-linear"]))
    info_b = apply_lora(b, LoRAConfig(rank=R, targets=[t for t in HF_NAMES if t != "gate_proj"]))  # no gate
    assert info_a["modules"] == info_b["modules"]
    assert info_a["modules"]["decoder.blocks.0.cross.kv_proj"] == [(0, KV), (KV, 2 * KV)]
    assert info_a["modules"]["decoder.blocks.0.cross.q_proj"] == [(0, D)]
    assert info_a["modules"]["encoder.blocks.0.attn.qkv_proj"] == [(0, D), (D, D + KV), (D + KV, D + 2 * KV)]
    # q, k, v, o of two self-attentions and one cross-attention; up, down of two FFNs
    per = 3 * [(D, D), (D, KV), (D, KV), (D, D)] + 2 * [(D, FF), (FF, D)]
    assert info_a["trainable"] == info_b["trainable"] == sum(R * (i + o) for i, o in per)
    _perturb(a)
    src, tgt = torch.randint(3, 50, (2, 9)), torch.randint(3, 50, (2, 7))
    with torch.no_grad():
        unmerged = a(src, decoder_input_ids=tgt).logits
        set_merged(a, True)
        torch.testing.assert_close(a(src, decoder_input_ids=tgt).logits, unmerged, atol=1e-5, rtol=0)
