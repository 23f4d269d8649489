"""LLaVA (Liu et al. 2023, "Visual Instruction Tuning"): a vision encoder, a projector and a decoder LM.

image (n, C, H, W) -> CLIP-style ViT, run up to layer `feature_layer` -> (n, 1 + N, d_v)
  -> drop the class token ("default") or keep it ("full") -> projector: Linear-GELU-Linear (LLaVA 1.5's
  "mlp2x_gelu") or one Linear (LLaVA 1.0) -> image features (n, N', d)
prompt ids (B, T) holding N' placeholder ids (image_token_id) per image -> token embeddings whose placeholder
  rows are replaced by the image features, in order -> the decoder (a qkv GPT: Llama blocks) -> logits

The image is part of the prompt: it enters at the prefill, its positions fill the KV cache like any token's,
and every decoding step after that is the decoder's own. For generation, `with model.images(pixel_values):`
(or model.generate(ids, pixel_values=...)) hands the images to the prefill; qkv.generate is unchanged. The
serving Engine feeds prefill chunks through step_with_images, the embeddings of the chunk's placeholders
given (qkv.generate.images).

The vision tower is CLIP's ViT: patches + class token + learned positions, a LayerNorm on the embeddings
(CLIP's `pre_layrnorm`), Pre-LN blocks with quick-GELU. Only the layers up to the chosen hidden state are
built and run (LLaVA reads the second-to-last layer; the last one and the final norm would be computed for
nothing): `VLMConfig.feature_layer` picks it (a Hugging Face folder loads as a tower cut there, read at -1).
It is built from the shared Block/Stack rather than qkv's ViT class because CLIP's tower differs from that ViT
in three places: a norm on the embeddings, no final norm on the hidden state the projector reads, and a patch
convolution without bias.

Trained from scratch (`qkv train configs/vlm_fashion.yaml`, task vqa): `config_for_task` sizes a small tower
and a Llama-style decoder (RMSNorm, SwiGLU, RoPE, no biases) to the task's images and vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from qkv.config import ConfigError, TransformerConfig, check_fields, setting
from qkv.models.base import ModelOutput, QKVModel, token_loss
from qkv.models.connector import PixelShuffleProjector
from qkv.models.decoding import Source
from qkv.models.gpt import GPT, GPTConfig
from qkv.models.registry import register_family
from qkv.nn.block import Block
from qkv.nn.checks import check_batch, check_labels, check_length, check_token_ids
from qkv.nn.ffn import ACTIVATIONS, UNGATED
from qkv.nn.position import build_position
from qkv.nn.stack import Stack

# the from-scratch model config_for_task builds (dotted VLMConfig fields): a 3-block tower 64 wide and a
# 2-block Llama-style decoder 64 wide, small enough to train on one CPU thread in minutes
SMALL_VLM: dict[str, Any] = {
    "vision.d_model": 64, "vision.n_heads": 4, "vision.d_ff": 128, "vision.n_layers": 3,
    "text.d_model": 64, "text.n_heads": 4, "text.d_ff": 128, "text.n_layers": 2, "text.ffn": "swiglu",
    "text.norm": "rmsnorm", "text.position": "rope", "text.bias": False,
}


@dataclass
class VisionConfig(TransformerConfig):
    """A CLIP vision tower (the TransformerConfig fields describe its blocks)."""

    image_size: int = setting(336, "side of the square input images", ge=1)
    patch_size: int = setting(14, "side of a square patch", ge=1)
    n_channels: int = setting(3, "image channels", ge=1)
    n_layers: int = setting(23, "the tower's blocks (VLMConfig.feature_layer says whose output the projector "
                            "reads)", ge=0)
    class_token: bool = setting(True, "a learned class token before the patches")
    pre_norm: bool = setting(True, "LayerNorm on the embeddings before the first block (CLIP's pre_layrnorm)")
    patch_bias: bool = setting(False, "a bias in the patch convolution (CLIP's has none)")
    post_norm: bool = setting(False, "a LayerNorm on the last built block's output (SigLIP's post_layernorm)")
    d_model: int = TransformerConfig.override("d_model", 1024)
    n_heads: int = TransformerConfig.override("n_heads", 16)
    d_ff: int | None = TransformerConfig.override("d_ff", 4096)
    ffn: str = TransformerConfig.override("ffn", "quick_gelu")
    # the tower adds its own learned positions before the blocks
    position: str = TransformerConfig.override("position", "none")

    def validate(self) -> None:
        super().validate()
        if self.image_size % self.patch_size:
            raise ConfigError(f"image_size ({self.image_size}) must be a multiple of patch_size "
                              f"({self.patch_size})")

    @property
    def n_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + int(self.class_token)


@dataclass
class VLMConfig:
    vision: VisionConfig = setting(VisionConfig(), "the vision tower")
    text: GPTConfig = setting(GPTConfig(), "the language model")
    image_token_id: int = setting(32000, "the placeholder id the image features replace", ge=0)
    # LLaVA's vision_feature_select_strategy
    feature_select: Literal["default", "full"] = setting("default", "default: drop the class token; full: "
                                                         "keep it")
    projector: Literal["mlp", "linear", "pixel_shuffle"] = setting(
        "mlp", "mlp: Linear-act-Linear; linear: one Linear; pixel_shuffle: Idefics3 / SmolVLM "
        "(models/connector.py)")
    projector_act: str = setting("gelu", "the projector's activation", choices=UNGATED)
    projector_bias: bool = setting(True, "biases in the projector")
    scale_factor: int = setting(1, "pixel_shuffle: each scale_factor x scale_factor patches become one image "
                                "token", ge=1)
    # LLaVA's vision_feature_layer. The blocks after it would be computed for nothing, so they are not built.
    feature_layer: int = setting(-1, "which of the tower's n_layers + 1 hidden states (0 = the embeddings) "
                                 "the projector reads; negative counts from the end (-1: the last block's "
                                 "output, -2: LLaVA 1.5's)")
    freeze_vision: bool = setting(False, "the tower's weights are not trained (LLaVA's stage-1 / frozen-CLIP "
                                  "setting)")

    def validate(self) -> None:
        check_fields(self)
        self.vision.validate()
        self.text.validate()
        n = self.vision.n_layers
        if not -(n + 1) <= self.feature_layer <= n:
            raise ConfigError(f"VLMConfig.feature_layer {self.feature_layer} is not a hidden state of a "
                              f"{n}-layer vision tower (0..{n}, or -1..-{n + 1} from the end)")
        if self.feature_select == "default" and not self.vision.class_token:
            raise ConfigError("VLMConfig.feature_select='default' drops a class token the vision tower lacks")
        side = self.vision.image_size // self.vision.patch_size
        if side % self.scale_factor or (self.scale_factor > 1 and (
                self.projector != "pixel_shuffle" or self.vision.class_token)):
            raise ConfigError(f"VLMConfig.scale_factor {self.scale_factor} needs the pixel_shuffle "
                              f"projector, no class token and a divisor of the patch grid's side ({side})")

    @property
    def vision_blocks(self) -> int:
        """The tower's blocks built and run: those up to the hidden state the projector reads."""
        layer = self.feature_layer
        return layer if layer >= 0 else self.vision.n_layers + 1 + layer

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens one image takes in the prompt (the features the projector gives per image)."""
        v = self.vision
        patches = v.n_positions - int(v.class_token and self.feature_select == "default")
        return patches // self.scale_factor ** 2  # the pixel shuffle folds s x s patches into one token

    # what generation and chat read from a decoder's config (models.decoding.configured_context)
    @property
    def position(self) -> str:
        return self.text.position

    @property
    def context_length(self) -> int:
        return self.text.context_length


class VisionTower(nn.Module):
    """(n, C, H, W) pixels -> (n, N + class token, d_v): the hidden state after the last built block."""

    def __init__(self, c: VisionConfig, n_blocks: int | None = None) -> None:
        """n_blocks: the blocks built (default: all of c.n_layers)."""
        super().__init__()
        self.config = c
        n_blocks = c.n_layers if n_blocks is None else n_blocks
        self.patch = nn.Conv2d(c.n_channels, c.d_model, c.patch_size, stride=c.patch_size, bias=c.patch_bias)
        self.cls_emb = nn.Parameter(torch.zeros(1, 1, c.d_model)) if c.class_token else None
        self.pos_emb = nn.Parameter(torch.zeros(1, c.n_positions, c.d_model))
        blocks = [Block(c.d_model, c.n_heads, causal=False, **c.block_kwargs()) for _ in range(n_blocks)]
        none = build_position("none", d_model=c.d_model, n_heads=c.n_heads, max_len=c.n_positions)
        # CLIP's post_layernorm is for pooling: the projector reads a block's output as it is; SigLIP's
        # (Idefics3) is applied to every patch (post_norm)
        self.encoder = Stack(blocks, none, d_model=c.d_model, final_norm=c.post_norm, norm=c.norm,
                             norm_eps=c.norm_eps, bias=c.bias, embed_norm=c.pre_norm)

    def forward(self, pixel_values: Tensor) -> Tensor:
        c = self.config
        want = (c.n_channels, c.image_size, c.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want:
            raise ValueError(f"pixel_values must be (n_images, {', '.join(map(str, want))}) (the vision "
                             f"tower's image size), got {tuple(pixel_values.shape)}")
        w = self.patch.weight
        x = self.patch(pixel_values.to(w.device, w.dtype)).flatten(2).transpose(1, 2)  # (n, N, d), row-major
        if self.cls_emb is not None:
            x = torch.cat([self.cls_emb.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        return self.encoder(x + self.pos_emb.to(x.dtype)).hidden


class Projector(nn.Module):
    """Vision features (d_v) -> the decoder's embedding width (d)."""

    def __init__(self, d_in: int, d_out: int, kind: str, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(d_in, d_out, bias=bias)
        self.act = ACTIVATIONS[act].fn
        self.linear_2 = nn.Linear(d_out, d_out, bias=bias) if kind == "mlp" else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.linear_1(x)
        return x if self.linear_2 is None else self.linear_2(self.act(x))


class LLaVA(QKVModel):
    """A vision-language decoder; implements qkv's decoder protocol (models/decoding.py) through its GPT."""

    kinds: ClassVar[tuple[str, ...]] = ("decoder",)
    is_seq2seq: ClassVar[bool] = False

    def __init__(self, config: VLMConfig, language_model: GPT | None = None) -> None:
        """language_model: a decoder already built (and loaded) for config.text; by default a new one."""
        super().__init__(config)
        c = config
        self.vision = VisionTower(c.vision, c.vision_blocks)
        self.projector = (
            PixelShuffleProjector(c.vision.d_model, c.text.d_model, c.scale_factor)
            if c.projector == "pixel_shuffle"
            else Projector(c.vision.d_model, c.text.d_model, c.projector, c.projector_act, c.projector_bias))
        # a new decoder initialises itself
        self.language_model = language_model if language_model is not None else GPT(c.text)
        for name, p in [*self.vision.named_parameters(), *self.projector.named_parameters()]:
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif not name.startswith("encoder.") or p.dim() > 1:  # the norms' weights stay ones
                nn.init.normal_(p, std=c.vision.init_std)
        self.vision.requires_grad_(not c.freeze_vision)
        self._pending: Tensor | None = None  # image features waiting for the prefill (images())

    @classmethod
    def config_for_task(cls, kind: str, needs: dict[str, Any]) -> dict[str, Any]:
        """A small from-scratch VLM for an image+text task (qkv.tasks.vqa): the tower sized to its images
        (patch_size from the task, so the prompt's placeholder count is known before the model is built) and a
        Llama-style decoder to its vocabulary and context. YAML `model:` keys override any of these fields."""
        if "image_size" not in needs:
            raise ConfigError("a LLaVA model trains from scratch only on an image+text task (task vqa); a "
                              "pretrained one is loaded from a Hugging Face llava folder "
                              "(qkv.from_pretrained)")
        out = {**SMALL_VLM, "image_token_id": needs["image_token_id"]}
        for key in ("image_size", "n_channels", "patch_size"):
            out[f"vision.{key}"] = needs[key]
        for key in ("vocab_size", "context_length"):
            out[f"text.{key}"] = needs[key]
        return out

    # -- images -> features -> embeddings -----------------------------------------------------------------
    def image_features(self, pixel_values: Tensor) -> Tensor:
        """(n, C, H, W) -> (n, image_tokens, d): what replaces each image's placeholder tokens."""
        h = self.vision(pixel_values)
        if self.config.feature_select == "default" and self.config.vision.class_token:
            h = h[:, 1:]
        return self.projector(h)

    def embed(self, input_ids: Tensor, features: Tensor | None = None) -> Tensor:
        """Token embeddings (B, T, d) with the placeholders' rows replaced by `features` (n, N', d), filled in
        reading order (row by row of the batch, left to right): one image's N' placeholders per image."""
        placeholder = input_ids == self.config.image_token_id
        # the placeholder id may lie past the vocabulary (its rows are replaced anyway): embed it as id 0
        x = self.language_model.tok_emb(input_ids.masked_fill(placeholder, 0))
        return self._place(x, placeholder, features)

    def _place(self, x: Tensor, where: Tensor, features: Tensor | None) -> Tensor:
        """x (B, T, d) with the positions `where` (B, T) marks taking the rows of `features` ((n, N', d) per
        image, or (rows, d)) in reading order; ValueError unless there is one row of width d per position (a
        masked_scatter would silently fill them from the wrong numbers)."""
        c = self.config
        n = int(where.sum())
        have = 0 if features is None else features.numel() // features.shape[-1]
        if n != have or (features is not None and features.shape[-1] != x.shape[-1]):
            if features is None:
                what, width = "0 image(s) are given", ""
            else:
                what = (f"{features.shape[0]} image(s) give {have} patch embeddings" if features.dim() == 3
                        else f"{have} image embeddings are given")
                width = f" of width {features.shape[-1]} (the decoder's: {x.shape[-1]})"
            repeated = have and n > have and n % have == 0 and x.shape[0] > 1
            raise ValueError(f"the prompt holds {n} image placeholder tokens (id {c.image_token_id}) but "
                             f"{what}{width} ({c.image_tokens} per image): put {c.image_tokens} placeholders "
                             "per image in the prompt (qkv.interop.llava.expand_image_tokens)" + (
                                 "; a prompt repeated for num_return_sequences > 1 repeats its placeholders, "
                                 "not the images (not supported)" if repeated else ""))
        if features is None:
            return x
        return x.masked_scatter(where.unsqueeze(-1), features.reshape(-1, x.shape[-1]).to(x.dtype))

    def _check_ids(self, input_ids: Tensor, entry: bool = False) -> None:
        ids = input_ids.masked_fill(input_ids == self.config.image_token_id, 0)
        check_token_ids(ids, self.config.text.vocab_size, entry=entry)

    def forward(self, input_ids: Tensor, pixel_values: Tensor | None = None, *,
                image_features: Tensor | None = None, labels: Tensor | None = None,
                attention_mask: Tensor | None = None, cache: Any = None, offset: int | Tensor | None = None,
                return_attentions: bool = False, last_only: bool = False) -> ModelOutput:
        """GPT.forward with images: input_ids (B, T) hold image_tokens placeholders per image of pixel_values
        (n, C, H, W) (or of precomputed image_features (n, N', d)). labels: (B, T), shifted inside,
        -100 = ignore (set it at the placeholders)."""
        lm = self.language_model
        check_batch(input_ids)
        self._check_ids(input_ids)
        if labels is not None:
            check_labels(labels, input_ids)
        past = cache.length if cache is not None else 0
        check_length(past + input_ids.shape[1], lm.context_limit)
        if pixel_values is not None:
            if image_features is not None:
                raise ValueError("give pixel_values or image_features, not both")
            image_features = self.image_features(pixel_values)
        x = self.embed(input_ids, image_features)
        keep = attention_mask.bool() if attention_mask is not None else None
        out = lm.decoder(x, keep=keep, cache=cache, offset=offset, return_weights=return_attentions,
                         last_only=last_only)
        logits = lm.lm_head(out.hidden[:, -1:] if last_only else out.hidden)
        loss = n = None
        if labels is not None:
            loss, n = token_loss(logits[:, :-1], labels[:, 1:])
        return ModelOutput(logits=logits, loss=loss, n_targets=n, last_hidden_state=out.hidden,
                           attentions=out.attentions or None)

    # -- generation: the decoder protocol, the images handed to the prefill ---------------------------------
    @contextmanager
    def images(self, pixel_values: Tensor | None) -> Iterator[None]:
        """Inside, every prefill fills the prompt's placeholders with these images' features (computed once,
        here). The decoding steps never see them: the image is in the KV cache after the prefill."""
        saved = self._pending
        with torch.no_grad():
            self._pending = None if pixel_values is None else self.image_features(pixel_values)
        try:
            yield
        finally:
            self._pending = saved

    def generate(self, input_ids: Tensor, *args: Any, pixel_values: Tensor | None = None,
                 **kwargs: Any) -> Any:
        """qkv.generate.generate with images: the prompt holds image_tokens placeholders per image."""
        with self.images(pixel_values):
            return super().generate(input_ids, *args, **kwargs)

    @property
    def context_limit(self) -> int | None:
        return self.language_model.context_limit

    @property
    def output_vocab_size(self) -> int:
        return self.language_model.output_vocab_size

    def generation_defaults(self) -> dict[str, Any]:
        out = {**self.language_model.generation_defaults(), **self.folder_generation_config}
        c = self.config
        # a placeholder is never generated: images come with the prompt
        if c.image_token_id < c.text.vocab_size:
            out["bad_words_ids"] = [*(out.get("bad_words_ids") or []), [c.image_token_id]]
        return out

    def make_cache(self, batch_size: int, max_len: int | None = None, **kwargs: Any) -> Any:
        return self.language_model.make_cache(batch_size, max_len, **kwargs)

    def make_paged_cache(self, num_blocks: int | None = None, block_size: int = 16, **kwargs: Any) -> Any:
        return self.language_model.make_paged_cache(num_blocks, block_size, **kwargs)

    def encode_source(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Source | None:
        self._check_ids(inputs, entry=True)
        return None

    def prefill(self, ids: Tensor, cache: Any, *, keep: Tensor | None = None,
                offset: int | Tensor | None = None, source: Source | None = None,
                return_attentions: bool = False) -> tuple[Tensor, list | None]:
        # the images enter with the prompt: a later call over a filled cache (a step run as a full forward,
        # for its attention weights) holds only new tokens; a recomputation without cache holds the whole
        # prompt
        first = cache is None or cache.length == 0
        out = self(ids, image_features=self._pending if first else None, attention_mask=keep, cache=cache,
                   offset=offset, return_attentions=return_attentions, last_only=True)
        return out.logits[:, -1], out.attentions

    def step(self, ids: Tensor, cache: Any, *, keep: Tensor | None = None,
             offset: int | Tensor | None = None) -> Tensor:
        return self.language_model.step(ids, cache, keep=keep, offset=offset)

    def step_with_images(self, ids: Tensor, cache: Any, *, where: Tensor, features: Tensor,
                         keep: Tensor | None = None, offset: int | Tensor | None = None) -> Tensor:
        """step() for a prefill piece holding image placeholders (the serving Engine's): the positions
        `where` (B, T) marks take the rows of `features` (n, d) in reading order, the others their token's
        embedding. A piece may hold any part of an image's placeholders (chunked prefill)."""
        lm = self.language_model
        x = self._place(lm.tok_emb(ids.masked_fill(where, 0)), where, features)
        h = lm.decoder.step(x, cache=cache, keep=keep, offset=offset, last_only=True)
        return lm.lm_head(h[:, -1])

    @property
    def static_step_supported(self) -> bool:
        return self.language_model.static_step_supported

    def static_step(self, ids: Tensor, cache: Any, *, index: Tensor, offset: Tensor,
                    keep: Tensor | None = None) -> Tensor:
        return self.language_model.static_step(ids, cache, index=index, offset=offset, keep=keep)


register_family("llava", VLMConfig, LLaVA)
