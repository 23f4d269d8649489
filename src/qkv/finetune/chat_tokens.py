"""Token-level pieces shared by the text and the image chat data: the label that the loss ignores, and the
plain transcript encoding for a folder without a chat template."""

from __future__ import annotations

from typing import Any

from qkv.chat import plain_transcript
from qkv.config import ConfigError
from qkv.interop.tokenizer import spans_to_token_mask

IGNORE = -100  # the label cross_entropy skips (its ignore_index)


def encode_plain(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The plain transcript `qkv chat` uses for a folder without a template ("system\n\nUser: ...\nAssistant:
    ..."), with the eos token written after each answer; the loss on " answer<eos>". Tokenized as one text
    (as qkv chat tokenizes it), the answers located by character offsets."""
    if tok.eos_token is None:
        raise ConfigError("the model folder has no chat template and no eos token: cannot mark where an "
                          "answer ends")
    text, spans = plain_transcript(messages, tok.eos_token, reply=False)
    ids, offsets = tok.encode_with_offsets(text, add_special_tokens=True)  # as qkv chat encodes its prompt
    mask = spans_to_token_mask(spans, offsets)
    return ids, [i if m else IGNORE for i, m in zip(ids, mask)]
