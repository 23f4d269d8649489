"""OpenAI's image_url content parts for a vision-language model (LLaVA, Idefics3 / SmolVLM): data: URLs only.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0..."}}

The server never fetches a URL (an http(s) address would let any client make it connect anywhere), so any
other scheme is a 400, as is a payload that is not base64 or not a PNG / JPEG image. The conversation is
rendered as qkv chat --image renders it (chat_vision.py): every message as a list of parts for the chat
template ({"type": "image"} where an image was, {"type": "text", ...}), each image token the template
writes expanded to the model's placeholders, which the image's projected embeddings replace at the prefill.
The request then runs in the engine like any other (generate/images.py: its blocks keyed by the image's
bytes in the prefix cache, its embeddings kept in an LRU by the same key).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Any

from qkv.generate.images import ImageInput
from qkv.image_io import ImageError, ImageLimits, open_image
from qkv.interop.llava import expand_image_tokens
from qkv.serve.config import ServeConfig
from qkv.serve.errors import APIError
from qkv.serve.requests import ChatCompletionRequest, ImagePart


@dataclass
class DecodedImage:
    """One image of a request: the PIL image and the bytes it was decoded from (its content key)."""

    pil: Any
    raw: bytes


def decode_data_url(url: str, param: str, limits: ImageLimits) -> DecodedImage:
    """The image of a `data:image/...;base64,...` URL; a 400 naming `param` for anything else, or for an image
    over `limits` (qkv.image_io: checked before its pixels are decoded)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme != "data":
        what = f"a {scheme}: URL" if scheme else "not a data: URL"
        raise APIError(400, f"{param}: {what}; this server never fetches URLs: send the image inline as "
                       "data:image/png;base64,... or data:image/jpeg;base64,...", param, "unsupported")
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise APIError(400, f"{param}: a data: URL must be base64 (data:image/png;base64,...)", param,
                       "invalid_value")
    if len(payload) * 3 // 4 > limits.max_bytes:  # base64's size, before it is decoded
        raise APIError(400, f"{param}: the image is about {len(payload) * 3 // 4:,} bytes, over the limit of "
                       f"{limits.max_bytes:,} (--max-image-bytes)", param, "invalid_value")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"{param}: the data: URL is not valid base64 ({e})", param,
                       "invalid_value") from None
    try:
        image = open_image(raw, param, limits)
    except ImageError as e:
        raise APIError(400, str(e), param, "invalid_value") from None
    return DecodedImage(image, raw)


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as a multimodal chat template reads them: a list of parts each, images as
    {"type": "image"}."""
    out = []
    for m in body.messages:
        parts = [{"type": "text", "text": m.text}] if not isinstance(m.content, list) else [
            {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
            for p in m.content]
        out.append({"role": m.role, "content": parts})
    return out


def decoded_images(body: ChatCompletionRequest, settings: ServeConfig) -> list[DecodedImage]:
    """The request's images, in order (400s for anything but a PNG / JPEG data: URL within the limits,
    and for more images than settings.max_images, counted before any is decoded)."""
    urls = [(f"messages[{i}]", url) for i, m in enumerate(body.messages) for url in m.images]
    if len(urls) > settings.max_images:
        raise APIError(400, f"the request holds {len(urls)} images; at most {settings.max_images} are taken "
                       "(--max-images)", "messages", "invalid_value")
    limits = settings.image_limits
    return [decode_data_url(url, param, limits) for param, url in urls]


def image_inputs(images: list[DecodedImage], processor: Any) -> list[ImageInput]:
    """Each image preprocessed for the model ((tiles, 3, H, W)), keyed by the SHA-256 of its bytes and the
    preprocessing settings (what the embedding depends on besides the weights): the engine's prefix cache
    and embedding LRU match a repeated image by that key."""
    out = []
    for im in images:
        try:
            pixels = processor(im.pil)
        except ValueError as e:  # a preprocessing step the image cannot take (e.g. smaller than the crop)
            raise APIError(400, f"the image cannot be preprocessed for this model: {e}", "messages",
                           "invalid_value") from None
        key = hashlib.sha256(repr(processor).encode() + b"\0" + im.raw).digest()
        out.append(ImageInput(pixels, key=key))
    return out


def expand_placeholders(ids: list[int], served: Any, images: list[DecodedImage]) -> list[int]:
    """The template's image tokens expanded to each image's placeholders (LLaVA: image_tokens; Idefics3:
    the tiles' text, image_seq_len per tile); a 400 unless there is exactly one per image (a template that
    writes none, or an image token typed into the text)."""
    c = served.model.config
    found = sum(1 for i in ids if i == c.image_token_id)
    if found != len(images):
        raise APIError(400, f"the rendered prompt holds {found} image token(s) for {len(images)} image(s): "
                       "the chat template must write one per image part, and the text none", "messages",
                       "invalid_value")
    if hasattr(served.images, "expand_ids"):  # tiles: each image's text depends on its size
        grids = [served.images.grid(im.pil) for im in images]
        return served.images.expand_ids(ids, c.image_token_id, grids, served.codec.tokenizer)
    return expand_image_tokens(ids, c.image_token_id, c.image_tokens)
