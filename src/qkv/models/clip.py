"""CLIP (Radford et al. 2021): an image tower and a text tower trained so matching pairs agree.

image (B, C, H, W) -> ViT (head none) -> pooled (B, d_v) -> Linear -> normalise -> I (B, E)
text  (B, T)       -> token emb -> Stack (causal or bidirectional) -> pooled at the last real token (causal,
                      as CLIP's end-of-text token) or mean over real tokens -> Linear -> normalise -> T (B, E)
logits = exp(t) * I T^T (B, B), t a learned temperature (init ln(1/0.07), exp(t) capped at 100)
loss   = (CE(logits, diag) + CE(logits^T, diag)) / 2        symmetric InfoNCE (the paper's Figure 3)

SigLIP (Zhai et al. 2023) is the same two towers scored pair by pair: logits = exp(t) * I T^T + b with a
learned bias b, loss = -sum log sigmoid(z_ij * logits_ij) over all pairs (z = 1 on the diagonal, -1 off it)
averaged over the images, and a zero-shot probability is the sigmoid of one image-label logit. Its image
tower pools with attention (ViTConfig.pooling "map") into the embedding itself (no projection), its text
tower is bidirectional, pooled at the final position of texts padded to the context, with a biased head.

Zero-shot classification embeds one prompt per class ("a photo of the digit seven") and picks the class
whose prompt is most similar to the image. Both towers are the shared Block/Stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig, setting
from qkv.models.base import ModelOutput, QKVModel, build_stack
from qkv.models.registry import register_family, register_preset
from qkv.models.vit import ViT, ViTConfig
from qkv.nn.checks import check_batch, check_length, check_token_ids


@dataclass
class CLIPConfig(TransformerConfig):
    """The TransformerConfig fields describe the text tower; `vision` is the image tower's ViT config."""

    vocab_size: int = setting(49408, "token vocabulary", ge=1)
    n_layers: int = setting(12, "text tower layers")
    context_length: int = setting(77, "longest text (positions) the text tower accepts", ge=1)
    text_causal: bool = setting(True, "causal text tower pooled at the last token (CLIP); false: "
                                "bidirectional + mean")
    # eos: Hugging Face CLIP, whose pad token may be its end-of-text token; argmax: OpenAI's CLIP, whose
    # end-of-text token is the vocabulary's last; final: SigLIP, whose texts are padded to context_length
    text_pool: Literal["last", "eos", "argmax", "final"] = setting(
        "last", "where a causal tower is pooled: the last real token (last), the first text_eos_id (eos), "
        "the largest id (argmax), or the last position, padding included, causal or not (final)")
    text_eos_id: int = setting(0, "the end-of-text id text_pool=eos looks for")
    embed_dim: int = setting(512, "shared image-text embedding size", ge=1)
    visual_projection: bool = setting(True, "false: the image tower's pooled output is the embedding "
                                      "(SigLIP)")
    text_proj_bias: bool = setting(False, "a bias in the text head (SigLIP)")
    logit_scale_init: float = setting(math.log(1 / 0.07), "the learned temperature's start, log(1/0.07)")
    max_logit_scale: float | None = setting(100.0, "exp(logit_scale) is clamped here (the paper's stability "
                                            "fix)", none="not clamped (SigLIP)")
    logit_bias_init: float | None = setting(None, "sigmoid scoring, a learned logit bias starting here "
                                            "(SigLIP)", none="softmax scoring (CLIP)")
    vision: ViTConfig = setting(ViTConfig(head="none", patch_size=32, d_ff=3072, norm_eps=1e-5),
                                "the image tower (its head must be none)")
    d_model: int = TransformerConfig.override("d_model", 512)
    n_heads: int = TransformerConfig.override("n_heads", 8)

    def validate(self) -> None:
        super().validate()
        if self.vision.head != "none":
            raise ConfigError("CLIPConfig.vision.head must be 'none' (the image tower is projected, not "
                              "classified)")
        if not self.visual_projection and self.vision.d_model != self.embed_dim:
            raise ConfigError(f"CLIPConfig: without visual_projection the image tower's width "
                              f"({self.vision.d_model}) is the embedding size, but embed_dim is "
                              f"{self.embed_dim}")

    @property
    def sigmoid(self) -> bool:
        """Whether image-text pairs are scored one by one with a sigmoid (SigLIP), not a softmax."""
        return self.logit_bias_init is not None


