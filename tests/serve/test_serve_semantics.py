"""What a request means: which settings apply (the request's, else the folder's generation_config.json, else
OpenAI's), where a stop string cuts, which fields and shapes are accepted. Against a server on a loopback
port; references are generate() / transformers run alone."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from _servehelpers import running_server, sse_events

from qkv.generate import generate
from qkv.serve import load_served


@pytest.fixture(scope="module")
def folder_with_defaults(gpt2_folder, tmp_path_factory):
    """gpt2_folder with a generation_config.json as chat models ship one (Qwen's: sampling, top_k, a
    repetition penalty), plus a setting outside vLLM's five (no_repeat_ngram_size) that a server must not
    apply unasked."""
    path = tmp_path_factory.mktemp("gc") / "lm"
    shutil.copytree(gpt2_folder, path)
    (path / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.6,
                "top_k": 1,
                "repetition_penalty": 5.0,
                "no_repeat_ngram_size": 2,
                "transformers_version": "4.45.0",
            }
        )
    )
    return path


def test_a_request_sets_its_sampling_and_the_folder_fills_what_it_leaves_out(folder_with_defaults):
    """vLLM's rule: a field the request sends wins, "off" values included (top_k -1, repetition_penalty 1); a
    field it leaves out takes the folder's generation_config.json value (temperature, top_p, top_k, min_p,
    repetition_penalty), else OpenAI's; nothing else of the folder's settings applies."""
    served = load_served(folder_with_defaults)
    prompt, n = "The class of", 12
    ids = served.codec.encode(prompt)

    def ref(**kw):  # generate() with the folder's own defaults overridden to the stated settings
        out = generate(served.model, torch.tensor([ids]), n, min_new_tokens=n, no_repeat_ngram_size=0, **kw)
        return served.codec.decode(out[0, len(ids):].tolist())

    plain, penalised = (
        ref(do_sample=False, repetition_penalty=1.0),
        ref(do_sample=False, repetition_penalty=5.0),
    )
    # the folder's penalty changes this continuation: the checks below mean something
    assert plain != penalised
    body = {"model": served.name, "prompt": prompt, "max_tokens": n}
    with running_server(folder_with_defaults, block_size=4) as (url, app):
        app.state.api.engine.cfg = app.state.api.engine.cfg.replace(eos_token_id=None)  # n tokens, always

        def text(**kw):
            r = httpx.post(url + "/v1/completions", json={**body, **kw}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        # greedy with the penalty turned off: plain greedy (the folder's 5.0 used to stay on)
        assert text(temperature=0, repetition_penalty=1.0) == plain
        # left out: the folder's penalty (as vLLM); its top_k 1 makes its sampling the penalised argmax
        assert text(temperature=0) == penalised
        assert text() == penalised and text(seed=3) == penalised
        # top_k -1 turns the folder's top_k 1 off: sampling at temperature 1 leaves greedy
        assert any(text(temperature=1.0, top_k=-1, repetition_penalty=1.0, seed=s) != plain for s in range(4))
        for bad in ({"min_p": 1.5}, {"min_p": "x"}, {"top_k": -2}):
            r = httpx.post(url + "/v1/completions", json={**body, **bad}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text


def test_a_stop_string_at_the_start_of_a_sentencepiece_output_stops_it(llama_sp):
    """A stop string that is the first word with its leading space (" con" after "Hello") is cut from the text
    AND ends the generation: finish "stop" after one token (it used to be "length", every token generated)."""
    folder, tok, model = llama_sp
    served = load_served(folder)
    with running_server(folder, block_size=4) as (url, app):
        body = {"model": served.name, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        word = " " + whole.split()[0]
        assert whole.startswith(word)
        r = httpx.post(url + "/v1/completions", json={**body, "stop": word}, timeout=60).json()
        assert r["choices"][0] == {**r["choices"][0], "text": "", "finish_reason": "stop"}
        assert r["usage"]["completion_tokens"] == 1
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stop": word, "stream": True},
                          timeout=60) as s:
            events, done = sse_events(s.iter_lines())
        assert done and "".join(e["choices"][0]["text"] for e in events) == ""
        assert (
            events[-1]["choices"][0]["finish_reason"] == "stop"
            and events[-1]["usage"]["completion_tokens"] == 1
        )


def test_bodies_the_json_parser_refuses_are_400_and_a_bug_is_a_json_500(run_folder):
    """Nesting too deep for the parser (RecursionError) and an integer of over 4300 digits (ValueError) are a
    400 invalid_json, not a plain-text 500; an unexpected exception is a 500 in OpenAI's shape."""
    served = load_served(run_folder)
    with running_server(run_folder, block_size=4) as (url, app):
        for raw in ("[" * 100_000 + "]" * 100_000, '{"model": "x", "max_tokens": ' + "1" * 5000 + "}"):
            r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                           timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text[:200]
        codec = app.state.api.served.codec

        def broken(text):
            raise RuntimeError("injected tokenizer bug")

        codec.encode = broken
        r = httpx.post(url + "/v1/completions", json={"model": served.name, "prompt": "ab"}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert "injected tokenizer bug" in r.json()["error"]["message"]
        del codec.encode
        r = httpx.post(
            url + "/v1/completions", json={"model": served.name, "prompt": "ab", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200
        assert httpx.get(url + "/no/such/path").status_code == 404
        counts = response_counts(httpx.get(url + "/metrics").text)
        assert counts == {
            ("/v1/completions", "400"): 2,
            ("/v1/completions", "500"): 1,
            ("/v1/completions", "200"): 1,
            ("other", "404"): 1,
        }


def response_counts(text: str) -> dict[tuple[str, str], int]:
    """qkv_http_responses_total{endpoint, status} from a /metrics page (the /metrics request itself is counted
    after its page is written)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.labels["endpoint"], s.labels["status"]): int(s.value)
        for f in text_string_to_metric_families(text)
        if f.name == "qkv_http_responses"
        for s in f.samples
        if s.name == "qkv_http_responses_total"
    }


def test_models_retrieve(run_folder):
    """GET /v1/models/{id}: the openai client's models.retrieve(); another name is a 404 model_not_found."""
    import openai

    served = load_served(run_folder)
    with running_server(run_folder, block_size=4) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        m = client.models.retrieve(served.name)
        assert m.id == served.name and m.object == "model"
        assert m.model_dump() == client.models.list().data[0].model_dump()
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")
        r = httpx.get(url + "/v1/models/org/other", timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_stream_options_need_a_stream_and_include_usage_a_boolean(run_folder):
    served = load_served(run_folder)
    body = {"model": served.name, "prompt": "ab", "max_tokens": 3, "temperature": 0}
    with running_server(run_folder, block_size=4) as (url, app):
        for extra in ({"stream_options": {"include_usage": True}}, {"stream": False, "stream_options": {}},
                      {"stream": True, "stream_options": {"include_usage": "no"}},
                      {"stream": True, "stream_options": {"include_usage": 1}}):
            r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", (extra, r.text)
        for extra in ({"stream_options": None}, {"stream": True, "stream_options": {"include_usage": False}}):
            assert httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60).status_code == 200


def test_chat_content_as_text_parts_and_head_health(gpt2_folder):
    """A message's content may be OpenAI's list of parts: the text parts are joined with newlines (as vLLM);
    an image part is a 400. HEAD /health answers like GET."""
    served = load_served(gpt2_folder)
    base = {"model": served.name, "max_tokens": 4, "temperature": 0}
    with running_server(gpt2_folder, block_size=4) as (url, app):
        parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "a class?"}]
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={**base, "messages": [{"role": "user", "content": parts}]})
        same = httpx.post(url + "/v1/chat/completions", timeout=60,
                          json={**base, "messages": [{"role": "user", "content": "What is\na class?"}]})
        assert r.status_code == 200 and same.status_code == 200, r.text
        assert r.json()["choices"] == same.json()["choices"] and r.json()["usage"] == same.json()["usage"]
        image = [{"type": "text", "text": "hi"},
                 {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={**base, "messages": [{"role": "user", "content": image}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported", r.text
        for bad in (None, 3, [{"type": "text"}]):
            r = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={**base, "messages": [{"role": "user", "content": bad}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]", r.text
        r = httpx.head(url + "/health", timeout=60)
        assert r.status_code == 200


def test_a_prompt_alone_over_the_pool_without_max_tokens_names_the_prompt(run_folder):
    """Without max_tokens a request asks for what fits: when the prompt alone does not fit the KV pool, the
    400 names the prompt (the field to change), not a max_tokens the client never sent; with max_tokens it
    names that."""
    served = load_served(run_folder)
    # 12 cached positions, context 64
    with running_server(run_folder, block_size=4, num_blocks=3) as (url, app):
        body = {"model": served.name, "prompt": "a" * 20}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and "shorten it" in err["message"], r.text
        assert "max_tokens" not in err["message"]
        r = httpx.post(
            url + "/v1/completions", json={**body, "prompt": "a" * 8, "max_tokens": 10}, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        r = httpx.post(url + "/v1/completions", json={**body, "prompt": "a" * 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
