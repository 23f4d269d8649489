"""What real clients send past plain sampling, through the official `openai` client on a loopback server:
log-probabilities (equal to transformers' log-softmax of the same random-weight GPT-2), echo with max_tokens=0
(an evaluation harness's prompt scoring), n choices (streamed with their index, usage counting them),
presence / frequency penalties and logit_bias (against their definitions on transformers' logits), and the
400s for their bad values, after which the server still answers."""

from __future__ import annotations

from collections import Counter

import openai
import pytest
import torch
from _servehelpers import running_server

from qkv.serve import load_served


@pytest.fixture(scope="module")
def hf(gpt2_folder):
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()


@pytest.fixture(scope="module")
def server(gpt2_folder):
    with running_server(gpt2_folder, block_size=8, max_batch_size=8) as (url, app):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60), app


def log_softmax(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)


PROMPT = "The quick brown fox jumps over the lazy dog because"


def test_echo_scores_the_prompt(server, hf, gpt2_folder):
    client, app = server
    ids = load_served(gpt2_folder).codec.encode(PROMPT)
    r = client.completions.create(model=app.state.api.served.name, prompt=PROMPT, echo=True, max_tokens=0,
                                  logprobs=3)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    ref = log_softmax(hf, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-5)
        assert len(lp.top_logprobs[j]) in (3, 4)  # the top 3, and the prompt's own token when not among them
        assert max(lp.top_logprobs[j].values()) == pytest.approx(ref[j - 1].max().item(), abs=1e-5)
    assert "".join(lp.tokens) == PROMPT and lp.text_offset == [sum(map(len, lp.tokens[:j]))
                                                               for j in range(len(ids))]
    # streamed: the same object in the first chunk
    chunks = list(client.completions.create(model=r.model, prompt=PROMPT, echo=True, max_tokens=0,
                                            logprobs=3, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_token_logprobs_completions_and_chat(server, hf, gpt2_folder):
    client, app = server
    name = app.state.api.served.name
    served = load_served(gpt2_folder)
    messages = [{"role": "user", "content": "Say something."}]
    ids = served.codec.chat_prompt(messages)
    # greedy over the rendered prompt as token ids: the chosen tokens are the argmax of transformers' logits
    r = client.completions.create(model=name, prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    seq, tops = list(ids), []
    for k in range(6):
        ref = log_softmax(hf, seq)[-1]
        assert lp.token_logprobs[k] == pytest.approx(ref.max().item(), abs=1e-5)
        # keyed by token text: two byte-level pieces may both read U+FFFD (the likelier is kept)
        assert max(lp.top_logprobs[k].values()) == pytest.approx(ref.max().item(), abs=1e-5)
        tops.append(ref.topk(2).values.tolist())
        seq.append(int(ref.argmax()))
    # chat's shape, the same values (the same prompt ids, greedy)
    c = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert [x.logprob for x in content] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [x.token for x in content] == lp.tokens
    assert [[t.logprob for t in x.top_logprobs] for x in content] == [pytest.approx(t, abs=1e-5)
                                                                       for t in tops]
    assert content[0].bytes == list(content[0].token.encode())
    # streamed: the chunks carry the same entries, in order
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [x.logprob for ch in chunks for choice in ch.choices if choice.logprobs
                for x in choice.logprobs.content]
    assert streamed == pytest.approx([x.logprob for x in content], abs=1e-6)
    plain = client.chat.completions.create(model=name, messages=messages, max_tokens=3, logprobs=True)
    assert all(x.top_logprobs == [] for x in plain.choices[0].logprobs.content)


def test_n_choices_whole_and_streamed(server):
    client, app = server
    name = app.state.api.served.name
    r = client.completions.create(model=name, prompt=PROMPT, n=4, max_tokens=8, seed=7, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 32 and r.usage.prompt_tokens > 0  # no eos in a random GPT-2's 8
    # choice i is the sample a single request seeded 7 + i draws
    for i in (0, 2):
        one = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, seed=7 + i, temperature=1.0)
        assert one.choices[0].text == r.choices[i].text
    assert len({c.text for c in r.choices}) > 1
    stream = client.completions.create(model=name, prompt=PROMPT, n=4, max_tokens=8, seed=7, temperature=1.0,
                                       stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = ["" for _ in range(4)], {}, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == [c.text for c in r.choices] and reasons == {i: "length" for i in range(4)}
    assert usage.completion_tokens == 32
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], n=3,
                                          max_tokens=5, seed=1)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    # streamed chat: each choice opens with its role and carries its own text and log-probabilities
    roles, texts, lps = set(), ["", "", ""], [[], [], []]
    for ch in client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], n=3,
                                             max_tokens=5, seed=1, stream=True, logprobs=True):
        for c in ch.choices:
            roles |= {c.index} if c.delta.role == "assistant" else set()
            texts[c.index] += c.delta.content or ""
            lps[c.index] += [x.token for x in c.logprobs.content] if c.logprobs else []
    assert roles == {0, 1, 2} and texts == [c.message.content for c in chat.choices]
    assert sum(map(len, lps)) == chat.usage.completion_tokens  # one entry per token of each choice
    assert app.state.api.engine.stats()["cow_copies"] > 0


def test_penalties_and_logit_bias_follow_their_definitions(server, hf, gpt2_folder):
    client, app = server
    name = app.state.api.served.name
    codec = load_served(gpt2_folder).codec
    ids = codec.encode(PROMPT)
    V = hf.config.vocab_size
    for presence, frequency, bias in ((0.0, 2.0, {}), (1.5, 0.5, {}), (0.0, 0.0, {7: 8.0, 8: -100.0})):
        seq = list(ids)
        for _ in range(8):  # greedy with OpenAI's definitions applied to transformers' logits
            with torch.no_grad():
                mu = hf(torch.tensor([seq])).logits[0, -1].double()
            for tok, c in Counter(seq[len(ids):]).items():
                mu[tok] -= c * frequency + presence
            for t, b in bias.items():
                mu[t] += b
            seq.append(int(mu.argmax()))
        r = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0, logprobs=0,
                                      presence_penalty=presence, frequency_penalty=frequency,
                                      logit_bias={str(k): v for k, v in bias.items()})
        assert r.choices[0].logprobs.tokens == [codec.token_text(t) for t in seq[len(ids):]]
    assert V > 8


@pytest.mark.parametrize("kind,body,param", [
    ("completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"n": 9}, "n"),  # over this server's max_batch_size of 8
    ("completions", {"n": 1000}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"echo": True}, "echo"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),  # completions' alternatives: logprobs=N
])
def test_bad_values_are_400s_naming_the_field(server, kind, body, param):
    client, app = server
    name = app.state.api.served.name
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body=body)
        else:
            client.completions.create(model=name, prompt="ab", max_tokens=body.pop("max_tokens", 2),
                                      extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    ok = client.completions.create(model=name, prompt="ab", max_tokens=2)  # the server is unharmed
    assert ok.choices[0].finish_reason in ("length", "stop") and app.state.api.worker.alive
