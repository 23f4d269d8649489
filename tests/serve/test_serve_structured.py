"""Structured outputs and tool calls through `qkv serve`, driven by the official `openai` client on a loopback
port: a random-weight model, whose answers are valid JSON / valid calls only because the grammar's mask
makes them so (checked with the `jsonschema` package), the client's parse() and tool loop, and the 400s of
schemas the grammar engine cannot compile."""

from __future__ import annotations

import json
import pydoc_data.topics
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from _servehelpers import running_server
from pydantic import BaseModel, Field

from qkv.serve.tools import TOOL_FORMATS, parse_hermes, parse_llama3_json, tool_format

# a Hermes / Qwen-style template: tools listed in a system turn, calls between <tool_call> tags, tool results
# in <tool_response>
TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined %}<|assistant|>"
    "{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|end|>"
    "{%- elif m.role == 'tool' %}<|user|><tool_response>\n{{ m.content }}\n</tool_response><|end|>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                   "maxLength": 5}},
                                       "required": ["zone"], "additionalProperties": False}}}


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)
    note: str = Field(max_length=6)
    rain: bool


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Hugging Face GPT-2 folder with random weights and a chat template that renders tools."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    path = tmp_path_factory.mktemp("gpt2tools")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(pydoc_data.topics.topics.values())[:40], vocab_size=400, min_frequency=2,
                            special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>",
                                            "<|end|>"])
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>",
                                                            "chat_template": TOOLS_TEMPLATE}))
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=400, n_positions=1024, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=4, initializer_range=0.5)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(folder):
    with running_server(folder, block_size=16, num_blocks=256) as (url, _app):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), folder.name


def test_parse_with_a_pydantic_model(server):
    client, name = server
    for seed in range(3):
        out = client.chat.completions.parse(model=name, messages=[{"role": "user", "content": "forecast?"}],
                                            response_format=Forecast, seed=seed, max_tokens=200)
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Forecast)
        jsonschema.validate(json.loads(msg.content), Forecast.model_json_schema())


def test_json_object_and_schema_on_both_endpoints(server):
    client, name = server
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                          response_format=fmt, max_tokens=100, seed=1)
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    text = client.completions.create(model=name, prompt="Q: ", max_tokens=100, seed=2,
                                     extra_body={"response_format": fmt}).choices[0].text
    jsonschema.validate(json.loads(text), schema)
    pieces = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                            response_format=fmt, max_tokens=100, seed=3, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    jsonschema.validate(json.loads(streamed), schema)
    # greedy: the same grammar, greedy through the mask
    obj = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                         response_format={"type": "json_object"}, max_tokens=300,
                                         temperature=0)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object, never anything else
        assert obj.choices[0].message.content.startswith("{")


def test_named_function_then_the_tool_result_back(server):
    """The client's tool loop: a forced call of get_weather, valid by its schema; the call and its result
    sent back as the assistant's and the tool's messages."""
    client, name = server
    messages = [{"role": "user", "content": "weather in Paris?"}]
    out = client.chat.completions.create(
        model=name, messages=messages, tools=[WEATHER, TIME], seed=0, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})}]
    back = client.chat.completions.create(model=name, messages=messages, tools=[WEATHER, TIME],
                                          max_tokens=5, seed=0)
    assert back.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert back.usage.prompt_tokens > out.usage.prompt_tokens  # the call and its result were rendered


class GetWeather(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


def test_parse_with_a_pydantic_function_tool(server):
    """The client's strict function tools: parse() reads the forced call's arguments into the model."""
    client, name = server
    out = client.chat.completions.parse(
        model=name, messages=[{"role": "user", "content": "weather?"}], seed=1, max_tokens=100,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    (call,) = out.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_required_calls_one_of_the_tools(server):
    client, name = server
    for seed in range(3):
        out = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "now"}], tools=[WEATHER, TIME], seed=seed,
            tool_choice="required", parallel_tool_calls=False, max_tokens=100)
        (call,) = out.choices[0].message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    stream = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "now"}], tools=[WEATHER], seed=0,
        tool_choice="required", max_tokens=200, stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and all(tc.function.name == "get_weather" for tc in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # no call's text as content


def test_auto_and_none_answer(server):
    """auto: a random model writes text (no call), answered as content; none: the tools are not shown."""
    client, name = server
    auto = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                          tools=[WEATHER], max_tokens=8, seed=0)
    none = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                          tools=[WEATHER], tool_choice="none", max_tokens=8, seed=0)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(unclosed"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {
        "properties": {"x": {"minimum": "low"}}}}}]}, "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_schemas_and_tools_are_400s(server, body, param):
    client, name = server
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    ok = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")  # the server is unharmed


def test_tools_need_a_template_that_renders_them(gpt2_folder):
    with running_server(gpt2_folder) as (url, _app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=gpt2_folder.name, tools=[WEATHER], max_tokens=2,
                                           messages=[{"role": "user", "content": "x"}])
        assert e.value.body["param"] == "tools"
        with pytest.raises(openai.BadRequestError) as e:  # completions take no tools
            client.completions.create(model=gpt2_folder.name, prompt="x", max_tokens=2,
                                      extra_body={"tools": [WEATHER]})
        assert e.value.body["param"] == "tools"


def test_parsers_by_family():
    assert tool_format(TOOLS_TEMPLATE).name == "hermes"
    assert tool_format("{{ '<|python_tag|>' }}{% if tools %}{% endif %}").name == "llama3_json"
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "g", "arguments": {}}\n</tool_call>'
    assert parse_hermes(text) == ("Sure.", [{"name": "f", "arguments": {"x": 1}},
                                            {"name": "g", "arguments": {}}])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_hermes(broken) == (broken, [])
    assert parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {"s": "a;b"}}; {"name": "g", '
                             '"parameters": {}}') == (None, [{"name": "f", "arguments": {"s": "a;b"}},
                                                             {"name": "g", "arguments": {}}])
    assert parse_llama3_json("The answer is {1}") == ("The answer is {1}", [])
    assert parse_llama3_json('{"x": 1}') == ('{"x": 1}', [])


