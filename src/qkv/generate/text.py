"""Token ids -> text, a piece at a time: what streaming and stop strings need from any tokenizer.

Both helpers take a plain `decode(ids) -> str` (a Hugging Face tokenizer's, a task tokenizer's), so the Engine,
`qkv generate`, `qkv chat` and the server decode the same way whatever the folder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def decode_continuation(decode: Callable[[list[int]], str], context: Sequence[int], ids: Sequence[int]) -> str:
    """The text `ids` add after `context`: decode(context + ids) minus decode(context). A SentencePiece-style
    (Metaspace) decoder drops the leading space of a text's first token, so a continuation decoded on its own loses
    the space between the prompt and its first word ("Hellocon" for "Hello con"). The ids decoded alone should the
    context's own text change once more ids follow it (none of the decoders qkv reads does)."""
    if not context:
        return decode(list(ids))
    head, full = decode(list(context)), decode([*context, *ids])
    return full[len(head):] if full.startswith(head) else decode(list(ids))


class StreamDecoder:
    """Turns token ids, one at a time, into text pieces whose concatenation is decode(all ids).

    Decoding a token alone is wrong for byte-level BPE (a character may span tokens) and SentencePiece (a
    leading space depends on the previous token), so each step decodes a short window of recent tokens and
    emits what it adds, holding text back while it ends in an incomplete character (U+FFFD). `decode` is any
    ids -> str function: a Hugging Face tokenizer's (HFTokenizer.stream_decoder) or a task tokenizer's."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.decode(self.ids[self.prefix:self.read])
        now = self.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        before = self.decode(self.ids[self.prefix:self.read])
        now = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):]
