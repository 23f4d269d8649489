"""Graph-captured decoding (generate(..., compile=...), qkv/generate/graphed.py): the same tokens as the eager
decoding step, ONE traced graph for every position, clear errors where it does not apply. backend "eager" /
"aot_eager" trace the step exactly as Inductor would receive it (fullgraph=True, so a graph break fails
here) without generating code; mode="reduce-overhead" (CUDA graphs) is exercised by the CUDA test
tests/generate/test_graphed_cuda.py and benchmarks/gpu.py."""

from __future__ import annotations

import pytest
import torch
from _genmodels import tiny_encdec, tiny_gpt

import qkv
from qkv.config import ConfigError
from qkv.generate import generate
from qkv.generate.graphed import GraphedSteps
from qkv.nn.quant import Int8WeightOnlyLinear, quantize_model


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_gpt_greedy_tokens_equal_eager_with_left_padding_and_one_graph():
    torch._dynamo.reset()
    m = tiny_gpt("learned")
    ids = torch.randint(0, 11, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :4] = 0
    want = generate(m, ids, 12, attention_mask=mask)
    before = _unique_graphs()
    got = generate(m, ids, 12, attention_mask=mask, compile="eager")
    assert torch.equal(got, want)
    # one graph for all 11 decoding steps: no shape depends on the position
    assert _unique_graphs() - before == 1
    again = generate(m, ids, 12, attention_mask=mask, compile="eager")  # the compiled step is kept per model
    assert torch.equal(again, want) and _unique_graphs() - before == 1
    # another length: the cache is sized in buckets (capped at the context), so the same graph serves it
    shorter = generate(m, ids[1:], 7, attention_mask=mask[1:], compile="eager")
    assert torch.equal(shorter, generate(m, ids[1:], 7, attention_mask=mask[1:]))
    assert _unique_graphs() - before == 2  # batch 2 is a new shape; 7 new tokens are not
    # the same batch, other lengths: the token buffer's row stride changes, the compiled step's input must not
    for new in (3, 20):
        assert torch.equal(generate(m, ids, new, attention_mask=mask, compile="eager"),
                           generate(m, ids, new, attention_mask=mask))
    assert _unique_graphs() - before == 2


def test_llama_style_sampling_and_encoder_decoder_equal_eager():
    """RoPE + GQA + RMSNorm + SwiGLU + q/k norm (Llama/Qwen3 shapes), sampling with a seed, aot_eager (the
    functionalised graph Inductor compiles: the in-place cache writes are rewritten there); and an
    encoder-decoder's decoder with cross-attention over the cached encoder keys."""
    m = tiny_gpt("rope", gqa=True, norm="rmsnorm", ffn="swiglu", bias=False, qk_norm=True)
    ids = torch.randint(0, 11, (2, 4))
    opts = dict(do_sample=True, top_k=5, seed=3)
    assert torch.equal(generate(m, ids, 10, compile="aot_eager", **opts), generate(m, ids, 10, **opts))
    e = tiny_encdec("sinusoidal")
    src = torch.randint(3, 11, (2, 6))
    src_mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    want = generate(e, src, 8, attention_mask=src_mask)
    assert torch.equal(generate(e, src, 8, attention_mask=src_mask, compile="eager"), want)


