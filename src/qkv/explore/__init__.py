"""`qkv explore`: a web page that shows what attention does, for any model qkv loads.

    ld = load("runs/reverse")               # a run folder, a qkv checkpoint or a Hugging Face folder
    create_app(ld)                           # the FastAPI app (JSON API + one static page); serve(ld) runs it
    analyze(ld, "0123456789")                # tokens + every layer x head attention map + head statistics
    generation(ld, "The ", max_new_tokens=8) # step by step: token, attention row, top-10, KV cache bytes
    positions(ld)                            # the positional encodings as tables
    export_html(ld, "0123456789", "page.html")  # one self-contained HTML file, data inlined

Modules: adapter.py (the only code that touches models, tasks and caches), analysis.py (tensors -> JSON),
server.py (the ASGI app), export.py (the offline page), static/ (index.html, explore.js, explore.css).
"""

from qkv.explore.adapter import ExploreError, Loaded, load
from qkv.explore.analysis import analyze, generation, info, positions
from qkv.explore.export import export_html
from qkv.explore.server import create_app, serve

__all__ = ["ExploreError", "Loaded", "analyze", "create_app", "export_html", "generation", "info", "load",
           "positions", "serve"]
