"""Token ids -> text, a piece at a time: what streaming and stop strings need from any tokenizer.

Both helpers take a plain `decode(ids) -> str` (a Hugging Face tokenizer's, a task tokenizer's), so the
Engine, `qkv generate`, `qkv chat` and the server decode the same way whatever the folder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


def decode_continuation(
    decode: Callable[[list[int]], str], context: Sequence[int], ids: Sequence[int]
) -> str:
    """The text `ids` add after `context`: decode(context + ids) minus decode(context). A SentencePiece-style
    (Metaspace) decoder drops the leading space of a text's first token, so a continuation decoded on its own
    loses the space between the prompt and its first word ("Hellocon" for "Hello con"). The ids decoded alone
    should the context's own text change once more ids follow it (none of the decoders qkv reads does)."""
    if not context:
        return decode(list(ids))
    head, full = decode(list(context)), decode([*context, *ids])
    return full[len(head):] if full.startswith(head) else decode(list(ids))


class StreamDecoder:
    """Turns token ids, one at a time, into text pieces whose concatenation is decode(all ids), cut before the
    first stop string (OpenAI leaves the stop string out).

    Decoding a token alone is wrong for byte-level BPE (a character may span tokens) and SentencePiece (a
    leading space depends on the previous token), and decoding all ids every token costs O(length) a token;
    so each push decodes a short window, the tokens from `prefix` on, and emits what it adds to the window's
    text before the token, holding text back while it ends in an incomplete character (U+FFFD) or could still
    become a stop string. The window moves on once its text is complete. flush() decodes all ids once and
    sends the rest of THAT text, so the pieces add up to the full decode exactly whenever the windows agreed
    with it; `mismatch` says they did not (a decoder whose text of a token depends on more than the window's
    tokens: none of those qkv reads, tests/serve).

    `decode` is any ids -> str function: a Hugging Face tokenizer's (HFTokenizer.stream_decoder) or a task
    tokenizer's. `context`: the prompt's last few ids, decoded before the first new token and never sent: a
    SentencePiece-style (Metaspace) decoder drops the leading space of a text's first token, so a completion
    decoded on its own would lose the space between the prompt and its first word (vLLM starts its windows in
    the prompt for the same reason)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 context: Sequence[int] = ()) -> None:
        self.decode = decode
        self.stop = list(stop)
        self.ids: list[int] = [int(i) for i in context]
        self.n_context = len(self.ids)
        self.prefix = 0  # first token of the decoding window
        self.read = self.n_context  # tokens whose text is in self.text (after the context's)
        self.before = decode(self.ids) if self.ids else ""  # decode(ids[prefix:read])
        self.text = ""  # the text of ids[n_context:read], piece by piece
        self.sent = 0  # characters of self.text sent
        self.scanned = 0  # stop strings were searched for in text[:scanned]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # what could still start a stop string
        self.stopped = False  # a stop string was met, or flush() ended the stream
        self.mismatch = False

    def _cut(self, text: str, start: int) -> int:
        """The first stop string's position in text, looking at matches that end after `start`; -1: none."""
        return min((i for i in (text.find(s, max(0, start - len(s) + 1)) for s in self.stop) if i >= 0),
                   default=-1)

    def _send(self, end: int) -> str:
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def push(self, token_id: int) -> str:
        """The new text token_id completes ("" while a character or a possible stop string is incomplete)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        now = self.decode(self.ids[self.prefix:])
        if len(now) <= len(self.before) or now.endswith("\ufffd"):
            return ""
        self.text += now[len(self.before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.before = self.decode(self.ids[self.prefix:self.read])
        if self.stop:
            cut = self._cut(self.text, self.scanned)
            self.scanned = len(self.text)
            if cut >= 0:
                self.stopped = True
                return self._send(cut)
        return self._send(len(self.text) - self.hold)

    def flush(self) -> str:
        """The rest of the text, at the end of the stream (after it, push and flush return "")."""
        if self.stopped:
            return ""
        self.stopped = True
        full = decode_continuation(self.decode, self.ids[:self.n_context], self.ids[self.n_context:])
        if not full.startswith(self.text[:self.sent]):  # cannot happen with a window-consistent decoder
            self.mismatch = True
            full = self.text + self.decode(self.ids[self.prefix:])[len(self.before):]
        cut = self._cut(full, self.sent) if self.stop else -1
        self.text = full
        return self._send(cut if cut >= 0 else len(full))


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """text up to the first stop string (OpenAI leaves it out)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def stream_pieces(token_ids: Iterable[int], decoder: StreamDecoder, write: Callable[[str], object]) -> str:
    """The one streaming loop: each token's text piece written as it completes, the rest and a newline at the
    end; returns the text (without the newline)."""
    pieces = []
    for token_id in token_ids:
        pieces.append(decoder.push(token_id))
        write(pieces[-1])
    pieces.append(decoder.flush())
    write(pieces[-1] + "\n")
    return "".join(pieces)
