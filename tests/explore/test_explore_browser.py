"""The page in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright with the system
executable; `playwright install` is never run). A uvicorn server on an ephemeral 127.0.0.1 port serves a
tiny model; the test types an input, waits for the heat map, counts the drawn cells, hovers a token, reads
the highlight, screenshots the page and checks it is not blank. The exported HTML is opened from disk with
every network request refused. Skipped, with the reason, when Chromium or Playwright is missing."""

from __future__ import annotations

import io
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="playwright (pip, the test extra) is not installed")
if CHROMIUM is None:
    pytest.skip("no Chromium: `apt-get install -y chromium` (.ci/run installs it)", allow_module_level=True)

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LINE_MIN = 0.02  # explore.js draws a line for every weight >= this
TIMEOUT_MS = 180_000  # generous: the CI machine is shared and can be slow, never a timing assertion


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with playwright_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("chromium-profile")),
                                                   executable_path=CHROMIUM, args=FLAGS, headless=True,
                                                   viewport={"width": 1280, "height": 1000})
        yield ctx
        ctx.close()


@pytest.fixture
def page(browser):
    pg = browser.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    pg.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _serve(folder: Path):
    """(url, stop) for a uvicorn server of the explorer on a free 127.0.0.1 port, in a thread."""
    import uvicorn

    from qkv.explore import create_app, load

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(load(folder)), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):  # bounded wait for start-up
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"

    def stop():
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}/", stop


@pytest.fixture(scope="module")
def rev_server(rev_run):
    url, stop = _serve(rev_run)
    yield url
    stop()


@pytest.fixture(scope="module")
def charlm_server(charlm_run):
    url, stop = _serve(charlm_run)
    yield url
    stop()


def _not_blank(png: bytes) -> float:
    import matplotlib.image

    img = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]
    return float(img.var())


def _check_head(pg, data: dict, view: int, layer: int, head: int, hover_q: int) -> None:
    """Select a head; the heat map has Tq x Tk cells; hovering query `hover_q` highlights its row and the
    lines to the keys it attends to (weight >= LINE_MIN in the API's data)."""
    pg.select_option("#view", str(view))
    pg.select_option("#layer", str(layer))
    pg.select_option("#head", str(head))
    v = data["views"][view]
    m = v["layers"][layer][head]
    tq, tk = len(m), len(m[0])
    assert tq == len(data["tokens"][v["queries"]]) and tk == len(data["tokens"][v["keys"]])
    assert pg.locator("#heatmap rect.cell").count() == tq * tk
    pg.hover(f"#lines text.q-tok[data-i='{hover_q}']")
    assert pg.locator("#heatmap rect.cell.hl").count() == tk
    assert pg.locator(f"#heatmap rect.cell.hl[data-q='{hover_q}']").count() == tk
    expected = sum(1 for p in m[hover_q] if p >= LINE_MIN)
    assert pg.locator("#lines line.active").count() == expected
    assert pg.locator(f"#lines line.active:not([data-q='{hover_q}'])").count() == 0
    assert "hl" in (pg.get_attribute(f"#lines text.q-tok[data-i='{hover_q}']", "class") or "")
    # hover a key: the column lights up
    pg.hover("#lines text.k-tok[data-i='0']")
    assert pg.locator("#heatmap rect.cell.hl[data-k='0']").count() == tq


def test_page_draws_encoder_decoder_maps_and_highlights(page, rev_server, tmp_path):
    import httpx

    src = "31415926"
    # what the page asks
    data = httpx.post(rev_server + "api/analyze", json={"input": src}, timeout=TIMEOUT_MS / 1000).json()
    page.goto(rev_server)
    page.wait_for_function("window.QKV && window.QKV.info")
    page.fill("#input", src)
    page.click("#analyze")
    page.wait_for_selector("#heatmap rect.cell")
    assert page.locator("#tokens .tok[data-role='source']").count() == len(src)
    assert [o.strip() for o in page.locator("#view option").all_inner_texts()] == \
        ["encoder self", "decoder self (causal)", "cross"]
    n_layers, n_heads = len(data["views"][2]["layers"]), len(data["views"][2]["layers"][0])
    assert page.locator("#overview .thumb").count() == 2 * 4  # every encoder layer x head
    _check_head(page, data, view=0, layer=1, head=2, hover_q=3)  # encoder self: S x S
    _check_head(page, data, view=2, layer=n_layers - 1, head=n_heads - 1, hover_q=2)  # cross: T x S
    assert page.locator("#stats tr").count() == 1 + n_heads
    shot = page.screenshot(path=str(tmp_path / "explore.png"), full_page=True)
    assert _not_blank(shot) > 0.005


