"""What one request may make `qkv serve` read and decode (ServeConfig's max_request_bytes, max_images,
max_image_bytes, max_image_pixels): each refused with a 413 / 400 before the bytes are held or the pixels
decoded, an image URL the server would have to fetch is never fetched, and the server answers the next
request as before."""

from __future__ import annotations

import base64
import io
import socket
import struct
import sys
import zlib
from pathlib import Path

import httpx
import pytest
from _servehelpers import running_server

from qkv.serve import ServeConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "interop"))
from _llava_folder import llava_folder  # noqa: E402


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return llava_folder(tmp_path_factory.mktemp("llava") / "llava")


def png_url(width: int = 40, height: int = 40) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (20, 120, 200)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def bomb_url(side: int) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def body(*urls: str, text: str = "what is in the picture?") -> dict:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "llava", "messages": [{"role": "user", "content": parts}], "max_tokens": 2,
            "temperature": 0}


LIMITS = ServeConfig(max_request_bytes=200_000, max_messages=50, max_images=2, max_image_bytes=50_000,
                     max_image_pixels=10_000)


def test_each_limit_is_a_clear_4xx_and_the_server_goes_on(llava):
    listener = socket.socket()  # where an http image URL points: the server must never connect to it
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    with running_server(llava, settings=LIMITS) as (url, _):
        post = url + "/v1/chat/completions"
        cases = [
            (body(text="x" * 300_000), 413, None, "over the limit of 200,000 (--max-request-bytes)"),
            (body(png_url(), png_url(), png_url()), 400, "messages", "3 images; at most 2 are taken"),
            ({**body(), "messages": body()["messages"] * 51}, 400, "messages",
             "'messages' holds 51 messages; at most 50 are taken (--max-messages)"),
            (body(*["x"] * 60), 400, "messages", "holds 61 content parts; at most 50"),
            (body(bomb_url(60_000)), 400, "messages[0]",
             "declares 3,600,000,000 pixels, over the limit of 10,000"),
            (body(png_url(101, 100)), 400, "messages[0]", "declares 101 x 100 = 10,100 pixels"),
            (body("data:image/png;base64," + "A" * 80_000), 400, "messages[0]",
             "about 60,000 bytes, over the limit of 50,000 (--max-image-bytes)"),
            (body(f"http://127.0.0.1:{port}/cat.png"), 400, "messages[0]", "never fetches URLs"),
        ]
        for request, status, param, message in cases:
            r = httpx.post(post, json=request, timeout=120)
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert error["param"] == param and message in error["message"], error
        with pytest.raises(TimeoutError):
            listener.accept()
        # no Content-Length (chunked): counted as it arrives
        chunks = (b"x" * 10_000 for _ in range(50))
        r = httpx.post(post, content=chunks, headers={"content-type": "application/json"}, timeout=120)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        r = httpx.post(post, json=body(png_url()), timeout=120)  # the server is unharmed
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    listener.close()
