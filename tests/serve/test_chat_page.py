"""qkv serve's chat page (GET /) in a real browser: headless Chromium (Debian's `chromium`, driven by
Playwright with the system executable). The page streams its answer from the server's own
/v1/chat/completions with the system prompt and sampling settings typed into it, and keeps the conversation:
the second turn sends the whole of it. Its greedy answer is checked against the official openai client's for
the same request. Skipped, with the reason, when Chromium or Playwright is missing."""

from __future__ import annotations

import json
import shutil

import pytest
from _servehelpers import running_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="playwright (pip, the test extra) is not installed")
if CHROMIUM is None:
    pytest.skip("no Chromium: `apt-get install -y chromium` (.ci/run installs it)", allow_module_level=True)

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 180_000  # generous: the CI machine is shared and can be slow, never a timing assertion
SYSTEM = "You answer briefly."


def test_page_is_served_as_html(gpt2_folder):
    import httpx

    with running_server(gpt2_folder) as (url, _):
        r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text


def test_chat_page_streams_keeps_the_conversation_and_sends_its_settings(gpt2_folder, tmp_path):
    import openai

    with running_server(gpt2_folder) as (url, _), playwright_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                   args=FLAGS, headless=True)
        try:
            page = ctx.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            sent: list[dict] = []
            page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.method == "POST" else None)
            page.goto(url + "/")
            page.wait_for_selector("body[data-ready='1']")
            page.fill("#system", SYSTEM)
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "6")
            answers = []
            for i, message in enumerate(("Hello there", "And then?")):
                page.fill("#input", message)
                page.press("#input", "Enter")
                page.wait_for_selector(f".msg.assistant[data-done='1'] >> nth={i}")
                answers.append(page.locator(".msg.assistant").nth(i).text_content())
            page.click("#clear")
            assert page.locator(".msg").count() == 0
            page.screenshot(path=str(tmp_path / "page.png"))
        finally:
            ctx.close()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
        ref = client.chat.completions.create(model=sent[0]["model"], messages=first, max_tokens=6,
                                             temperature=0).choices[0].message.content
    assert not errors, f"JavaScript errors on the page: {errors}"
    assert answers[0] == ref  # streamed into the page as the API answers it whole
    assert [b["stream"] for b in sent] == [True, True]
    assert sent[0]["messages"] == first and sent[0]["max_tokens"] == 6 and sent[0]["temperature"] == 0
    assert sent[1]["messages"] == [*first, {"role": "assistant", "content": answers[0]},
                                   {"role": "user", "content": "And then?"}]
    assert (tmp_path / "page.png").stat().st_size > 1000
