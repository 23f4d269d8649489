"""A lean single-token decoding step for GPT-family models (the hot path of cached generation).

The generic path (GPT.forward -> Stack -> Block -> MultiHeadAttention) is written for clarity and for every
shape of input; one decoding step through it spends a good part of its time in Python (module calls,
keyword dicts, hooks) and in nn.Linear's x @ W^T, which on CPU runs as a slower matrix-vector kernel than
x @ W with W stored (in, out) (measured ~25% on this machine; Hugging Face's GPT-2 Conv1D stores weights
that way). This step computes the same function for ONE new token per sequence over a StaticCache:
  - weights pre-transposed once to (in, out) and reused across calls while the parameters are unchanged
    (tracked by data pointer and version counter; costs one extra copy of the linear weights);
  - one plain loop over layers, no module calls on the hot path, in-place residual adds;
  - grouped-query attention by reshaping the queries (no repeat_interleave copy of the cache);
  - positions through the model's own position module (embed / rotate / bias), so every encoding is served.
It is exact up to float rounding; tests/generate compares it with the full forward pass.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.nn.cache import StaticCache
from qkv.nn.norm import LayerNorm
from qkv.nn.position import PositionalEncoding

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _t(w: Tensor) -> Tensor:
    return w.detach().t().contiguous()


class _Layer:
    def __init__(self, block: Any) -> None:
        a, f = block.attn, block.ffn
        self.pre = block.placement == "pre"
        self.norm1, self.norm2 = block.norm1, block.norm2
        self.ln1 = self._ln(block.norm1)
        self.ln2 = self._ln(block.norm2)
        # the 1/sqrt(hd) score scale folded into the query columns (RoPE is linear, so it commutes)
        self.wqkv, self.bqkv = _t(a.qkv_proj.weight), a.qkv_proj.bias
        self.wqkv[:, : a.d_model] *= a.scale
        if self.bqkv is not None:
            self.bqkv = self.bqkv.detach().clone()
            self.bqkv[: a.d_model] *= a.scale
        self.wo, self.bo = _t(a.out_proj.weight), a.out_proj.bias
        self.wup, self.bup = _t(f.up.weight), f.up.bias
        self.wgate = _t(f.gate.weight) if f.gate is not None else None
        self.bgate = f.gate.bias if f.gate is not None else None
        self.wdown, self.bdown = _t(f.down.weight), f.down.bias
        self.act = f.activation

    @staticmethod
    def _ln(norm: Any) -> tuple | None:
        if type(norm) is LayerNorm:
            return (norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        return None  # other norms: call the module


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.addmm(b, x, w) if b is not None else x @ w


def _norm(x: Tensor, ln: tuple | None, module: Any) -> Tensor:
    if ln is not None:
        return F.layer_norm(x, ln[0], ln[1], ln[2], ln[3])
    return module(x)


class FastGPTStep:
    """step(ids (B, 1), cache, keep, offset) -> (B, V) logits; advances the cache by one."""

    def __init__(self, model: Any) -> None:
        c = model.config
        dec = model.decoder
        self.position = dec.position
        self.final_norm = dec.final_norm
        self.lnf = _Layer._ln(dec.final_norm) if dec.final_norm is not None else None
        self.emb = model.tok_emb.weight
        self.head = _t(model.lm_head.weight)
        self.layers = [_Layer(b) for b in dec.blocks]
        a = dec.blocks[0].attn
        self.H, self.Hkv, self.hd, self.scale = a.n_heads, a.n_kv_heads, a.head_dim, a.scale
        self.d = c.d_model

    @staticmethod
    def eligible(model: Any) -> bool:
        dec = getattr(model, "decoder", None)
        if dec is None or hasattr(model, "encode") or not hasattr(model, "tok_emb") or dec.embed_norm is not None:
            return False
        return all(b.cross is None and not b.attn.cross for b in dec.blocks)

    @staticmethod
    def key(model: Any) -> tuple:
        return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())

    @staticmethod
    def get(model: Any) -> FastGPTStep | None:
        """The step for this model, rebuilt when its parameters changed; None when not eligible."""
        if not FastGPTStep.eligible(model):
            return None
        k = FastGPTStep.key(model)
        hit = _CACHE.get(model)
        if hit is None or hit[0] != k:
            hit = (k, FastGPTStep(model))
            _CACHE[model] = hit
        return hit[1]

    def __call__(self, ids: Tensor, cache: StaticCache, keep: Tensor | None, offset: int | Tensor | None) -> Tensor:
        B = ids.shape[0]
        H, Hkv, hd, d = self.H, self.Hkv, self.hd, self.d
        G = H // Hkv
        L = cache.length
        if L + 1 > cache.max_len:
            raise ValueError(f"KV cache is full: {L + 1} positions needed, {cache.max_len} allocated")
        Tk = L + 1
        if offset is None:
            offset = L
        x = F.embedding(ids, self.emb)  # (B, 1, d)
        x = self.position.embed(x, offset).view(B, d)
        # ALiBi bias and the key-padding mask folded into ONE additive term, built once per step:
        # scores = baddbmm(add, q, K^T, alpha=scale) does scale, bias and mask in a single op per layer
        add = None
        bias = self.position.bias(1, Tk)  # ALiBi: (1, H, 1, Tk), else None
        if bias is not None:
            add = bias.to(x.dtype).view(1, Hkv, G, Tk).expand(B, Hkv, G, Tk)
        if keep is not None:
            pad = torch.zeros(B, 1, 1, Tk, dtype=x.dtype, device=x.device).masked_fill_(~keep.view(B, 1, 1, Tk),
                                                                                     float("-inf"))
            add = pad.expand(B, Hkv, G, Tk) if add is None else add + pad
        if add is not None:
            add = add.reshape(B * Hkv, G, Tk)
        rotate = type(self.position).rotate is not PositionalEncoding.rotate  # RoPE
        kvd = Hkv * hd
        views = getattr(cache, "_fast_views", None)
        if views is None or views[0] is not cache.k:  # per-layer (B * Hkv, max_len, hd) views, once per cache
            M = cache.k.shape[3]
            views = (cache.k, [(cache.k[i].view(B * Hkv, M, hd), cache.v[i].view(B * Hkv, M, hd))
                               for i in range(len(self.layers))])
            cache._fast_views = views
        for i, ly in enumerate(self.layers):
            h = _norm(x, ly.ln1, ly.norm1) if ly.pre else x
            qkv = torch.addmm(ly.bqkv, h, ly.wqkv) if ly.bqkv is not None else h @ ly.wqkv  # (B, d + 2 kv)
            q, k, v = qkv[:, :d], qkv[:, d : d + kvd], qkv[:, d + kvd :]
            if rotate:
                q, k = self.position.rotate(q.reshape(B, H, 1, hd), k.reshape(B, Hkv, 1, hd), offset)
            Kl, Vl = views[1][i]  # this layer's cache, batch and kv heads merged
            Kl[:, L] = k.reshape(B * Hkv, hd)
            Vl[:, L] = v.reshape(B * Hkv, hd)
            # GQA without copies: the G query heads of one kv head become G query rows
            q3 = q.reshape(B * Hkv, G, hd)
            Kt = Kl[:, :Tk].transpose(1, 2)
            s = torch.bmm(q3, Kt) if add is None else torch.baddbmm(add, q3, Kt)  # (B * Hkv, G, Tk)
            y = torch.bmm(torch.softmax(s, dim=-1), Vl[:, :Tk]).view(B, d)  # heads h = kv * G + g
            y = torch.addmm(ly.bo, y, ly.wo) if ly.bo is not None else y @ ly.wo
            if ly.pre:
                x = x.add_(y) if i else x + y  # in place after the first layer (x is then our own tensor)
                h = _norm(x, ly.ln2, ly.norm2)
            else:
                x = _norm(x + y, ly.ln1, ly.norm1)
                h = x
            u = torch.addmm(ly.bup, h, ly.wup) if ly.bup is not None else h @ ly.wup
            if ly.act == "gelu_tanh":
                u = F.gelu(u, approximate="tanh")
            elif ly.act == "gelu":
                u = F.gelu(u)
            elif ly.act == "relu":
                u = F.relu(u)
            else:
                u = F.silu(_linear(h, ly.wgate, ly.bgate)) * u
            f = torch.addmm(ly.bdown, u, ly.wdown) if ly.bdown is not None else u @ ly.wdown
            x = x.add_(f) if ly.pre else _norm(x + f, ly.ln2, ly.norm2)
        if self.final_norm is not None:
            x = _norm(x, self.lnf, self.final_norm)
        cache.advance(1)
        return x @ self.head  # (B, V)
