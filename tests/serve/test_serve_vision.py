"""qkv serve with a LLaVA folder (tiny random weights, built here): an OpenAI image_url part holding a data:
URL answers what qkv's own generate gives for the same image and prompt, streamed or not; URLs the server
would have to fetch, bad base64, bytes that are no PNG / JPEG image are each a 400 that says so."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from _servehelpers import running_server

from qkv.generate.engine import TEXT_CONTEXT
from qkv.generate.text import decode_continuation
from qkv.interop.llava import ImageProcessor, expand_image_tokens, load_image
from qkv.serve import load_served

sys.path.insert(0, str(Path(__file__).parents[1] / "interop"))
from _llava_folder import IMAGE_TOKEN_ID, hf_llava, png, save_processor, save_tokenizer  # noqa: E402

QUESTION = "what is in the picture?"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """The tiny llava folder with its image features and output head scaled up, so that greedy answers
    depend on the image (at the random init's scale every image gave the same tokens)."""
    folder = tmp_path_factory.mktemp("llava") / "llava"
    model = hf_llava()
    with torch.no_grad():
        getattr(model, "model", model).multi_modal_projector.linear_2.weight.mul_(10)
        model.lm_head.weight.mul_(5)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    save_processor(folder)
    return folder


def data_url(path: Path, fmt: str = "PNG") -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.open(path).convert("RGB").save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def ask(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def reference(served, folder: Path, image: Path, eos: list[int], n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, new ids) of qkv's greedy generate on the prompt `qkv chat --image` builds."""
    tok, c = served.codec.tokenizer, served.model.config
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    ids = expand_image_tokens(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True),
                              c.image_token_id, c.image_tokens)
    pixels = ImageProcessor.from_folder(folder)(load_image(image))
    out = served.model.generate(torch.tensor([ids]), max_new_tokens=n, pixel_values=pixels, eos_token_id=eos)
    return ids, out[0, len(ids):].tolist()


def test_an_image_url_data_part_equals_generate_with_that_image(llava, tmp_path):
    served = load_served(llava)
    cat, dog = png(tmp_path / "cat.png", seed=1), png(tmp_path / "dog.png", seed=2)
    with running_server(llava, block_size=4) as (url, app):
        eos = app.state.api.engine.cfg.eos_ids
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for image in (cat, dog):
            ids, new = reference(served, llava, image, eos, 8)
            assert ids.count(IMAGE_TOKEN_ID) == served.model.config.image_tokens
            r = client.chat.completions.create(model=served.name, messages=ask(data_url(image)), max_tokens=8,
                                               temperature=0)
            # the text those tokens add after the prompt (the server's one rule, images or not)
            want = decode_continuation(served.codec.decode, ids[-TEXT_CONTEXT:], new)
            assert r.choices[0].message.content == want and want.strip()
            assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(new)
            pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=served.name, messages=ask(data_url(image)), max_tokens=8, temperature=0, stream=True)
                if c.choices]
            assert "".join(pieces) == r.choices[0].message.content
        # the image matters: the two pictures give different answers (the checks above mean something)
        assert reference(served, llava, cat, eos, 8)[1] != reference(served, llava, dog, eos, 8)[1]
        jpeg = client.chat.completions.create(model=served.name, messages=ask(data_url(cat, "JPEG")),
                                              max_tokens=3, temperature=0)
        assert jpeg.choices[0].finish_reason in ("stop", "length")
        # a text-only chat on the same server runs on the engine: generate's answer without an image
        plain = client.chat.completions.create(
            model=served.name, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
        text = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
        ids = served.codec.tokenizer.apply_chat_template(text, add_generation_prompt=True, tokenize=True)
        new = served.model.generate(torch.tensor([ids]), max_new_tokens=8, eos_token_id=eos)[0, len(ids):]
        assert plain.choices[0].message.content == decode_continuation(served.codec.decode, ids, new.tolist())
        assert plain.usage.prompt_tokens == len(ids)
        assert app.state.api.active == 0
        # the image requests ran in the engine: counted there; each image's repeat (the streamed request)
        # found its blocks in the prefix cache, so only the three distinct images (cat, dog, cat as JPEG)
        # went through the vision tower
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert "qkv_image_requests_total 5.0" in metrics and "qkv_images_encoded_total 3.0" in metrics
        st = app.state.api.engine.stats()
        assert st["image_requests"] == 5 and st["images_encoded"] == 3 and st["prefix_hit_tokens"] > 0
        # the cat with another question: the block where the image ends differs, so the image's last
        # placeholders are computed again, from the embeddings the LRU kept under the image's bytes
        other = [{"role": "user", "content": [{"type": "text", "text": "describe it"},
                                              {"type": "image_url", "image_url": {"url": data_url(cat)}}]}]
        client.chat.completions.create(model=served.name, messages=other, max_tokens=2, temperature=0)
        st = app.state.api.engine.stats()
        assert st["images_encoded"] == 3 and st["image_cache_hits"] == 1


def test_urls_bad_base64_and_non_images_are_400s(llava, tmp_path):
    served = load_served(llava)
    gif = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(gif, format="GIF")
    cases = [
        ("http://example.com/cat.png", "never fetches URLs"),
        ("https://example.com/cat.png", "never fetches URLs"),
        ("file:///etc/passwd", "never fetches URLs"),
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        ("data:image/png," + "abc", "must be base64"),
        ("data:image/png;base64," + base64.b64encode(b"no image here").decode(), "readable image"),
        ("data:image/gif;base64," + base64.b64encode(gif.getvalue()).decode(), "only PNG and JPEG"),
    ]
    with running_server(llava, block_size=4) as (url, app):
        for image_url, words in cases:
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": served.name, "max_tokens": 2, "messages": ask(image_url)})
            assert r.status_code == 400 and words in r.json()["error"]["message"], (image_url, r.text)
            assert r.json()["error"]["param"] == "messages[0]"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="never fetches URLs"):
            client.chat.completions.create(model=served.name, messages=ask("https://x/y.png"), max_tokens=2)
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "model": served.name, "max_tokens": 2, "stream": True, "messages": ask("http://x")}) as r:
            assert r.status_code == 400  # refused before the stream starts
        # two image tokens typed into the text, one image: refused, not a mismatch inside the model
        png_url = data_url(png(tmp_path / "a.png"))
        typed = [{"type": "text", "text": "<image> " + QUESTION},
                 {"type": "image_url", "image_url": {"url": png_url}}]
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": served.name, "max_tokens": 2, "messages": [{"role": "user", "content": typed}]})
        assert r.status_code == 400 and "image token" in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_images_on_a_text_model_are_a_400(gpt2_folder, tmp_path):
    served = load_served(gpt2_folder)
    with running_server(gpt2_folder, block_size=4) as (url, app):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": served.name, "max_tokens": 2, "messages": ask(data_url(png(tmp_path / "a.png")))})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unsupported" and "vision-language" in err["message"]
        assert err["param"] == "messages[0]"


