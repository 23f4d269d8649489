"""Weight-only quantization (qkv.nn.quant): each quantized layer against its formula in float64 (the
dequantized weight), the quantization error bound, the aten kernels actually taking the bf16 products, the
inputs that would crash or mislead the int8 kernel, and a random Llama folder loaded with quantize= against
the unquantized model:
logits close, greedy decoding through the KV cache equal to the uncached argmax, and again on a second
call."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv.generate import generate
from qkv.nn.quant import (
    MODES,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantized_layers,
)

transformers = pytest.importorskip("transformers")


class OpLog(TorchDispatchMode):
    """The names of the aten ops run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def close_to_formula(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                     dtype) -> None:
    """y == x @ w^T + b to the output dtype's rounding: float64 reference, each element within the roundings
    (bf16:
    2^-8 relative) of the product, its scaling and the sum with the bias, plus fp32 summation error (relative
    to sum |x| |w|)."""
    x64 = x.double().reshape(-1, x.shape[-1])
    prod = x64 @ w.double().T
    ref = prod + (0 if b is None else b.double())
    rounding = (2.0 ** -8 if dtype == torch.bfloat16 else 1e-7) * (2 * prod.abs() + ref.abs())
    err = (y.double().reshape(ref.shape) - ref).abs()
    assert (err <= rounding + 1e-6 * (x64.abs() @ w.double().abs().T) + 1e-7).all(), \
        float((err - rounding).max())


def _linear(in_f: int, out_f: int, bias: bool, dtype) -> nn.Linear:
    lin = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_(0, 0.5)
    return lin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("in_f,bias", [(64, True), (48, False), (40, True)])  # 40: not a multiple of 16
def test_int8_equals_the_dequantized_formula(dtype, rows, in_f, bias):
    lin = _linear(in_f, 96, bias, dtype)
    q8 = Int8WeightOnlyLinear.from_linear(lin)
    x = torch.randn(rows, in_f, dtype=dtype)
    with torch.no_grad():
        y = q8(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    w = q8.q.double() * q8.scale.double()[:, None]  # the stored codes and scales, not the original weight
    # the product's own dtype: bf16 where the fast kernel takes the width (an fp32 input rounded to it on an
    # x86 CPU), the input's otherwise
    product = q8.product_dtype(x)
    assert product in (dtype, torch.bfloat16) and (in_f % 16 == 0 or product == dtype)
    close_to_formula(y, x.to(product), w, None if not bias else q8.bias, product)


def test_int8_takes_batched_3d_inputs_and_unaligned_views():
    """A bf16 row not 32-byte aligned (a view 8 elements into a tensor) crashes the aten kernel's aligned
    loads:
    the layer copies it first. A (B, T, d) input gives (B, T, out)."""
    lin = _linear(64, 32, True, torch.bfloat16)
    q8 = Int8WeightOnlyLinear.from_linear(lin)
    w = q8.q.double() * q8.scale.double()[:, None]
    flat = torch.randn(8 + 3 * 64, dtype=torch.bfloat16)
    x = flat[8:].view(3, 64)
    assert x.data_ptr() % 32
    with torch.no_grad():
        close_to_formula(q8(x), x, w, q8.bias, torch.bfloat16)
        x3 = torch.randn(2, 5, 64, dtype=torch.bfloat16)
        y3 = q8(x3)
    assert y3.shape == (2, 5, 32)
    close_to_formula(y3, x3, w, q8.bias, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_error_is_at_most_half_a_step_per_channel(dtype):
    # channels of very different ranges
    w = (torch.randn(48, 80) * torch.logspace(-3, 1, 48)[:, None]).to(dtype)
    w[5] = 0  # an all-zero channel
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == dtype and q.abs().max() <= 127
    err = (w.double() - q.double() * scale.double()[:, None]).abs().amax(dim=1)
    assert (err <= scale.double() / 2 * (1 + 1e-6)).all()
    assert err[5] == 0


@pytest.mark.parametrize("offset", [0.0, 0.5])
def test_int4_error_is_at_most_half_a_step_per_group(offset):
    w = torch.randn(32, 256) * 0.1 + offset
    q, scale, zero = quantize_int4(w, 64)
    assert q.min() >= 0 and q.max() <= 15 and scale.shape == zero.shape == (32, 4)
    deq = ((q.view(32, 4, 64).double() - 8) * scale.double()[..., None]
           + zero.double()[..., None]).view(32, 256)
    err = (w.double() - deq).abs().view(32, 4, 64).amax(dim=-1)
    assert (err <= scale.double() / 2 * (1 + 1e-3)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 19])
def test_int4_equals_the_dequantized_formula(dtype, rows):
    """The kernel computes in bf16: the reference is the bf16-rounded input times the dequantized weight."""
    lin = _linear(128, 48, True, dtype)
    q4 = Int4WeightOnlyLinear.from_linear(lin, group_size=32)
    q, scale, zero = quantize_int4(lin.weight, 32)
    w = ((q.view(48, 4, 32).double() - 8) * scale.double()[..., None]
         + zero.double()[..., None]).view(48, 128)
    x = torch.randn(rows, 128, dtype=dtype)
    with torch.no_grad(), OpLog() as log:
        y = q4(x)
    assert y.dtype == dtype and "_weight_int4pack_mm_for_cpu.default" in log.names
    close_to_formula(y, x.bfloat16(), w, q4.bias, torch.bfloat16)


def llama_folder(path, tie=True, hidden=64, vocab=320):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128,
                                      num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128,
                                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("llama"))


