"""Opening untrusted images: the one place qkv turns bytes it did not make into pixels.

    open_image("cat.png", "cat.png")                         # a file
    open_image(raw_bytes, "messages[0]", ImageLimits(max_pixels=4_000_000))

Every caller (`qkv predict`, `qkv chat --image`, the image-folder tasks, chat fine-tuning records,
`qkv serve`'s image_url parts) goes through open_image, so the limits below hold everywhere. Each is
checked on what the file declares, before anything proportional to that claim is allocated: the byte
size before the bytes are read, the width x height in the header before a pixel is decoded (a 2 KB PNG
can declare 60,000 x 60,000, 10.8 GB of RGB), the format before a decoder runs (only the plugins named
in `formats` are tried: Pillow's EPS plugin, for one, runs Ghostscript), more than one frame before the
first is used.

What comes back is a decoded image in an 8-bit mode: a 16-bit greyscale PNG ("I;16", values up to 65535) is
scaled to 8 bits, where Pillow's own convert("RGB") clips every value above 255 to white. Palette, CMYK,
alpha and the other 8-bit modes are left to the caller's convert(), as Pillow converts them correctly.
Anything else is an ImageError (a ConfigError, so the CLI prints one line) naming `where`.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.config import ConfigError

# Pillow is imported inside open_image: `qkv serve --help` reads ImageLimits' defaults without it

EIGHT_BIT_MODES = ("1", "L", "P", "LA", "PA", "La", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB",
                   "HSV")
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # "I": Pillow's 32-bit container of 16-bit PNGs


class ImageError(ConfigError):
    """An image that cannot or may not be read (the CLI prints it as one line; the server answers 400)."""


@dataclass(frozen=True)
class ImageLimits:
    """What an image may claim. The defaults take any photo or screenshot up to 8K UHD."""

    max_bytes: int = 20 * 2**20  # the encoded file (OpenAI's per-image limit is 20 MB)
    max_pixels: int = 7680 * 4320  # width x height declared in the header: 8K UHD, ~100 MB as RGB
    formats: tuple[str, ...] = ("PNG", "JPEG", "GIF", "WEBP", "BMP")  # Pillow format names tried
    # longer side / shorter side: a processor that resizes the shorter side up (LLaVA's to 336) turns a
    # 1 x 30,000,000 strip into 10^10 pixels; 200 is transformers' Qwen2-VL bound
    max_aspect: float = 200.0


DEFAULT_LIMITS = ImageLimits()


def open_image(source: bytes | str | Path, where: str, limits: ImageLimits = DEFAULT_LIMITS) -> Any:
    """The decoded (loaded, 8-bit) PIL image of a file path or of raw bytes; an ImageError naming `where`
    for anything over `limits` or unreadable."""
    if isinstance(source, bytes):
        size = len(source)
    else:
        try:
            size = os.stat(source).st_size
        except OSError as e:
            raise ImageError(f"{where}: cannot be read ({e.strerror or e})") from None
    if size > limits.max_bytes:
        raise ImageError(f"{where}: the image is {size:,} bytes, over the limit of {limits.max_bytes:,}")
    return _decode(io.BytesIO(source) if isinstance(source, bytes) else source, where, limits)


def _decode(fp: Any, where: str, limits: ImageLimits) -> Any:
    from PIL import Image  # noqa: PLC0415  (Pillow on first use: `qkv serve --help` stays light)

    try:
        with warnings.catch_warnings():
            # Pillow's own bomb warning (past 89M pixels) is superseded by max_pixels, checked below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(fp, formats=list(limits.formats)) as im:
                check_header(im, where, limits)
                im.load()
                return eight_bit(im.copy(), where)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:  # Pillow refuses past 2 x 89M pixels before our check runs
        claim = re.search(r"\((\d+) pixels\)", str(e))
        n = f"{int(claim.group(1)):,}" if claim else f"more than {Image.MAX_IMAGE_PIXELS * 2:,}"
        raise ImageError(f"{where}: the image declares {n} pixels, over the limit of {limits.max_pixels:,}") \
            from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"{where}: not a readable image: only {names(limits.formats)} images are taken") \
            from None
    except Exception as e:  # noqa: BLE001 - a malformed file raises what its plugin happens to hit
        # (OSError "truncated", SyntaxError, struct.error, ValueError, IndexError, EOFError ...): all of them
        # say the bytes are not a readable image, never a fault of the program reading them
        raise ImageError(f"{where}: not a readable image ({type(e).__name__}: {str(e)[:200]})") \
            from None


def names(formats: tuple[str, ...]) -> str:
    """("PNG", "JPEG", "GIF") -> "PNG, JPEG and GIF"."""
    return formats[0] if len(formats) == 1 else f"{', '.join(formats[:-1])} and {formats[-1]}"


def check_header(im: Any, where: str, limits: ImageLimits) -> None:
    """The header's claims against the limits, before any pixel is decoded."""
    w, h = im.size
    if w < 1 or h < 1:
        raise ImageError(f"{where}: the image declares {w} x {h} pixels")
    if w * h > limits.max_pixels:
        raise ImageError(f"{where}: the image declares {w:,} x {h:,} = {w * h:,} pixels, over the limit of "
                         f"{limits.max_pixels:,}")
    if max(w, h) > limits.max_aspect * min(w, h):
        raise ImageError(f"{where}: the image is {w:,} x {h:,}, an aspect ratio over the limit of "
                         f"{limits.max_aspect:g} to 1")
    if getattr(im, "is_animated", False):
        raise ImageError(f"{where}: an animated {im.format} (more than one frame); send a single frame")
    if im.mode not in EIGHT_BIT_MODES + SIXTEEN_BIT_MODES:
        raise ImageError(f"{where}: a {im.format} image in mode {im.mode!r}, which is not taken here")


def eight_bit(im: Any, where: str) -> Any:
    """A 16-bit greyscale image scaled to 8-bit "L" (v * 255 / 65535, rounded); other images as they are."""
    from PIL import Image  # noqa: PLC0415  (Pillow on first use, as above)

    if im.mode not in SIXTEEN_BIT_MODES:
        return im
    import numpy as np  # noqa: PLC0415  (inside, as Pillow: the module stays light for `qkv serve --help`)

    a = np.asarray(im, dtype=np.float64)
    if a.min() < 0 or a.max() > 65535:  # an "I" image that is not a 16-bit PNG's container
        raise ImageError(f"{where}: a 32-bit integer image, which is not taken here")
    return Image.fromarray(np.rint(a * (255 / 65535)).astype(np.uint8))