def test_image_requests_are_admitted_under_the_same_limits(llava, tmp_path):
    """An image request counts toward max_batch_size + max_waiting (here 1: the next request is a 429 while
    it runs) and its prompt + max_tokens is checked against the context before it runs."""
    import threading

    from qkv.serve import ServeConfig

    served = load_served(llava)
    body = {"model": served.name, "max_tokens": 2, "messages": ask(data_url(png(tmp_path / "a.png")))}
    with running_server(llava, block_size=4, max_batch_size=1,
                        settings=ServeConfig(max_waiting=0)) as (url, app):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={**body, "max_tokens": 10 ** 6})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        # the image request held in the engine's vision tower while the next one arrives
        images, entered, release = app.state.api.engine.images, threading.Event(), threading.Event()
        ensure = images.ensure

        def held(*args):
            entered.set()
            release.wait(60)
            return ensure(*args)

        images.ensure = held
        out = {}
        th = threading.Thread(target=lambda: out.setdefault(
            "r", httpx.post(url + "/v1/chat/completions", json=body, timeout=60)))
        th.start()
        try:
            assert entered.wait(30)
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": served.name, "prompt": "what", "max_tokens": 2})
            assert r.status_code == 429, r.text
        finally:
            release.set()
            th.join(60)
        assert out["r"].status_code == 200 and app.state.api.active == 0


