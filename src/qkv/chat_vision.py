"""`qkv chat DIR --image PATH`: a chat with a vision-language folder (LLaVA) about one image.

    session = VisionChatSession.from_folder("llava-folder", image="cat.png")
    session.reply("What is in the picture?")

The image goes into the next user message (the first one with --image; the one after `/image PATH` in the
interactive chat). Every message is given to the chat template as a list of parts, as multimodal templates
expect ({"type": "image"} then {"type": "text", "text": ...}); the template writes one image token (LLaVA's
"<image>\\n"), which becomes the image_tokens placeholders the image's patch embeddings replace at the
prefill. The conversation is otherwise a ChatSession's (qkv.chat): streaming, end-of-turn tokens, Ctrl-C. A
conversation that no longer fits the context with its image is an error (/reset starts again): the image is
never dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from qkv.chat import ChatSession
from qkv.config import ConfigError
from qkv.interop.llava import IMAGE_TOKEN, ImageProcessor, expand_image_tokens, load_image
from qkv.interop.registry import is_vision_language
from qkv.interop.smolvlm import Idefics3Processor, folder_processor
from qkv.models.vlm import LLaVA
from qkv.run import model_folder


def is_vision_folder(folder: str | Path) -> bool:
    """Whether `folder` holds a vision-language model qkv chats with (config.json alone is read)."""
    try:
        meta = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and (is_vision_language(meta.get("model_type"))
                                       or meta.get("qkv_family") == "llava")


@dataclass
class VisionChatSession(ChatSession):
    processor: ImageProcessor | Idefics3Processor | None = None
    _grid: tuple[int, int] = (0, 0)  # the image's tiles (rows, cols), for an Idefics3Processor's prompt
    pixel_values: Tensor | None = None  # the image of the conversation, preprocessed
    _image_message: dict[str, Any] | None = None  # the user message that carries it (None: the next one)

    @classmethod
    def from_folder(cls, folder: str | Path, quantize: str | None = None, *, image: str | Path | None = None,
                    **kwargs: Any) -> VisionChatSession:
        """A session over a llava folder; image: a file for the first user message."""
        picture = load_image(image) if image is not None else None  # a bad file is said before loading
        session = super().from_folder(folder, quantize, **kwargs)
        if not isinstance(session.model, LLaVA):
            kind = type(session.model).__name__
            raise ConfigError(f"{folder}: --image needs a vision-language model folder (a Hugging Face "
                              f"llava, idefics3 or smolvlm folder); this one holds a {kind}")
        session.processor = folder_processor(model_folder(folder))
        if picture is not None:
            session.set_image(picture)
        return session

    def set_image(self, image: Any) -> None:
        """An image (a PIL image or a file path) for the next user message; it replaces any earlier one, and
        the conversation starts again (the decoder saw the earlier image in its prompt)."""
        if isinstance(image, (str, Path)):
            image = load_image(image)
        if self.processor is None:
            raise ValueError("this session has no image processor (build it with "
                             "VisionChatSession.from_folder)")
        self.pixel_values = self.processor(image)
        if isinstance(self.processor, Idefics3Processor):
            self._grid = self.processor.grid(image)
        self._image_message = None
        self.reset()

    def _parts(self, m: dict[str, Any]) -> dict[str, Any]:
        parts = [{"type": "image"}] if m is self._image_message else []
        return {"role": m["role"], "content": [*parts, {"type": "text", "text": m["content"]}]}

    def _render(self, turns: list[dict[str, str]]) -> list[int]:
        c = self.model.config
        if self.pixel_values is not None and self._image_message is None:
            self._image_message = turns[-1]  # the message being answered
        if self._image_message is not None and not any(m is self._image_message for m in turns):
            raise ValueError("the conversation no longer fits the model's context with its image; /reset "
                             "(or a new /image) starts again")
        if self.templated:
            messages = [self._parts(m) for m in self._messages(turns)]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        else:  # the plain transcript: the image token opens the message that carries it
            image = self.tokenizer.id_to_token(c.image_token_id) or IMAGE_TOKEN
            plain = [{**m, "content": f"{image}\n{m['content']}"} if m is self._image_message else m
                     for m in turns]
            ids = ChatSession._render(self, plain)
        if isinstance(self.processor, Idefics3Processor):  # the image's tokens depend on its tiles
            return self.processor.expand_ids(ids, c.image_token_id, [self._grid], self.tokenizer)
        return expand_image_tokens(ids, c.image_token_id, c.image_tokens)

    def reply(self, message: str, on_text: Callable[[str], None] | None = None) -> str:
        try:
            with self.model.images(self.pixel_values):
                return super().reply(message, on_text)
        except ValueError:
            if not any(m is self._image_message for m in self.history):  # the refused message had the image
                self._image_message = None
            raise

    def reset(self) -> None:
        super().reset()
        if self._image_message is not None:  # the image goes with the next message again
            self._image_message = None


__all__ = ["VisionChatSession", "is_vision_folder"]