class CLIP(QKVModel):
    kinds: ClassVar[tuple[str, ...]] = ("dual",)

    def __init__(self, config: CLIPConfig) -> None:
        super().__init__(config)
        c = config
        self.visual = ViT(c.vision)
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.text = build_stack(c, c.n_layers, max_len=c.context_length, causal=c.text_causal)
        self.visual_proj = (nn.Linear(c.vision.d_model, c.embed_dim, bias=False) if c.visual_projection
                            else None)
        self.text_proj = nn.Linear(c.d_model, c.embed_dim, bias=c.text_proj_bias)
        self.logit_scale = nn.Parameter(torch.tensor(float(c.logit_scale_init)))
        self.logit_bias = nn.Parameter(torch.tensor(float(c.logit_bias_init))) if c.sigmoid else None
        self.init_weights(c.n_layers + c.vision.n_layers)
        # LeCun-normal patch embedding (std 1/sqrt(fan_in), as in the original JAX ViT): N(0, 0.02) suits
        # 16x16x3 patches (fan_in 768) but leaves a tiny patch's content ~50x below the class token and
        # positions, so every image starts with the same embedding and InfoNCE sits at log(B) (measured)
        w = self.visual.patch_emb.proj.weight
        nn.init.normal_(w, std=1.0 / math.sqrt(w[0].numel()))

    def encode_image(self, pixel_values: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, embed_dim), unit length."""
        pooled = self.visual(pixel_values).pooled
        return F.normalize(self.visual_proj(pooled) if self.visual_proj is not None else pooled, dim=-1)

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """(B, T) right-padded token ids (mask 1 = real) -> (B, embed_dim), unit length."""
        c = self.config
        check_batch(input_ids)
        check_token_ids(input_ids, c.vocab_size)
        check_length(input_ids.shape[1], self.text.context_limit, "text")
        keep = attention_mask.bool() if attention_mask is not None else None
        h = self.text(self.tok_emb(input_ids), keep=keep).hidden  # (B, T, d)
        if keep is None:
            keep = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        if c.text_pool == "final":
            pooled = h[:, -1]
        elif c.text_causal:  # the end-of-text token has seen the whole caption
            pooled = h[torch.arange(h.shape[0], device=h.device), self.text_end(input_ids, keep)]
        else:
            w = keep.unsqueeze(-1).to(h.dtype)
            pooled = (h * w).sum(1) / w.sum(1).clamp_min(1.0)
        return F.normalize(self.text_proj(pooled), dim=-1)

    def text_end(self, input_ids: Tensor, keep: Tensor) -> Tensor:
        """(B,) the position each text is pooled at (CLIPConfig.text_pool)."""
        pool = self.config.text_pool
        if pool == "argmax":
            return input_ids.argmax(dim=-1)
        last = keep.long().sum(1).clamp_min(1) - 1
        if pool == "last":
            return last
        is_end = input_ids == self.config.text_eos_id
        return torch.where(is_end.any(1), is_end.int().argmax(dim=-1), last)

    def scale(self) -> Tensor:
        cap = self.config.max_logit_scale
        return self.logit_scale.exp() if cap is None else self.logit_scale.exp().clamp(max=cap)

    def similarity_logits(self, img: Tensor, txt: Tensor) -> Tensor:
        """(B_img, B_txt) logits of unit-length embeddings: exp(t) * cos, plus the bias b with sigmoid
        scoring."""
        logits = self.scale() * img @ txt.t()
        return logits + self.logit_bias if self.logit_bias is not None else logits

    def forward(self, pixel_values: Tensor, input_ids: Tensor, *, attention_mask: Tensor | None = None,
                return_loss: bool = True) -> ModelOutput:
        """Image-text pairs (row i with row i). logits: (B, B) image-to-text similarities times exp(t) (+ b);
        loss: symmetric InfoNCE averaged over the B images and B texts, or SigLIP's pairwise sigmoid loss
        summed over the texts and averaged over the images (n_targets = B)."""
        if pixel_values.shape[0] != input_ids.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} images but {input_ids.shape[0]} texts: CLIP needs "
                             "pairs")
        img = self.encode_image(pixel_values)
        txt = self.encode_text(input_ids, attention_mask)
        logits = self.similarity_logits(img, txt)  # (B_img, B_txt)
        loss = n = None
        if return_loss and self.config.sigmoid:
            sign = 2 * torch.eye(logits.shape[0], device=logits.device) - 1  # +1 matching pairs, -1 the rest
            loss = -F.logsigmoid(sign * logits.float()).sum(-1).mean()
            n = torch.tensor(logits.shape[0], device=logits.device)
        elif return_loss:
            target = torch.arange(logits.shape[0], device=logits.device)
            loss = (F.cross_entropy(logits.float(), target) + F.cross_entropy(logits.t().float(), target)) / 2
            n = torch.tensor(logits.shape[0], device=logits.device)
        return ModelOutput(logits=logits, loss=loss, n_targets=n, pooled=img)

    @torch.no_grad()
    def zero_shot_logits(self, pixel_values: Tensor, prompt_ids: Tensor,
                         prompt_mask: Tensor | None = None) -> Tensor:
        """(B, n_classes) logits of each image with one prompt per class (softmax over the classes for
        CLIP's probabilities, a sigmoid of each for SigLIP's)."""
        img, txt = self.encode_image(pixel_values), self.encode_text(prompt_ids, prompt_mask)
        return self.similarity_logits(img, txt)


register_family("clip", CLIPConfig, CLIP)
register_preset("clip-vit-b-32", "clip", CLIPConfig(),
                "CLIP ViT-B/32 shape: 12-layer ViT-B/32 + 12-layer 512-wide text")
register_preset("clip-digits", "clip", CLIPConfig(
    vocab_size=64, n_layers=2, context_length=12, d_model=64, n_heads=4, d_ff=128, embed_dim=64,
    vision=ViTConfig(head="none", image_size=8, patch_size=2, n_channels=1, n_layers=3, d_model=64, n_heads=4,
                     d_ff=128, pooling="mean")),
                "3-layer mean-pooled ViT on 8x8 digits + 2-layer text tower, 64-d")