def test_llama3_call_grammar_parses_back(server, folder):
    """The Llama 3.x family's grammar, through the engine: what it forces is what its parser reads."""
    from qkv.serve import build_engine, load_served

    served = load_served(folder)
    engine = build_engine(served, block_size=16, num_blocks=64)
    fmt = TOOL_FORMATS["llama3_json"]
    grammar = fmt.grammar([WEATHER["function"], TIME["function"]], many=False)
    rids = [engine.add_request(served.codec.encode("call:"), max_new_tokens=100, grammar=grammar,
                               do_sample=True, seed=s) for s in range(3)]
    outs = engine.run()
    for rid in rids:
        content, (c,) = fmt.parse(served.codec.decode(outs[rid]))
        assert content is None
        tool = {"get_weather": WEATHER, "get_time": TIME}[c["name"]]
        jsonschema.validate(c["arguments"], tool["function"]["parameters"])


# a Llama 3.x-style template: tools in the user turn, a call written as {"name", "parameters"} (after
# <|python_tag|> for its built-in tools), results back in "ipython" turns
LLAMA_TEMPLATE = (
    "{%- if tools %}<|system|>Respond with {\"name\": function name, \"parameters\": arguments}.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined %}<|assistant|>"
    "{% for c in m.tool_calls %}{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% endfor %}<|end|>"
    "{%- elif m.role == 'tool' %}<|user|>ipython: {{ m.content }}<|end|>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}{# <|python_tag|> #}")


def test_llama3_family_round_trip(folder, tmp_path):
    """A Llama 3-style template: its calls are read as {"name", "parameters"} objects, forced the same way."""
    import shutil

    llama = tmp_path / "llama3ish"
    shutil.copytree(folder, llama)
    (llama / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>",
                                                             "chat_template": LLAMA_TEMPLATE}))
    with running_server(llama, block_size=16, num_blocks=128) as (url, app):
        assert app.state.api.tool_format.name == "llama3_json"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "time in Lima?"}]
        out = client.chat.completions.create(model=llama.name, messages=messages, tools=[WEATHER, TIME],
                                             tool_choice="required", parallel_tool_calls=False, seed=2,
                                             max_tokens=100)
        (call,) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        messages += [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
        back = client.chat.completions.create(model=llama.name, messages=messages, tools=[WEATHER, TIME],
                                              max_tokens=3, seed=0)
        assert back.usage.prompt_tokens > out.usage.prompt_tokens


# -- with the other OpenAI fields: n choices, log-probabilities ----------------------------------------------
SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "tag": {"enum": ["a", "bc", "def"]}},
         "required": ["n", "tag"], "additionalProperties": False}


def test_n_choices_each_follow_the_grammar_with_raw_logprobs(folder):
    """n=2 under one grammar: each choice has a matcher of its own, so each is valid and equals the single
    request it stands for (seed s + i, the same grammar); the log-probabilities are transformers'
    log-softmax of the raw logits, not of the masked ones."""
    import transformers

    from qkv.generate.grammar import json_schema_grammar
    from qkv.serve import build_engine, load_served

    served = load_served(folder)
    engine = build_engine(served, block_size=16, num_blocks=64)
    grammar = json_schema_grammar(SMALL)
    ids = served.codec.encode("Q: ")
    rid = engine.add_request(ids, max_new_tokens=60, grammar=grammar, do_sample=True, seed=7, n=2, logprobs=3)
    singles = [engine.add_request(ids, max_new_tokens=60, grammar=grammar, do_sample=True, seed=7 + i)
               for i in range(2)]
    outs = engine.run()
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    for i in range(2):
        out = outs[rid + i]
        assert out == outs[singles[i]]
        jsonschema.validate(json.loads(served.codec.decode(out)), SMALL)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids + out])).logits[0].double(), -1)
        entries = engine.token_logprobs(rid + i)
        assert len(entries) == len(out)
        # the mask leaves a handful of tokens where the JSON's structure is written (the first "{" alone):
        # log-softmax over the masked logits would give those near 0, the raw logits' far below
        for k, (tok, e) in enumerate(zip(out, entries)):
            row = ref[len(ids) - 1 + k]
            assert e.logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert [t for t, _ in e.top] == row.topk(3).indices.tolist()
        assert entries[0].logprob < -1


def test_n_choices_with_a_response_format_and_logprobs_through_the_server(server):
    client, name = server
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL, "strict": True}}
    out = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], n=2,
                                         response_format=fmt, max_tokens=60, seed=11, logprobs=True,
                                         top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SMALL)
        assert "".join(t.token for t in c.logprobs.content).startswith(c.message.content)
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], n=2,
                                            response_format=fmt, max_tokens=60, seed=11, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in out.choices}  # the same seeds, the same answers


def test_n_forced_tool_calls_streamed(server):
    """tool_choice "required" with n=2, streamed: each choice's call arrives whole in its own delta (its
    index), valid by its tool's schema, and no call's text as content."""
    client, name = server
    stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "now"}], n=2,
                                            tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False, seed=4, max_tokens=100, stream=True)
    calls, reasons, content = {0: [], 1: []}, {}, ""
    for chunk in stream:
        for c in chunk.choices:
            calls[c.index] += c.delta.tool_calls or []
            content += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"} and not content
    for index in (0, 1):
        (call,) = calls[index]
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
