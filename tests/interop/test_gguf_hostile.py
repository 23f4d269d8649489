"""Hostile GGUF files: every claim a header makes is bounded before anything proportional to it is read
(HeaderLimits), a tensor type outside ggml's table or a shape past the file's end is one CheckpointError,
and a chat template in the metadata meets the Jinja sandbox's limits, as a folder's does."""

from __future__ import annotations

import struct
import time

import pytest
import torch

import qkv
from qkv.interop.gguf_header import HeaderLimits, read_header
from qkv.storage import CheckpointError

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from _gguf_files import bpe_vocab, write_gguf  # noqa: E402


def s(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def header(*entries: bytes, alignment: bytes = b"") -> bytes:
    """A GGUF v3 file of metadata entries and no tensors."""
    n = len(entries) + bool(alignment)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n) + b"".join(entries) + alignment + b"\0" * 64


def merges(count: int, items: int) -> bytes:
    """tokenizer.ggml.merges: a string array claiming `count` elements, holding `items`."""
    return s("tokenizer.ggml.merges") + struct.pack("<IIQ", 9, 8, count) + s("a b") * items


def test_a_hundred_million_merges_are_refused_from_the_count(tmp_path):
    path = tmp_path / "merges.gguf"
    path.write_bytes(header(merges(10**8, 3)))
    with pytest.raises(CheckpointError, match=r"metadata 'tokenizer.ggml.merges': an array of 100,000,000 "
                                              r"elements .* over the limit of 4,194,304"):
        read_header(path)


def test_an_array_or_string_the_file_does_hold_is_bounded_by_the_limits(tmp_path):
    path = tmp_path / "many.gguf"
    template = s("tokenizer.chat_template") + struct.pack("<I", 8) + s("x" * 500)
    path.write_bytes(header(merges(20, 20), template))
    meta, _, _ = read_header(path)
    assert len(meta["tokenizer.ggml.merges"]) == 20
    with pytest.raises(CheckpointError, match="an array of 20 elements .* over the limit of 10"):
        read_header(path, HeaderLimits(max_array=10))
    with pytest.raises(CheckpointError, match="a string of 500 bytes .* over the limit of 100"):
        read_header(path, HeaderLimits(max_string=100))


def test_a_string_array_longer_than_the_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "short.gguf"
    path.write_bytes(header(merges(4_000_000, 2)))
    t = time.perf_counter()
    with pytest.raises(CheckpointError, match="an array of 4,000,000 strings .* runs past the end of the"):
        read_header(path)
    assert time.perf_counter() - t < 5


@pytest.mark.parametrize("value", [0, 3, 48])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path, value):
    path = tmp_path / "align.gguf"
    path.write_bytes(header(alignment=s("general.alignment") + struct.pack("<II", 4, value)))
    with pytest.raises(CheckpointError, match=f"general.alignment is {value}, not a power of two"):
        read_header(path)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny Llama GGUF file and the byte offset of its token_embd.weight tensor-table entry (after the
    name): n_dims u32, dims u64 x n_dims, ggml type u32."""
    v = bpe_vocab()
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                   vocab_size=len(v["tokens"]), bos_token_id=v["bos"], eos_token_id=v["eos"])
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, transformers.LlamaForCausalLM(cfg), "llama", dict(
        v, template="{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"))
    data = path.read_bytes()
    return path, data, data.index(b"token_embd.weight") + len("token_embd.weight")


def edited(tmp_path, gguf_file, fmt: str, offset: int, value: int):
    _, data, at = gguf_file
    out = bytearray(data)
    struct.pack_into(fmt, out, at + offset, value)
    path = tmp_path / "edited.gguf"
    path.write_bytes(bytes(out))
    return path


def test_a_tensor_type_outside_the_table_is_named(tmp_path, gguf_file):
    path = edited(tmp_path, gguf_file, "<I", 4 + 16, 9999)  # after n_dims (4) and two dims (16)
    with pytest.raises(CheckpointError, match="tensor 'token_embd.weight' has GGML type 9999, which the "
                                              "installed gguf package does not know"):
        qkv.from_pretrained(path)


@pytest.mark.parametrize("dim", [2**63, 2**32 + 7])
def test_shapes_whose_product_overflows_are_refused_before_reading(tmp_path, gguf_file, dim):
    path = edited(tmp_path, gguf_file, "<Q", 4, dim)
    with pytest.raises(CheckpointError, match=r"tensor 'token_embd.weight' ends at byte \d+, the file at"):
        qkv.from_pretrained(path)


def test_a_chat_template_in_the_metadata_meets_the_sandbox_limits(gguf_file):
    from qkv.interop.gguf_tokenizer import load_gguf_tokenizer

    tok = load_gguf_tokenizer(gguf_file[0])
    t = time.perf_counter()
    with pytest.raises(ValueError, match="chat template: the rendered text is over the size limit"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t < 60  # 10^10 iterations asked for