def uncached_greedy(model, ids, n):
    """The argmax of a full forward over the whole sequence, one token at a time (no cache)."""
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("mode,tol", [("int8", 0.02), ("int4", 0.15)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_llama_logits_and_greedy_decoding(folder, mode, tol, dtype):
    ref = qkv.from_pretrained(folder).to(dtype).eval()
    model = qkv.from_pretrained(folder, quantize=mode).to(dtype)
    assert not model.training
    assert quantized_layers(model) == {mode: 2 * 5 + 1}  # 2 blocks x (qkv, out, up, gate, down) + the head
    ids = torch.randint(3, 320, (2, 12))
    with torch.no_grad():
        want, got = ref(ids).logits.float(), model(ids).logits.float()
    assert (got - want).abs().max() <= tol * want.abs().max()
    out = generate(model, ids, max_new_tokens=10, do_sample=False)  # prefill + cached decoding steps
    assert torch.equal(out, uncached_greedy(model, ids, 10))
    assert torch.equal(generate(model, ids, max_new_tokens=10, do_sample=False), out)  # no state left behind


def test_quantize_model_swaps_the_projections_and_copies_a_tied_head(folder):
    model = qkv.from_pretrained(folder)
    emb = model.tok_emb.weight
    assert model.lm_head.weight is emb
    quantize_model(model, "int8")
    assert model.tok_emb.weight is emb and isinstance(emb, nn.Parameter)  # the embedding keeps full precision
    assert isinstance(model.lm_head, Int8WeightOnlyLinear)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears == []  # every projection and the head are quantized
    with pytest.raises(RuntimeError, match="inference-only"):
        model.train()
    out = folder.parent / "quantized-copy"
    with pytest.raises(ValueError, match="quantized model is not saved"):
        model.save_pretrained(out)
    assert not out.exists()


def test_head_false_keeps_the_head_and_int4_misfits_fall_back_to_int8(tmp_path):
    # a 65-token head: not a multiple of 16
    model = qkv.from_pretrained(llama_folder(tmp_path / "a", vocab=65))
    with pytest.warns(UserWarning, match="1 of 11 layers are int8"):
        quantize_model(model, "int4")
    assert isinstance(model.lm_head, Int8WeightOnlyLinear)
    kept = quantize_model(qkv.from_pretrained(llama_folder(tmp_path / "b", tie=False)), "int8", head=False)
    assert type(kept.lm_head).__name__ == "Linear"


def test_bad_modes_are_one_clear_error(folder, tmp_path):
    with pytest.raises(ValueError, match="quantize must be one of int8, int4, got 'int3'"):
        qkv.from_pretrained(tmp_path / "not-there", quantize="int3")  # refused before anything is read
    model = qkv.from_pretrained(folder)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_model(model, "int4", group_size=48)
    assert MODES == ("int8", "int4")
