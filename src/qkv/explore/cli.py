"""The `qkv explore` command: serve the page, or write one exported HTML file."""

from __future__ import annotations

import base64
from pathlib import Path

from qkv.explore.adapter import ExploreError, load


def explore(model: str, *, host: str = "127.0.0.1", port: int = 8000, text: str | None = None,
            target: str | None = None, export: str | None = None, wav: str | None = None) -> int:
    if not 0 <= port <= 65535:
        raise ExploreError(f"--port must be in 0..65535, got {port}")
    ld = load(model)
    if export is not None:
        from qkv.explore.export import export_html

        kw: dict = {}
        if wav is not None:
            kw["wav_base64"] = base64.b64encode(Path(wav).read_bytes()).decode()
            text = text or ""
        if text is None:
            raise ExploreError("--export needs --input (the text to show; an image index for a ViT; or --wav)")
        if ld.kind == "image":
            try:
                kw["image_index"] = int(text)
            except ValueError:
                raise ExploreError("for an image model, --input is the index of a built-in image, e.g. 3") from None
        out = export_html(ld, text, Path(export), target=target, **kw)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): open it in a browser, no server needed")
        return 0
    from qkv.explore.server import serve

    serve(ld, host=host, port=port)
    return 0
