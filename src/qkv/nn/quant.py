"""Weight-only quantization for inference: a projection's weight stored as int8 codes with one scale per
output channel, or as int4 codes with a scale and an offset per group of `group_size` inputs; activations,
norms and embeddings keep the model's dtype. A decoding step reads every weight once per token, so on a CPU
its time is mostly the weights' bytes: int8 halves a bf16 model's, int4 quarters it.

    model = qkv.from_pretrained(folder, quantize="int8")        # or quantize_model(model, "int4")
    qkv generate FOLDER --quantize int8                          # also qkv chat / serve / explore

The products go through PyTorch's own weight-only kernels (those torchao and gpt-fast call):
  int8  aten._weight_int8pack_mm(x, q (out, in) int8, scale (out,))            y = (x @ q^T) * scale
  int4  aten._convert_weight_to_int4pack_for_cpu once, then aten._weight_int4pack_mm_for_cpu(x, packed, group,
        scales_and_zeros (in / group, out, 2)), where w = (q - 8) * scale + zero for q in 0..15 (CUDA:
        aten._convert_weight_to_int4pack / aten._weight_int4pack_mm, the same format; not run here: no GPU)
What the x86 CPU kernels do (torch 2.13, read in aten/src/ATen/native/cpu/int{8,4}mm_kernel.cpp and measured
on an AVX-512 EPYC, docs/llm.md): only bf16 activations are vectorized; fp32 and fp16 take a scalar loop (an
fp32 (8 x 576) @ (576 x 1536) product 6.0 ms through the int8 kernel against 0.42 ms dequantized + F.linear).
The int8 loop reads 16 inputs at a time with aligned loads and does not check: in_features % 16 != 0 gives
wrong sums or a segfault, and so does an input row not 32-byte aligned. So the int8 kernel runs where those
hold and every other case computes the same formula through F.linear(x, q) * scale: exact, and still storing
int8 weights. An fp32 or fp16 model's activations are rounded to bf16 for the int8 kernel and its output cast
back (Int8WeightOnlyLinear.product_dtype), on every x86 CPU with AVX2 or more: through the scalar loop, or the
formula (which converts the codes to fp32 at every call), int8 was 2x slower than the model's own fp32, and
bf16's rounding of the input (2^-9 relative) is that of the int8 weights' own error (half a step of 1/127 of
a channel's range). The int4 kernel always gets bf16 (an fp32 input is rounded to bf16 and the output cast
back: that rounding is far below int4's own error). In a compiled CPU decoding step (generate(...,
compile=True)) an int8 product of one row is the formula itself, sum(q * x) * scale with fp32 sums, which
Inductor fuses into one loop over the codes: faster than the kernel there, and not rounded to bf16.

Quantized layers are inference-only: they hold integer buffers, no parameters, and `.train()` refuses. torchao
0.18 was tried (it installs without pulling another torch): its int8 weight-only config dequantizes on a CPU
(an int8 -> bf16 copy of the weight, mm, the scale: a 576 -> 1536 bf16 layer at one row 2.5x slower than the
aten int8 kernel, paired timing), and its int4 config needs the mslk package; so qkv calls the aten ops
directly and adds no dependency.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.stack import Stack

MODES = ("int8", "int4")
# x86 CPUs whose int8 kernel vectorizes bf16 activations (torch's dispatch level; "DEFAULT": no AVX2, or
# another architecture, where the kernel is a plain loop and the fp32 formula is kept)
_BF16_INT8_CAPABILITIES = ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX")
_BF16_INT8_KERNEL = torch.backends.cpu.get_cpu_capability() in _BF16_INT8_CAPABILITIES
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels accept


def check_mode(mode: str) -> str:
    """mode itself when it is one of MODES, else one clear ValueError."""
    if mode not in MODES:
        raise ValueError(f"quantize must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def quantize_int8(weight: Tensor, scale_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: (q (out, in) int8 in -127..127, scale (out,)), w ~ q * scale[:,
    None]. The scale is rounded to its storage dtype first and q computed against the rounded value, so that
    every weight is within scale / 2 of q * scale as stored."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # an all-zero row: any scale, q = 0
    scale = scale.to(scale_dtype or weight.dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric int4 per group of `group_size` inputs (min..max over 16 levels, the kernels' format):
    (q (out, in) int32 in 0..15, scale (out, in / group) bf16, zero (out, in / group) bf16), with
    w ~ (q - 8) * scale + zero. q is computed against the bf16-rounded scale and zero."""
    out_f, in_f = weight.shape
    w = weight.detach().float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo).clamp(min=1e-6) / 15).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    s, z = scale.float()[..., None], zero.float()[..., None]
    q = torch.round((w - (z - 8 * s)) / s).clamp_(0, 15).to(torch.int32).reshape(out_f, in_f)
    return q, scale, zero


