"""Property tests of every parser of untrusted input: whatever the bytes, each one parses them or raises the
project's own error type (CheckpointError, ConfigError / ImageError, APIError), never another exception,
and within a time bound (hypothesis' deadline per example).

Inputs are mutations of a valid instance (a GGUF header, a PNG, a chat record, a request body, a run YAML),
which reach deeper than random bytes, plus free-form values. The example budget is fixed and small so the
file runs in seconds; `benchmarks/fuzz.py --examples N` runs the same properties with a larger budget
(QKV_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv.config import ConfigError, TransformerConfig, from_dict
from qkv.finetune.chat_data import read_chats
from qkv.image_io import ImageError, ImageLimits, open_image
from qkv.interop.gguf_header import HeaderLimits, read_header
from qkv.run import load_run_config
from qkv.serve.errors import APIError
from qkv.serve.requests import parse
from qkv.storage import CheckpointError

EXAMPLES = int(os.environ.get("QKV_FUZZ_EXAMPLES", "40"))
# CI: the same examples every run; a longer run (benchmarks/fuzz.py) draws new ones
DERANDOMIZE = "QKV_FUZZ_EXAMPLES" not in os.environ
# a bound per example, far above what any of them takes, well below a hang (a loaded machine is slow)
FUZZ = settings(max_examples=EXAMPLES, deadline=timedelta(seconds=10), database=None, derandomize=DERANDOMIZE,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SCRATCH = Path(tempfile.mkdtemp(prefix="qkv-fuzz-"))  # hypothesis runs many examples per test function


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    """`data` with bytes overwritten at positions (taken modulo its length), then cut at `cut`."""
    out = bytearray(data)
    for pos, value in edits:
        out[pos % len(out)] = value
    return bytes(out[:cut]) if cut is not None else bytes(out)


EDITS = st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=8)
CUTS = st.none() | st.integers(0, 4096)


# -- GGUF --------------------------------------------------------------------------------------------------
def gguf_bytes() -> bytes:
    """A small valid GGUF v3 header: two metadata entries (a string, a string array) and one F32 tensor."""
    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    meta = (s("general.architecture") + struct.pack("<I", 8) + s("llama")
            + s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + s("a") + s("b") + s("ab"))
    tensor = s("token_embd.weight") + struct.pack("<IQQIQ", 2, 4, 3, 0, 0)  # 2 dims (4, 3), F32, offset 0
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + meta + tensor
    return header + b"\0" * (-len(header) % 32) + b"\0" * 48


GGUF = gguf_bytes()


def test_the_gguf_seed_is_valid():
    path = SCRATCH / "seed.gguf"
    path.write_bytes(GGUF)
    meta, tensors, _ = read_header(path)
    assert meta["tokenizer.ggml.tokens"] == ["a", "b", "ab"] and tensors["token_embd.weight"].shape == (3, 4)


@FUZZ
@given(edits=EDITS, cut=CUTS, tail=st.binary(max_size=64))
def test_gguf_header_reader(edits, cut, tail):
    path = SCRATCH / "fuzz.gguf"
    path.write_bytes(mutate(GGUF, edits, cut) + tail)
    try:
        read_header(path, HeaderLimits(max_array=10_000, max_string=10_000))
    except CheckpointError:
        pass


# -- images ------------------------------------------------------------------------------------------------
def image_bytes(fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (6, 5), (10, 200, 30)).save(buf, fmt)
    return buf.getvalue()


IMAGES = [image_bytes(f) for f in ("PNG", "JPEG", "GIF", "BMP", "WEBP")]


@FUZZ
@given(seed=st.sampled_from(range(len(IMAGES))), edits=EDITS, cut=CUTS)
def test_image_loader(seed, edits, cut):
    try:
        im = open_image(mutate(IMAGES[seed], edits, cut), "fuzz", ImageLimits(max_pixels=10**6))
    except ImageError:
        return
    assert im.width * im.height <= 10**6


@FUZZ
@given(raw=st.binary(max_size=256))
def test_image_loader_on_any_bytes(raw):
    try:
        open_image(raw, "fuzz")
    except ImageError:
        pass


# -- chat records (messages, ShareGPT) -----------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                              max_size=4), max_leaves=20)
ROLE = st.sampled_from(["user", "assistant", "system", "human", "gpt", "tool", ""]) | JSON
PART_URL = JSON | st.fixed_dictionaries({"url": st.text()})
CONTENT = st.text(max_size=10) | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "image", "x"])},
                          optional={"text": JSON, "image_url": PART_URL}), max_size=3) | JSON
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": CONTENT})
TURN = st.fixed_dictionaries({"from": ROLE, "value": CONTENT})
RECORD = (st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=5) | JSON})
          | st.fixed_dictionaries({"conversations": st.lists(TURN, max_size=5) | JSON},
                                  optional={"system": JSON, "images": JSON})
          | st.fixed_dictionaries({}, optional={"prompt": JSON, "completion": JSON}) | JSON)


@FUZZ
@given(records=st.lists(RECORD, min_size=1, max_size=3), junk=st.text(max_size=20) | st.just("[" * 5000))
def test_chat_record_reader(records, junk):
    path = SCRATCH / "fuzz.jsonl"
    path.write_text("\n".join([json.dumps(r) for r in records] + [junk]), encoding="utf-8")
    try:
        read_chats(path)
    except ConfigError:
        pass


# -- the server's request bodies --------------------------------------------------------------------------
PNG_URL = "data:image/png;base64," + base64.b64encode(IMAGES[0]).decode()
URL = st.sampled_from([PNG_URL, "http://127.0.0.1/x.png", "data:image/png;base64,@@", "file:///etc/passwd"])
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"])},
                             optional={"text": JSON, "image_url": st.fixed_dictionaries({"url": URL}) | JSON})
CHAT_MESSAGE = st.fixed_dictionaries({"role": ROLE,
                                      "content": st.text(max_size=8) | st.lists(PART, max_size=3) | JSON})
SAMPLING = {k: JSON | st.integers(-3, 5) | st.floats(-1, 3) for k in (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "n", "stop", "stream", "stream_options",
    "logprobs", "response_format", "presence_penalty", "repetition_penalty")}
BODY = st.fixed_dictionaries({"model": st.just("m") | JSON}, optional={
    "messages": st.lists(CHAT_MESSAGE, max_size=3) | JSON,
    "prompt": JSON | st.lists(st.integers(), max_size=4), **SAMPLING})


@FUZZ
@given(body=BODY, chat=st.booleans())
def test_request_models(body, chat):
    try:
        parse(body, chat)
    except APIError as e:
        assert 400 <= e.status < 500


# -- the run config reader (YAML + key=value) ---------------------------------------------------------------
RUN_YAML = """\
task: {name: charlm}
model: {preset: gpt-tiny, d_model: 64, n_layers: 2, moe: {n_experts: 4, n_experts_per_tok: 2}}
train: {lr: 0.001, max_steps: 10}
"""
KEY = st.sampled_from(["model.d_model", "model.n_layers", "model.moe.n_experts", "model.mla.kv_lora_rank",
                       "train.lr", "task", "model", "x.y", "model.moe", ""])
VALUE = st.sampled_from(["1", "0", "-1", "1e9", "[1, 2]", "{a: 1}", "null", "nan", "'x'", "[", "&a [*a]", ""])


@FUZZ
@given(edits=EDITS, cut=st.none() | st.integers(0, len(RUN_YAML)),
       overrides=st.lists(st.builds(lambda k, v: f"{k}={v}", KEY, VALUE) | st.text(max_size=10), max_size=4))
def test_run_config_reader(edits, cut, overrides):
    path = SCRATCH / "fuzz.yaml"
    path.write_bytes(mutate(RUN_YAML.encode(), [(p % len(RUN_YAML), v) for p, v in edits], cut))
    try:
        data = load_run_config(str(path), overrides)
        model = {k: v for k, v in data.get("model", {}).items() if k != "preset"}
        from_dict(TransformerConfig, model).validate()
    except ConfigError:
        pass


@pytest.mark.parametrize("text", ["a: &a [1, 1, 1, 1]\nb: &b [*a, *a, *a, *a]\nc: [*b, *b, *b, *b]\n",
                                  "model: " + "[" * 1000 + "]" * 1000, "model: !!python/object:os.system x"])
def test_run_config_reader_on_hostile_yaml(text):
    path = SCRATCH / "hostile.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_run_config(str(path), [])


def test_an_override_nested_too_deeply_is_one_error():
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_run_config(None, ["model.d_model=" + "[" * 1000 + "]" * 1000])