def test_image_and_text_requests_are_batched_in_the_engine_and_cancelled_there(llava, tmp_path):
    """Two images and a text prompt sent at once run in the same decoding forwards, each answering its own
    reference; a streamed image request whose client leaves is cancelled in the engine; the completions
    endpoint refuses the image token (images come as chat parts)."""
    import threading
    import time

    served = load_served(llava)
    cat, dog = png(tmp_path / "cat.png", seed=1), png(tmp_path / "dog.png", seed=2)
    text = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    with running_server(llava, block_size=4) as (url, app):
        engine = app.state.api.engine
        eos = engine.cfg.eos_ids
        mixed, decode = [], engine._decode

        def slow_decode(batch, events):  # a step long enough for the three requests to meet
            mixed.append({bool(r.images) for r in batch} == {True, False} and len(batch) == 3)
            time.sleep(0.03)
            return decode(batch, events)

        engine._decode = slow_decode
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        out: dict[str, str] = {}

        def ask_for(name, messages):
            r = client.chat.completions.create(model=served.name, messages=messages, max_tokens=8,
                                               temperature=0)
            out[name] = r.choices[0].message.content

        jobs = [("cat", ask(data_url(cat))), ("dog", ask(data_url(dog))), ("text", text)]
        threads = [threading.Thread(target=ask_for, args=job) for job in jobs]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert any(mixed)  # a decoding forward held both image requests and the text one
        for name, image in (("cat", cat), ("dog", dog)):
            ids, new = reference(served, llava, image, eos, 8)
            assert out[name] == decode_continuation(served.codec.decode, ids[-TEXT_CONTEXT:], new)
        ids = served.codec.tokenizer.apply_chat_template(text, add_generation_prompt=True, tokenize=True)
        new = served.model.generate(torch.tensor([ids]), max_new_tokens=8, eos_token_id=eos)[0, len(ids):]
        assert out["text"] == decode_continuation(served.codec.decode, ids, new.tolist())
        # a client that leaves mid-stream: its image request is cancelled at the engine's next step
        cancelled = engine.stats()["cancelled"]
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "model": served.name, "max_tokens": 200, "stream": True, "temperature": 0,
                "messages": ask(data_url(png(tmp_path / "b.png", seed=3)))}) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 30
        while app.state.api.active or engine.stats()["cancelled"] == cancelled:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not engine.has_work
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": served.name, "prompt": [1, IMAGE_TOKEN_ID, 5], "max_tokens": 2})
        assert r.status_code == 400 and "image token" in r.json()["error"]["message"], r.text


def test_a_smolvlm_folder_is_served_with_its_tiles(tmp_path):
    """An Idefics3 / SmolVLM folder: each image is cut into tiles (its placeholder count depends on its size)
    and its tiles' embeddings fill the placeholders in the engine; the answer equals generate's."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "interop"))
    from _smolvlm_folder import smolvlm_folder

    folder = smolvlm_folder(tmp_path / "smol")
    served = load_served(folder)
    proc, tok = served.images, served.codec.tokenizer
    with running_server(folder, block_size=4) as (url, app):
        eos = app.state.api.engine.cfg.eos_ids
        lengths = set()
        for size, seed in (((45, 70), 1), ((30, 100), 2)):
            image = png(tmp_path / f"{seed}.png", size=size, seed=seed)
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": QUESTION}]}]
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": served.name, "max_tokens": 8, "temperature": 0, "messages": messages})
            assert r.status_code == 200, r.text
            pil = load_image(image)
            parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
            ids = proc.expand_ids(tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=True),
                                  served.model.config.image_token_id, [proc.grid(pil)], tok)
            new = served.model.generate(torch.tensor([ids]), max_new_tokens=8, pixel_values=proc(pil),
                                        eos_token_id=eos)[0, len(ids):].tolist()
            assert r.json()["choices"][0]["message"]["content"] == decode_continuation(
                served.codec.decode, ids[-TEXT_CONTEXT:], new)
            assert r.json()["usage"]["prompt_tokens"] == len(ids) and proc(pil).shape[0] > 1  # tiles
            lengths.add(len(ids))
        assert len(lengths) == 2  # the two image sizes take different numbers of placeholders
        assert app.state.api.engine.stats()["images_encoded"] == 2


def test_a_vision_tower_failure_fails_that_request_and_the_server_goes_on(llava, tmp_path, monkeypatch):
    served = load_served(llava)
    cat = png(tmp_path / "cat.png", seed=1)
    with running_server(llava, block_size=4) as (url, app):
        images = app.state.api.engine.images
        inner, calls = images.model.image_features, [0]

        def once_out_of_memory(pixel_values):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("out of memory (a test's vision tower)")
            return inner(pixel_values)

        monkeypatch.setattr(images.model, "image_features", once_out_of_memory)
        body = {"model": served.name, "max_tokens": 4, "temperature": 0, "messages": ask(data_url(cat))}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
        assert "out of memory" in r.json()["error"]["message"]
        # this request failed alone: the engine lives, the same image is answered next
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        assert httpx.get(url + "/health", timeout=10).status_code == 200 and calls[0] == 2
