"""A GGUF file's header: its metadata and tensor table, read with `struct` from the mapped file.

Why not gguf.GGUFReader, which qkv uses for everything else GGUF (types, block sizes, dequantization): it
builds a numpy view per metadata element, and a vocabulary is one string element per token: it took 17-29 s to
open a 49k-token file here (benchmarks/gguf_load.py's model, a loaded machine), this 0.3 s; a 150k-token Qwen2
or Llama 3 vocabulary with its merges has six times the strings. The layout (ggml's
docs/gguf.md, versions 2 and 3, little-endian):

    "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:  key (string) | value type u32 | value        string = length u64 + UTF-8 bytes
                                                           array  = element type u32 + count u64 + elements
    tensors:   name (string) | n_dims u32 | dims u64 x n_dims (innermost first) | ggml type u32 | offset u64
    data:      from the header's end rounded up to general.alignment (32), each tensor at its offset
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from qkv.storage import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits; llama.cpp has not written it since 2023
# metadata value type -> struct format (gguf's GGUFValueType numbering)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class HeaderLimits:
    """What one metadata value may claim, checked on its count before anything is read for it. A file's
    bytes bound every claim already (a claim past the end is refused), but a Python list of short strings
    takes ~7x the bytes they fill in the file: these bound the claims a file large enough can make."""

    max_array: int = 2**22  # elements of one array (16x Gemma 3's 262,144-token vocabulary and its merges)
    max_string: int = 2**24  # bytes of one string (a chat template is a few KB)


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # PyTorch's order (outermost first): the file's dims reversed
    ggml_type: int
    start: int  # byte offset in the file


class _Cursor:
    """Reads values one after another from the mapped file, refusing to run past its end."""

    def __init__(self, buf: Any, limits: HeaderLimits) -> None:
        self.buf, self.pos, self.limits = buf, 0, limits

    def take(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"the header runs past the end of the file at byte {self.pos}")
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values

    def one(self, fmt: str) -> Any:
        return self.take(fmt)[0]

    def string(self) -> str:
        n = self.one("Q")
        if n > self.limits.max_string:
            raise ValueError(f"a string of {n:,} bytes at byte {self.pos}, over the limit of "
                             f"{self.limits.max_string:,} (HeaderLimits.max_string)")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.pos} runs past the end of the file")
        text = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def strings(self, count: int) -> list[str]:
        """`count` strings: string() inlined, as a vocabulary and its merges are hundreds of thousands of
        them."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        if pos + 8 * count > end:  # each string is at least its 8-byte length
            raise ValueError(f"an array of {count:,} strings at byte {pos} runs past the end of the file")
        length, most = struct.Struct("<Q").unpack_from, self.limits.max_string
        for _ in range(count):
            n = length(buf, pos)[0]
            pos += 8
            if n > most:
                raise ValueError(f"a string of {n:,} bytes at byte {pos}, over the limit of {most:,} "
                                 "(HeaderLimits.max_string)")
            if pos + n > end:
                raise ValueError(f"a string of {n} bytes at byte {pos} runs past the end of the file")
            out.append(buf[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self.one(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            element, count = self.one("I"), self.one("Q")
            if count > self.limits.max_array:
                raise ValueError(f"an array of {count:,} elements at byte {self.pos}, over the limit of "
                                 f"{self.limits.max_array:,} (HeaderLimits.max_array)")
            if element in SCALARS:
                return list(self.take(f"{count}{SCALARS[element]}"))
            if element == STRING:
                return self.strings(count)
            return [self.value(element) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind} at byte {self.pos}")


def read_header(path: str | Path, limits: HeaderLimits = HeaderLimits()
                ) -> tuple[dict[str, Any], dict[str, TensorInfo], Any]:
    """(metadata, tensors by name, the mapped file) of a GGUF file; a truncated or malformed one, or one
    whose values claim more than `limits`, is one CheckpointError. The tensor data stays on disk, mapped,
    until a tensor is read."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (it does not start with the bytes 'GGUF')")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, limits)
    cur.pos = 4
    where = "the version and counts"
    try:
        version = cur.one("I")
        if version not in VERSIONS:
            raise CheckpointError(f"{path}: GGUF version {version}; qkv reads versions {VERSIONS}")
        n_tensors, n_meta = cur.take("QQ")
        meta: dict[str, Any] = {}
        for i in range(n_meta):
            where = f"metadata entry {i}"
            key = cur.string()
            where = f"metadata {key!r}"
            meta[key] = cur.value(cur.one("I"))
        where = "the tensor table"
        table = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = cur.take(f"{cur.one('I')}Q")
            table.append((name, tuple(int(d) for d in reversed(dims)), *cur.take("IQ")))
    except (ValueError, struct.error, OverflowError, MemoryError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file, truncated or corrupt ({where}: {e})") \
            from None
    align = meta.get("general.alignment", 32)
    if type(align) is not int or align < 1 or align & (align - 1):  # llama.cpp's rule: a power of two
        raise CheckpointError(f"{path}: not a readable GGUF file (general.alignment is {align!r}, not a "
                              "power of two)")
    data = (cur.pos + align - 1) // align * align
    tensors = {name: TensorInfo(name, shape, kind, data + offset) for name, shape, kind, offset in table}
    return meta, tensors, buf


__all__ = ["HeaderLimits", "TensorInfo", "read_header"]