def test_page_generation_steps(page, rev_server):
    page.goto(rev_server)
    page.wait_for_function("window.QKV && window.QKV.info")
    page.fill("#input", "2718")
    page.fill("#max-new", "6")
    page.click("#generate")
    page.wait_for_selector("#gen-top rect")
    n = page.locator("#gen-tokens .tok.gen").count()
    assert 1 <= n <= 6
    assert page.locator("#gen-top rect").count() == 10  # top-10 bars
    assert page.locator("#gen-cache polyline").count() == 3  # static, paged, used
    page.fill("#step", str(n - 1))
    page.dispatch_event("#step", "input")
    assert f"step {n - 1} of {n - 1}" in page.inner_text("#step-label")
    assert f"{1 + n - 1} positions cached" in page.inner_text("#cache-note")


def test_page_shows_bad_input_as_a_message(page, charlm_server):
    page.goto(charlm_server)
    page.wait_for_function("window.QKV && window.QKV.info")
    for text, words in [("", "empty"), ("snow ☃", "does not know: '☃'"), ("x" * 40, "context is 32")]:
        page.fill("#input", text)
        page.click("#analyze")
        page.wait_for_selector("#error:not([hidden])")
        assert words in page.inner_text("#error")
        assert "Traceback" not in page.content()
        assert page.locator("#heatmap rect.cell").count() == 0
    page.fill("#input", "def f(x):")  # a good input clears the message and draws a causal map
    page.click("#analyze")
    page.wait_for_selector("#heatmap rect.cell")
    assert page.is_hidden("#error")
    assert page.locator("#heatmap rect.cell").count() == 9 * 9


def test_positions_tab_draws_pictures(page, charlm_server):
    page.goto(charlm_server)
    page.wait_for_function("window.QKV && window.QKV.info")
    page.click("#tabs button[data-tab=positions]")
    page.wait_for_selector("#positions .enc canvas")
    assert "tokens: learned" in page.inner_text("#positions h3")
    assert page.locator("#positions canvas").count() == 2  # the table and the similarity between positions


def test_exported_page_works_offline(browser, hf_gpt2, tmp_path):
    """A Hugging Face GPT-2 folder (random weights with spread-out attention, so the line threshold matters),
    exported with the CLI, opened from disk with every non-file request refused."""
    from qkv.cli.main import main
    from qkv.explore import analyze, load

    text = "def getsource(object):"
    out = tmp_path / "page.html"
    assert main(["explore", str(hf_gpt2), "--input", text, "--export", str(out)]) == 0
    data = analyze(load(hf_gpt2), text)
    m = data["views"][0]["layers"][1][3]
    T = len(m)
    pg = browser.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    requests: list[str] = []

    def refuse(route):
        requests.append(route.request.url)
        route.abort() if not route.request.url.startswith("file://") else route.continue_()

    pg.route("**/*", refuse)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(out.as_uri())
    pg.wait_for_selector("#heatmap rect.cell")
    pg.select_option("#layer", "1")
    pg.select_option("#head", "3")
    assert pg.locator("#heatmap rect.cell").count() == T * T
    q = T - 1  # the last query sees every key
    pg.hover(f"#lines text.q-tok[data-i='{q}']")
    assert pg.locator("#heatmap rect.cell.hl").count() == T
    want = {k for k, p in enumerate(m[q]) if p >= LINE_MIN}
    assert 0 < len(want) < T  # some keys fall under the threshold: the count below means something
    active = pg.locator("#lines line.active")
    got = {int(active.nth(i).get_attribute("data-k")): float(active.nth(i).get_attribute("stroke-opacity"))
           for i in range(active.count())}
    assert set(got) == want
    for k, opacity in got.items():  # a line's opacity is its weight
        assert opacity == pytest.approx(m[q][k], abs=1e-3)
    pg.click("#tabs button[data-tab=generation]")
    assert pg.locator("#gen-tokens .tok.gen").count() == 16
    pg.click("#tabs button[data-tab=positions]")
    assert pg.locator("#positions canvas").count() == 2
    assert [u for u in requests if not u.startswith("file://")] == []  # nothing but the file itself
    assert pg.is_disabled("#analyze")
    assert _not_blank(pg.screenshot(full_page=True)) > 0.005
    pg.close()
    assert not errors


