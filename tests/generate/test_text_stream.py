"""qkv.generate.text.stream_pieces: the one streaming loop of `qkv generate --stream` (language models,
Hugging Face folders, encoder-decoders): what it writes is the decoded text, whole characters only, then a
newline; what it returns is that text."""

from __future__ import annotations

from qkv.generate.text import StreamDecoder, stream_pieces


def _utf8(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_stream_pieces_writes_whole_characters_and_returns_the_text():
    text = "Köln 🙂 東京"
    written: list[str] = []
    out = stream_pieces(iter(text.encode()), StreamDecoder(_utf8), written.append)
    assert out == text and "".join(written) == text + "\n"
    assert not any("\ufffd" in w for w in written)
    # one write per token + the end
    assert written[-1].endswith("\n") and len(written) == len(text.encode()) + 1


def test_stream_pieces_after_a_context_sends_only_the_new_text():
    prompt, new = "ab", "cé"
    written: list[str] = []
    decoder = StreamDecoder(_utf8, context=list(prompt.encode()))
    assert stream_pieces(iter(new.encode()), decoder, written.append) == new
    assert "".join(written) == new + "\n"