@pytest.mark.slow
def test_inductor_compiled_greedy_equals_eager_and_keeps_its_code_under_the_qkv_cache(tmp_path, monkeypatch):
    """compile=True on the CPU: Inductor's generated code (not only a trace) gives eager's greedy tokens, and
    that code is kept under $QKV_CACHE/inductor, where a second process finds it."""
    # recorded, so the test leaves it as it found it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-below")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("QKV_CACHE", str(tmp_path))
    torch._dynamo.reset()
    m = tiny_gpt("rope", gqa=True, norm="rmsnorm", ffn="swiglu", bias=False)
    ids = torch.randint(0, 11, (2, 4))
    import os

    assert torch.equal(generate(m, ids, 8, compile=True), generate(m, ids, 8))
    kept = [p.suffix for p in (tmp_path / "inductor").rglob("*") if p.is_file()]
    assert ".py" in kept or ".cpp" in kept, (os.environ.get("TORCHINDUCTOR_CACHE_DIR"), kept)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compiled_step_sees_weights_changed_after_it_was_compiled():
    """On a CPU the compiled step holds its weights as constants (frozen): a weight changed in place since (a
    training step) must compile again, not decode with the old values."""
    torch._dynamo.reset()
    m = tiny_gpt("rope", gqa=True, norm="rmsnorm", ffn="swiglu", bias=False)
    ids = torch.randint(0, 11, (1, 4))
    assert torch.equal(generate(m, ids, 6, compile=True), generate(m, ids, 6))
    with torch.no_grad():
        m.lm_head.weight.mul_(-1.0)  # every logit changes sign
    want = generate(m, ids, 6)
    assert torch.equal(generate(m, ids, 6, compile=True), want)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_cpu_step_at_batch_one_gives_the_eager_steps_logits():
    """compile=True on a CPU at batch 1, where Inductor computes each one-row product as a fused reduction
    (graphed.cpu_options): the logits equal the eager step's to fp32 rounding, step after step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = tiny_gpt("rope", gqa=True, norm="rmsnorm", ffn="swiglu", bias=False)
    ids = torch.randint(0, 11, (1, 4))
    eager, static = m.make_cache(1, 16), m.make_cache(1, 16)
    with torch.no_grad():
        m.prefill(ids, eager)
        m.prefill(ids, static)
        steps = GraphedSteps(m, True, static, None, None)
        for t in range(6):
            tok = torch.tensor([[t + 1]])
            torch.testing.assert_close(steps(tok), m.step(tok, eager), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compiled_int8_model_equals_its_eager_decoding():
    """The weight-only int8 model (bf16) through the compiled step: the tokens eager int8 gives."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = quantize_model(tiny_gpt("rope", gqa=True, norm="rmsnorm", ffn="swiglu", bias=False)
                       .to(torch.bfloat16), "int8")
    ids = torch.randint(0, 11, (1, 4))
    assert torch.equal(generate(m, ids, 8, compile=True), generate(m, ids, 8))
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_int8_step_at_batch_one_is_the_dequantized_product():
    """An fp32 model's int8 layers in the compiled batch-1 step, where each product is a reduction over the
    int8 codes with fp32 sums: the logits of the same model with every layer an nn.Linear of its
    dequantized weight q * scale (an independent reference), to fp32 rounding, step after step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = quantize_model(tiny_gpt("rope", gqa=True, norm="rmsnorm", ffn="swiglu", bias=False), "int8")
    ref = quantize_model(tiny_gpt("rope", gqa=True, norm="rmsnorm", ffn="swiglu", bias=False), "int8")
    ref.load_state_dict(m.state_dict())
    layers = [name for name, mod in ref.named_modules() if isinstance(mod, Int8WeightOnlyLinear)]
    assert layers
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        q = ref.get_submodule(name)
        lin = torch.nn.Linear(q.in_features, q.out_features, bias=False)
        lin.weight.data.copy_(q.dequantized())
        setattr(ref.get_submodule(parent) if parent else ref, leaf, lin)
    ids = torch.randint(0, 11, (1, 4))
    cache, ref_cache = m.make_cache(1, 16), ref.make_cache(1, 16)
    with torch.no_grad():
        for c in (cache, ref_cache):  # the prompt's keys/values in fp32 (m's eager prefill rounds to bf16)
            ref.prefill(ids, c)
        steps = GraphedSteps(m, True, cache, None, None)
        for t in range(6):
            tok = torch.tensor([[t + 1]])
            torch.testing.assert_close(steps(tok), ref.step(tok, ref_cache), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_static_step_logits_equal_step_over_the_whole_cache():
    """The function itself, eagerly: static_step attends over every column of the cache with the future
    masked; its logits equal step()'s over the cached prefix (to fp32 rounding), position after position."""
    m = tiny_gpt("rope", gqa=True)
    ids = torch.randint(0, 11, (2, 4))
    with torch.no_grad():
        a, b = m.make_cache(2, 12), m.make_cache(2, 12)
        m(ids, cache=a)
        m(ids, cache=b)
        index = torch.tensor([4])
        for t in range(5):
            tok = torch.tensor([[t + 1], [t + 2]])
            want = m.step(tok, a)
            got = m.static_step(tok, b, index=index, offset=index)
            b.advance(1)
            index += 1
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.k[:, :, :, :9], a.k[:, :, :, :9])


def test_interleaved_compiled_streams_of_one_shape_fail_clearly():
    """Compiled generations keep their static cache for the next call of the same shape (a CUDA graph recorded
    over it is replayed); two interleaved ones would share it, so the older one stops with an error."""
    from qkv.generate import stream

    m = tiny_gpt("rope")
    ids = torch.randint(0, 11, (1, 4))
    first, second = stream(m, ids, 6, compile="eager"), stream(m, ids, 6, compile="eager")
    next(first), next(first)
    next(second), next(second)
    with pytest.raises(RuntimeError, match="reused this generation's static cache"):
        next(first)
    rest = [t for t in second]  # the newer one goes on, with the eager path's tokens
    assert torch.equal(torch.cat([generate(m, ids, 6)[0, 4:6], torch.cat(rest)]), generate(m, ids, 6)[0, 4:])


def test_clear_errors_where_graph_decoding_does_not_apply():
    ids = torch.randint(0, 11, (1, 4))
    with pytest.raises(ValueError, match="ALiBi or relative-bias"):
        generate(tiny_gpt("alibi"), ids, 3, compile="eager")
    lstm = qkv.build("lstm-tiny", vocab_size=11).eval()
    with pytest.raises(ValueError, match="no static decoding step"):
        generate(lstm, ids, 3, compile="eager")
    with pytest.raises(ConfigError, match="beam search"):
        generate(tiny_gpt(), ids, 3, num_beams=2, compile="eager")
    with pytest.raises(ConfigError, match="use_cache"):
        generate(tiny_gpt(), ids, 3, use_cache=False, compile=True)
    with pytest.raises(ValueError, match="return_attentions"):
        generate(tiny_gpt(), ids, 3, return_attentions=True, compile="eager")


@pytest.mark.slow
def test_more_models_than_dynamos_recompile_limit_compile_in_one_process():
    """Dynamo counts recompilations per code object (limit 8): each model's compiled step has its own, so
    models and shapes past 8 in one process (here 5 models of other cache lengths x 2 batch sizes) are traced,
    not refused (fullgraph=True made that a hard failure)."""
    for seed in range(5):
        torch.manual_seed(seed)
        m = tiny_gpt("learned", context=16 + 8 * seed)
        for batch in (1, 2):
            ids = torch.randint(0, 11, (batch, 3))
            assert torch.equal(generate(m, ids, max_new_tokens=2, compile="eager"),
                               generate(m, ids, max_new_tokens=2))