def test_vit_patches_drawn_over_the_image(page, tmp_path_factory):
    import qkv

    folder = qkv.build("vit-digits", image_size=16,
                       pooling="cls").save_pretrained(tmp_path_factory.mktemp("vit"))
    url, stop = _serve(folder)
    try:
        page.goto(url)
        page.wait_for_function("window.QKV && window.QKV.info")
        assert page.is_hidden("#text-row") and page.is_visible("#image")
        page.select_option("#image", "5")
        page.click("#analyze")
        page.wait_for_selector("#heatmap rect.cell")
        assert page.locator("#heatmap rect.cell").count() == 17 * 17  # class token + 4 x 4 patches
        assert page.is_visible("#image-canvas")
        assert "the class token" in page.inner_text("#image-caption")
        before = page.locator("#image-canvas").screenshot()
        page.hover("#lines text.q-tok[data-i='6']")  # patch (1, 1): its own attention over the picture
        assert "patch 1,1" in page.inner_text("#image-caption")
        after = page.locator("#image-canvas").screenshot()
        assert _not_blank(before) > 0.001 and before != after
    finally:
        stop()


def test_an_exported_page_draws_whatever_the_input_holds(browser, hf_gpt2, tmp_path):
    """Inlined JSON with "<!--<script>" in it put the parser into its double-escaped state: the data script
    never closed and the page drew nothing (no QKV_EXPORT). Every '<', '>', '&' is now a JSON escape."""
    from qkv.cli.main import main

    text = "a <!--<script> b </script> & c"
    out = tmp_path / "hostile.html"
    assert main(["explore", str(hf_gpt2), "--input", text, "--export", str(out)]) == 0
    pg = browser.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(out.as_uri())
    pg.wait_for_selector("#heatmap rect.cell")
    assert pg.evaluate("window.QKV_EXPORT.input") == text and not errors
    pg.close()


def test_llava_answer_drawn_over_the_image(page, tmp_path_factory):
    """A vision-language folder: the question and the image picker both shown; the heat map holds the rows
    that chose the answer's tokens over every position; the canvas draws where one answer token's query looks
    on the image, and another token's query draws another picture."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "interop"))
    from _llava_folder import llava_folder

    folder = llava_folder(tmp_path_factory.mktemp("llava") / "model")
    url, stop = _serve(folder)
    try:
        page.goto(url)
        page.wait_for_function("window.QKV && window.QKV.info")
        assert page.is_visible("#input") and page.is_visible("#image")
        assert page.inner_text("#input-label") == "Question"
        page.fill("#input", "what is in the picture?")
        page.select_option("#image", "3")
        page.click("#analyze")
        page.wait_for_selector("#heatmap rect.cell")
        data = page.evaluate("window.QKV.analysis")
        n_answer, n_all = len(data["tokens"]["answer"]), len(data["tokens"]["input"])
        assert n_answer >= 2 and page.locator("#heatmap rect.cell").count() == n_answer * n_all
        assert page.is_visible("#image-canvas")
        assert "answer: " in page.inner_text("#image-caption")
        before = page.locator("#image-canvas").screenshot()
        page.hover("#lines text.q-tok[data-i='1']")  # the query that chose the second answer token
        assert data["tokens"]["answer"][1] in page.inner_text("#image-caption")
        after = page.locator("#image-canvas").screenshot()
        assert _not_blank(before) > 0.001 and before != after
    finally:
        stop()
