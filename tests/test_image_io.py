"""qkv.image_io, the one reader of untrusted images: every hostile image is an ImageError naming its source,
decided on what the file declares before the pixels are decoded; the 8-bit modes come back as Pillow
decodes them and a 16-bit greyscale image is scaled, not clipped."""

from __future__ import annotations

import io
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import Image

from qkv.config import ConfigError
from qkv.image_io import ImageError, ImageLimits, open_image


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A PNG of a few hundred bytes whose header declares width x height RGB pixels (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * (3 * width + 1))) + chunk(b"IEND", b""))


@pytest.mark.parametrize("side, said", [(60_000, "3,600,000,000 pixels"),  # past Pillow's own bomb limit
                                        (9_000, "9,000 x 9,000 = 81,000,000 pixels")])  # past ours only
def test_a_decompression_bomb_is_refused_before_decoding(side, said):
    raw = png_declaring(side, side)
    assert len(raw) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(ImageError, match=f"bomb.png: the image declares {said}, over the limit of "
                                             "33,177,600"):
            open_image(raw, "bomb.png")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20  # nothing proportional to the claim (9,000^2 RGB would be 243 MB)


def test_the_byte_limit_is_checked_before_reading(tmp_path):
    path = tmp_path / "big.png"
    path.write_bytes(encode(Image.new("RGB", (64, 64))) + b"\0" * 5000)
    with pytest.raises(ImageError, match=r"big.png: the image is 5,\d+ bytes, over the limit of 1,000"):
        open_image(path, "big.png", ImageLimits(max_bytes=1000))
    with pytest.raises(ImageError, match="cannot be read"):
        open_image(tmp_path / "missing.png", "missing.png")


def test_sixteen_bit_greyscale_is_scaled_to_eight_bits():
    a = (np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16)  # 0 .. 65520
    im = open_image(encode(Image.fromarray(a)), "deep.png")
    assert im.mode == "L"
    np.testing.assert_array_equal(np.asarray(im), np.rint(a / 65535 * 255).astype(np.uint8))
    # Pillow's own conversion clips: every value above 255 would be white
    assert (np.asarray(Image.fromarray(a).convert("L")) == 255).mean() > 0.9


@pytest.mark.parametrize("mode, fmt", [("CMYK", "JPEG"), ("P", "PNG"), ("P", "GIF"), ("LA", "PNG"),
                                       ("RGBA", "WEBP"), ("1", "BMP"), ("L", "JPEG")])
def test_eight_bit_modes_come_back_as_pillow_decodes_them(mode, fmt):
    src = Image.new("RGB", (8, 6), (200, 30, 60)).convert(mode)
    raw = encode(src, fmt)
    im = open_image(raw, "x")
    want = Image.open(io.BytesIO(raw))
    assert im.mode == want.mode and im.size == (8, 6)
    np.testing.assert_array_equal(np.asarray(im.convert("RGB")), np.asarray(want.convert("RGB")))


def test_an_animated_image_is_refused():
    frames = [Image.new("RGB", (8, 8), c) for c in ("red", "blue", "green")]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(ImageError, match="anim.gif: an animated GIF .*send a single frame"):
        open_image(buf.getvalue(), "anim.gif")


NOISE_IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3)).astype(np.uint8))
NOISE, NOISE_JPEG = encode(NOISE_IMAGE), encode(NOISE_IMAGE, "JPEG")


@pytest.mark.parametrize("raw, message", [
    (NOISE[: len(NOISE) // 2], "not a readable image"),  # truncated
    (NOISE_JPEG[: len(NOISE_JPEG) // 2], "not a readable image"),
    # an EPS file: Pillow would hand it to Ghostscript
    (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "only PNG, JPEG, GIF, WEBP and BMP"),
    (encode(Image.new("RGB", (4, 4)), "TIFF"), "only PNG, JPEG, GIF, WEBP and BMP"),
    (b"GIF89a" + b"<script>alert(1)</script>" * 4, "not a readable image"),  # a GIF/JS polyglot
    (b"", "not a readable image"),
])
def test_truncated_foreign_and_polyglot_files_are_one_error(raw, message):
    with pytest.raises(ImageError, match=message):
        open_image(raw, "x")


def test_image_error_is_the_clis_one_line_error_type():
    assert issubclass(ImageError, ConfigError) and issubclass(ImageError, ValueError)


def test_a_polyglot_that_is_a_png_decodes_as_the_png():
    raw = encode(Image.new("RGB", (5, 4), (1, 2, 3))) + b"PK\x03\x04" + b"\0" * 100  # a PNG with a zip after
    assert np.asarray(open_image(raw, "x")).tolist() == [[[1, 2, 3]] * 5] * 4


def test_a_strip_is_refused_before_a_processor_upscales_it():
    """1 x 30,000 pixels is within every size limit, but resizing its shorter side to 336 (LLaVA) would make
    10^7 pixels of it, and a 1 x 33,000,000 strip 10^10."""
    with pytest.raises(ImageError, match="strip.png: the image is 30,000 x 1, an aspect ratio over the limit "
                                         "of 200 to 1"):
        open_image(encode(Image.new("L", (30_000, 1))), "strip.png")
    assert open_image(encode(Image.new("L", (200, 1))), "ok.png").size == (200, 1)
