"""On a CUDA GPU (skipped elsewhere): no device-to-host synchronisation in a training step or a
decoding step, under torch.cuda.set_sync_debug_mode("error") (every synchronising call raises), and the
flash-attention kernel actually taken for training and prefill (SDPA restricted to FLASH_ATTENTION raises
when the inputs do not qualify). The CPU proxies are tests/models/test_compile_train.py (fullgraph, meta)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import qkv
from qkv.generate.graphed import GraphedSteps

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = {
    "gpt2": dict(position="learned", norm="layernorm", ffn="gelu_tanh"),
    "llama": dict(position="rope", norm="rmsnorm", ffn="swiglu", n_kv_heads=2, bias=False),
}


def _model(shape: str):
    torch.manual_seed(0)
    return qkv.build("gpt-nano", vocab_size=512, n_layers=2, d_model=256, n_heads=4, context_length=256,
                     init_std=0.1, **SHAPES[shape]).cuda()


@contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_training_step_does_not_synchronise(shape):
    m = _model(shape).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 512, (4, 128), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step()  # the optimizer's state is created at the first step
    with no_sync():
        for _ in range(2):
            loss = step()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_decoding_steps_do_not_synchronise(shape):
    m = _model(shape).eval()
    ids = torch.randint(0, 512, (2, 16), device="cuda")
    with torch.no_grad():
        cache, graph_cache = m.make_cache(2, 64), m.make_cache(2, 64)
        m(ids, cache=cache)
        m(ids, cache=graph_cache)
        graphed = GraphedSteps(m, True, graph_cache, None, None)
        tok = ids[:, -1:]
        for _ in range(3):  # Inductor compiles, then CUDA graphs warm up and record (those may synchronise)
            graphed(tok)
        with no_sync():
            for _ in range(8):
                a = m.step(tok, cache).argmax(-1, keepdim=True)
                b = graphed(tok).argmax(-1, keepdim=True)
                tok = a
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_flash_attention_is_taken_for_training_and_prefill(shape):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = _model(shape)
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        m.train()
        m(ids, labels=ids).loss.backward()  # raises "No available kernel" if flash cannot run these inputs
        m.eval()
        with torch.no_grad():
            cache = m.make_cache(2, 256, dtype=torch.bfloat16)
            m(ids[:, :200], cache=cache)  # prefill into the static cache