class _WeightOnlyLinear(nn.Module):
    """What both quantized layers share: the shape, the optional bias, inference only."""

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.training = False

    def train(self, mode: bool = True) -> _WeightOnlyLinear:
        if mode:
            raise RuntimeError(f"{type(self).__name__} is inference-only (integer weights, no gradient): "
                               "train or fine-tune the unquantized model and quantize it afterwards")
        return super().train(False)

    def _finish(self, y: Tensor, x: Tensor) -> Tensor:
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y.add_(self.bias.to(y.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Int8WeightOnlyLinear(_WeightOnlyLinear):
    """y = x @ (q * scale[:, None])^T + b with q (out, in) int8, scale (out,) in the model's dtype."""

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        super().__init__(q.shape[1], q.shape[0], bias)
        q = q.contiguous()
        # the kernel reads q in 16-byte vectors: a fresh tensor is aligned, a view into a file may not be.
        # Loads and moves keep a fresh buffer, so the check below only matters for a buffer replaced by hand.
        self.register_buffer("q", q if q.data_ptr() % 16 == 0 else q.clone())
        self.register_buffer("scale", scale)

    @property
    def _aligned(self) -> bool:
        return torch.compiler.is_compiling() or self.q.data_ptr() % 16 == 0

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        q, scale = quantize_int8(linear.weight)
        return cls(q, scale, linear.bias)

    def takes_kernel(self, x: Tensor) -> bool:
        """Does the aten int8 kernel compute the product with input x, correctly and fast (see the module
        docstring; an fp32 / fp16 input is rounded to bf16 for it)?"""
        return (x.is_cpu and self.in_features % 16 == 0 and not x.requires_grad and self._aligned
                and (x.dtype == torch.bfloat16
                     or (x.dtype in (torch.float32, torch.float16) and _BF16_INT8_KERNEL)))

    def product_dtype(self, x: Tensor) -> torch.dtype:
        """The dtype the product with input x is computed in: bf16 through the kernel, else x's own."""
        return torch.bfloat16 if self.takes_kernel(x) else x.dtype

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 1 and x2.is_cpu and torch.compiler.is_compiling():
            # one row (batch-1 decoding) in a compiled step: the product as a reduction over the int8 codes,
            # which Inductor fuses into one vectorised loop that reads each code once (2.4x the aten kernel's
            # speed over the 135M model's weights, 14 against 6 GB/s); fp32 sums, then the scale
            y = (self.q.to(torch.float32) * x2.float()).sum(-1).mul_(self.scale.float())
            return self._finish(y.to(x.dtype), x)
        if self.takes_kernel(x2):
            y = self._kernel(x2.to(torch.bfloat16))
            return self._finish(y.to(x.dtype), x)
        # every other input (no fast kernel for it; in_features not a multiple of 16; autograd through the
        # input, which the kernel has no derivative for): the same formula, (x @ q^T) * scale. The codes are
        # exact in any float dtype (|q| <= 127), so, as in the kernel, only the sums round.
        y = F.linear(x2, self.q.to(x.dtype)).mul_(self.scale.to(x.dtype))
        return self._finish(y, x)

    def _kernel(self, x2: Tensor) -> Tensor:
        """The aten int8 kernel on bf16 rows x2."""
        scale = self.scale.to(torch.bfloat16)
        # (a data pointer is not traceable: under torch.compile always the fresh copy)
        if torch.compiler.is_compiling() or not x2.is_contiguous() or x2.data_ptr() % 32:
            x2 = x2.clone(memory_format=torch.contiguous_format)  # a fresh tensor is 64-byte aligned
        return torch.ops.aten._weight_int8pack_mm(x2, self.q, scale)

    def dequantized(self) -> Tensor:
        """q * scale as an fp32 (out, in) tensor: the weight this layer multiplies by."""
        return self.q.float() * self.scale.float()[:, None]


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    """y = x @ W^T + b with W[o, i] = (q[o, i] - 8) * scale[o, g] + zero[o, g], g = i // group_size, q in
    0..15 packed by the kernel's own layout (`packed`, half a byte a weight) for the device it was quantized
    on."""

    def __init__(self, packed: Tensor, scales_and_zeros: Tensor, in_features: int, group_size: int,
                 bias: Tensor | None = None) -> None:
        super().__init__(in_features, scales_and_zeros.shape[1], bias)
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # (in / group, out, 2) bf16

    @staticmethod
    def supports(linear: nn.Linear, group_size: int) -> bool:
        """The kernels' shape limits: out_features a multiple of 16, in_features of group_size (and, on CUDA,
        of the 128 that 8 inner k-tiles span)."""
        out_f, in_f = linear.weight.shape
        device = linear.weight.device.type
        return (out_f % 16 == 0 and in_f % group_size == 0
                and (device == "cpu" or device == "cuda" and in_f % 128 == 0))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 64) -> Int4WeightOnlyLinear:
        q, scale, zero = quantize_int4(linear.weight, group_size)
        if linear.weight.is_cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        else:  # CUDA's tinygemm takes two codes a byte, the first in the high nibble, and 8 inner k-tiles
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                                                8)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, scales_and_zeros, q.shape[1], group_size, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        sz = self.scales_and_zeros.to(torch.bfloat16)  # a no-op unless the module was cast
        if x2.is_cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, sz)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, sz)
        return self._finish(y.to(x.dtype), x)


