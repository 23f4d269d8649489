"""The `qkv explore` command: serve the page, or write one exported HTML file."""

from __future__ import annotations

from pathlib import Path

from qkv.explore.adapter import ExploreError, load


def explore(model: str, *, host: str = "127.0.0.1", port: int = 8000, text: str | None = None,
            target: str | None = None, export: str | None = None) -> int:
    if not 0 <= port <= 65535:
        raise ExploreError(f"--port must be in 0..65535, got {port}")
    ld = load(model)
    if export is not None:
        from qkv.explore.export import export_html

        if text is None:
            raise ExploreError("--export needs --input (the text to show; an image index for a ViT)")
        kw = {}
        if ld.kind == "image":
            try:
                kw["image_index"] = int(text)
            except ValueError:
                raise ExploreError("for an image model, --input is the index of a built-in image, e.g. 3") from None
        out = export_html(ld, text, Path(export), target=target, **kw)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): open it in a browser, no server needed")
        return 0
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:  # pragma: no cover - core dependencies, but a trimmed environment may lack them
        raise ExploreError(f"qkv explore needs fastapi and uvicorn ({e}); pip install fastapi uvicorn") from None
    from qkv.explore.server import serve

    serve(ld, host=host, port=port)
    return 0
