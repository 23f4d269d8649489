"""torch.compile(fullgraph=True) on every decoder family's TRAINING forward and backward, and no
value read back to the host in a training step or a decoding step.

backend="aot_eager" runs Dynamo (fullgraph=True: any graph break, e.g. an `int(tensor)` or `.item()`, raises)
and AOTAutograd (the joint forward + backward graph Inductor would compile) without generating code, so it
needs no C++ toolchain and stays fast. Loss and gradients are compared with the eager model's (an independent
run of the same weights). The shapes of released models are covered through the families' config keywords:
GPT-2 (learned positions, LayerNorm, GELU-tanh, biases), Llama (RoPE, RMSNorm, SwiGLU, GQA, no biases, llama3
RoPE scaling), Qwen2/Qwen3 (q/k/v biases, q/k norms), Mistral (sliding window) in one model, the
encoder-decoder, and Whisper's forward.

A device-to-host sync cannot be observed on the CPU, but it needs the tensor's VALUE: on the "meta" device
tensors have shapes and no values, and any .item() / int() / bool() / .tolist() or data-dependent shape
raises. A whole training step (forward, backward, AdamW) and the decoding steps run there; the CUDA twin with
torch.cuda.set_sync_debug_mode("error") is tests/models/test_no_host_sync_cuda.py."""

from __future__ import annotations

import copy

import pytest
import torch

import qkv

GPT_SHAPES = {
    "gpt2": dict(position="learned", norm="layernorm", ffn="gelu_tanh"),
    # every Llama-family variant at once (each is a keyword on the same blocks): RoPE with Llama 3's scaling,
    # RMSNorm, SwiGLU, GQA, no biases but Qwen2's q/k/v ones, Qwen3's q/k norms, Mistral's window
    "llama": dict(position="rope", norm="rmsnorm", ffn="swiglu", n_kv_heads=2, bias=False, qkv_bias=True,
                  qk_norm=True, sliding_window=16,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
}


def _gpt(shape: str, **kw):
    return qkv.build("gpt-nano", vocab_size=13, n_layers=2, d_model=32, n_heads=4, context_length=16,
                     **GPT_SHAPES[shape], **kw)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _assert_compiled_training_equals_eager(model, batch):
    model.train()
    twin = copy.deepcopy(model)
    want_loss, want_grads = _loss_and_grads(model, batch)
    got_loss, got_grads = _loss_and_grads(torch.compile(twin, backend="aot_eager", fullgraph=True), batch)
    torch.testing.assert_close(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], msg=name)


@pytest.mark.parametrize("shape", list(GPT_SHAPES))
def test_gpt_family_training_forward_backward_is_one_graph(shape):
    torch._dynamo.reset()
    ids = torch.randint(0, 13, (2, 12))
    labels = ids.clone()
    labels[0, :3] = -100
    _assert_compiled_training_equals_eager(_gpt(shape), dict(input_ids=ids, labels=labels))


def test_encoder_decoder_and_whisper_training_are_one_graph():
    torch._dynamo.reset()
    e = qkv.build("transformer-tiny", src_vocab_size=13, tgt_vocab_size=13, n_encoder_layers=1,
                  n_decoder_layers=1, d_model=32, n_heads=4, d_ff=64)
    src = torch.randint(3, 13, (2, 7))
    tgt = torch.randint(3, 13, (2, 5))
    _assert_compiled_training_equals_eager(e, dict(input_ids=src, labels=tgt,
                                                   attention_mask=torch.tensor([[1] * 7, [1] * 5 + [0] * 2])))
    # Whisper: its decoder is the same Stack; the forward (audio front end included) traced in one graph
    w = qkv.build("whisper-digits", n_encoder_layers=1, n_decoder_layers=1, d_model=32, n_heads=4, d_ff=64,
                  n_mels=16, n_audio_ctx=20)
    batch = dict(input_features=torch.randn(2, 16, 40), labels=torch.randint(3, 16, (2, 5)))
    torch.testing.assert_close(torch.compile(w, backend="eager", fullgraph=True)(**batch).loss,
                               w(**batch).loss)


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_training_step_and_decoding_steps_read_no_tensor_value(shape):
    """On "meta" tensors every host read raises: the training step (forward with padding, backward, AdamW)
    and the decoding steps (step, and the static step of graph-captured decoding) read none."""
    with torch.device("meta"):
        m = _gpt(shape)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    mask = torch.ones(2, 8, dtype=torch.bool, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        ids.sum().item()  # the premise: a value read fails on meta
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(ids, labels=ids, attention_mask=mask).loss.backward()
    opt.step()
    m.eval()
    with torch.no_grad():
        cache = m.make_cache(2, 12)
        m(ids, attention_mask=mask, cache=cache)
        keep = torch.ones(2, 9, dtype=torch.bool, device="meta")
        assert m.step(ids[:, :1], cache, keep=keep,
                      offset=torch.zeros(2, dtype=torch.long, device="meta")).shape == (2, 13)
        index = torch.zeros(1, dtype=torch.long, device="meta")
        assert m.static_step(ids[:, :1], cache, index=index, offset=index).shape == (2, 13)
