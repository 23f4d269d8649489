"""`qkv explore MODEL --input TEXT --export page.html`: the page with its data inlined, one file.

The same index.html, explore.js and explore.css the server sends, with the JSON answers of /api/info,
/api/analyze, /api/generate and /api/positions for one input written into the page as `window.QKV_EXPORT`.
The file loads nothing from anywhere (no server, no network): open it in a browser, attach it to a report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qkv.explore import analysis
from qkv.explore.adapter import ExploreError, Loaded, atomic_write_text
from qkv.explore.server import static_text

CSS_LINK = '<link rel="stylesheet" href="static/explore.css">'
JS_TAG = '<script src="static/explore.js"></script>'


# characters the HTML parser reads inside a <script> (or a JS engine as a line end), written as JSON's \u
# escapes:
# "</script" would close the tag, "<!--<script>" switches the parser into its double-escaped state (the tag
# then never closes), U+2028/9 end a line in older engines. The escaped text is the same JSON value.
_SCRIPT_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                                 "\u2029": "\\u2029"})


def _json_for_script(obj: Any) -> str:
    """JSON that is safe inside <script>, whatever strings it holds (inputs, tokens, generated text)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_SCRIPT_ESCAPES)


def export_data(ld: Loaded, text: str, *, target: str | None = None, image_index: int = 0,
                max_new_tokens: int = 16, wav_base64: str | None = None) -> dict[str, Any]:
    """Everything the page shows for one input, as the API would answer it."""
    data: dict[str, Any] = {"info": analysis.info(ld), "input": text, "target": target, "image": image_index,
                            "analysis": analysis.analyze(ld, text, target=target, image_index=image_index,
                                                         wav_base64=wav_base64),
                            "positions": analysis.positions(ld), "generation": None}
    if analysis.adapter.can_generate(ld):
        try:
            data["generation"] = analysis.generation(ld, text, max_new_tokens=max_new_tokens,
                                                     wav_base64=wav_base64)
        except (ExploreError, ValueError) as e:  # e.g. the prompt leaves no room: the page says so
            data["generation"] = {"error": str(e)}
    return data


def render_page(data: dict[str, Any]) -> str:
    html = static_text("index.html")
    if CSS_LINK not in html or JS_TAG not in html:  # pragma: no cover - guards edits of index.html
        raise RuntimeError("index.html lost the stylesheet link or the script tag the export replaces")
    css, js = static_text("explore.css"), static_text("explore.js")
    js = js.replace("</script", "<\\/script")
    html = html.replace(CSS_LINK, f"<style>\n{css}</style>")
    return html.replace(JS_TAG, f"<script>window.QKV_EXPORT = {_json_for_script(data)};</script>\n"
                                f"<script>\n{js}</script>")


def check_export_path(out: Path) -> None:
    """--export names a file that can be written: not an existing folder, no file where a folder should be."""
    if out.is_dir():
        raise ExploreError(f"--export {out} is a folder: give the page's file name, e.g. {out / 'page.html'}")
    for p in out.parents:
        if p.exists() and not p.is_dir():
            raise ExploreError(f"--export {out}: {p} is a file, not a folder")


def export_html(ld: Loaded, text: str, out: str | Path, **kw: Any) -> Path:
    """Write the self-contained page for `text` to `out` (atomically: a temporary file renamed, removed again
    if the write fails, so a failure leaves nothing behind)."""
    out = Path(out)
    check_export_path(out)
    page = render_page(export_data(ld, text, **kw))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write_text(page, out)
    except OSError as e:
        raise ExploreError(f"cannot write --export {out}: {e.strerror or e}") from None
    return out
