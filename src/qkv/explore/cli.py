"""The `qkv explore` command: serve the page, or write one exported HTML file."""

from __future__ import annotations

import base64
from pathlib import Path

from qkv.explore.adapter import ExploreError, load
from qkv.explore.export import check_export_path, export_html
from qkv.explore.server import serve


def explore(model: str, *, host: str = "127.0.0.1", port: int = 8000, text: str | None = None,
            target: str | None = None, export: str | None = None, wav: str | None = None,
            quantize: str | None = None) -> int:
    # 0 ("any free port") is refused: the page's address is printed before uvicorn picks one, so it
    # would be wrong
    if not 1 <= port <= 65535:
        raise ExploreError(f"--port must be in 1..65535, got {port}")
    if export is not None:
        check_export_path(Path(export))  # before loading the model: a wrong path fails at once
    ld = load(model, quantize)
    if export is not None:
        kw: dict = {}
        if wav is not None:
            kw["wav_base64"] = base64.b64encode(_read_wav(Path(wav))).decode()
            text = text or ""
        if text is None:
            raise ExploreError("--export needs --input (the text to show; an image index for a ViT; or "
                               "--wav)")
        if ld.kind == "image":
            try:
                kw["image_index"] = int(text)
            except ValueError:
                raise ExploreError("for an image model, --input is the index of a built-in image, "
                                   "e.g. 3") from None
        out = export_html(ld, text, Path(export), target=target, **kw)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): open it in a browser, no server needed")
        return 0

    serve(ld, host=host, port=port)
    return 0


def _read_wav(path: Path) -> bytes:
    """The bytes of --wav, or one line saying why not (missing, a folder, unreadable)."""
    if not path.exists():
        raise ExploreError(f"--wav file not found: {path}")
    if not path.is_file():
        raise ExploreError(f"--wav {path} is not a file (give a .wav file)")
    try:
        return path.read_bytes()
    except OSError as e:
        raise ExploreError(f"cannot read --wav {path}: {e.strerror or e}") from None