def _quantized(linear: nn.Linear, mode: str, group_size: int) -> _WeightOnlyLinear:
    if mode == "int4" and Int4WeightOnlyLinear.supports(linear, group_size):
        return Int4WeightOnlyLinear.from_linear(linear, group_size)
    return Int8WeightOnlyLinear.from_linear(linear)  # int8 holds any shape: int4's misfits (a 65-token head)


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, *, group_size: int = 64, head: bool = True) -> nn.Module:
    """Swap every projection (nn.Linear) inside the model's Transformer blocks (qkv Stacks), and the output
    head `lm_head` when head=True, for its weight-only quantized version, in place; returns the model in eval
    mode. int4 uses groups of `group_size` inputs (32, 64, 128 or 256; 64 divides the widths of the common
    small Llamas, 576 and 1536); a layer the int4 kernel cannot hold (out_features not a multiple of 16,
    in_features not of group_size) is quantized to int8 instead. A head tied to the token embedding gets a
    quantized copy: the embedding keeps its full-precision table (token lookup reads only one row of it per
    token)."""
    check_mode(mode)
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    targets = [(parent, name, child) for stack in model.modules() if isinstance(stack, Stack)
               for parent in stack.blocks.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if head and isinstance(getattr(model, "lm_head", None), nn.Linear):
        targets.append((model, "lm_head", model.lm_head))
    if not targets:
        raise ValueError(f"{type(model).__name__} has no Transformer blocks with linear projections to "
                         "quantize")
    fallback = 0
    for parent, name, linear in targets:
        new = _quantized(linear, mode, group_size)
        fallback += mode == "int4" and isinstance(new, Int8WeightOnlyLinear)
        setattr(parent, name, new)
    if fallback:
        warnings.warn(f"{fallback} of {len(targets)} layers are int8: the int4 kernel needs out_features a "
                      f"multiple of 16 and in_features of group_size={group_size}", stacklevel=2)
    return model.eval()


def quantized_layers(model: nn.Module) -> dict[str, int]:
    """How many layers of each kind: {"int8": n, "int4": m} (empty for an unquantized model)."""
    kinds = {Int8WeightOnlyLinear: "int8", Int4WeightOnlyLinear: "int4"}
    out: dict[str, int] = {}
    for m in model.modules():
        if type(m) in kinds:
            out[kinds[type(m)]] = out.get(kinds[type(m)], 0) + 1
    return out
