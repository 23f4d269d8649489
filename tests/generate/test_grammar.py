"""Structured generation (GenerationConfig.grammar, processors.GrammarMask): random-weight models, whose
outputs are valid only because the mask makes them so, checked by the `jsonschema` package; generate(),
stream() and the paged Engine; bad grammars refused."""

from __future__ import annotations

import json
import pydoc_data.topics

import jsonschema
import pytest
import torch

from qkv.config import ConfigError
from qkv.generate import Engine, GenerationConfig, generate, stream
from qkv.generate.grammar import GrammarError, check_grammar, json_schema_grammar, lark_json, token_table

EOS = 4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """(model, tokenizer): a random GPT-2 (transformers weights) under a byte-level BPE trained here."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    import qkv
    from qkv.interop.tokenizer import load_hf_tokenizer

    path = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(pydoc_data.topics.topics.values())[:40], vocab_size=400, min_frequency=2,
                            special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>",
                                            "<|end|>"])
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    torch.manual_seed(0)
    # 403 output columns for a 400-token vocabulary: the padding columns must never be chosen
    cfg = transformers.GPT2Config(vocab_size=403, n_positions=256, n_embd=32, n_layer=2, n_head=2,
                                  eos_token_id=EOS, initializer_range=0.5)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    return qkv.from_pretrained(path).eval(), load_hf_tokenizer(path)


def _text(tok, ids):
    return tok.decode([t for t in ids if t != EOS], skip_special_tokens=True)


@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_follows_the_schema(lm, do_sample):
    model, tok = lm
    prompt = torch.tensor([tok.encode("The answer:")[:3], tok.encode("Return JSON")[:3]])
    cfg = GenerationConfig(max_new_tokens=120, grammar=json_schema_grammar(SCHEMA), do_sample=do_sample,
                           seed=3, eos_token_id=EOS, pad_token_id=EOS)
    out = generate(model, prompt, cfg, tokenizer=tok)
    for row in out[:, prompt.shape[1]:].tolist():
        assert EOS in row  # the grammar ended, and the sequence with it
        jsonschema.validate(json.loads(_text(tok, row)), SCHEMA)


def test_unconstrained_random_model_is_not_json(lm):
    """The control: without the mask, the same model's greedy output is no JSON at all."""
    model, tok = lm
    prompt = torch.tensor([tok.encode("The answer:")])
    out = generate(model, prompt, GenerationConfig(max_new_tokens=30, eos_token_id=EOS), tokenizer=tok)
    with pytest.raises(ValueError):
        json.loads(_text(tok, out[0, prompt.shape[1]:].tolist()))


def test_stream_and_engine_match_generate(lm):
    """Greedy under the mask: generate(), stream() and the paged Engine (prefill chunks of 3) agree."""
    model, tok = lm
    prompt = tok.encode("Return JSON now")
    cfg = GenerationConfig(max_new_tokens=80, grammar=json_schema_grammar(SCHEMA), eos_token_id=EOS)
    ref = generate(model, torch.tensor([prompt]), cfg, tokenizer=tok)[0, len(prompt):].tolist()
    streamed = [int(t[0]) for t in stream(model, torch.tensor([prompt]), cfg, tokenizer=tok)]
    engine = Engine(model, tokenizer=tok, block_size=4, num_blocks=64, prefill_chunk=3, eos_token_id=EOS)
    rid = engine.add_request(prompt, cfg)
    other = engine.add_request(prompt[:2], max_new_tokens=20)  # unconstrained, in the same batches
    out = engine.run()
    assert ref[:ref.index(EOS) + 1] == streamed[:len(out[rid])] == out[rid]
    assert out[other]
    jsonschema.validate(json.loads(_text(tok, out[rid])), SCHEMA)


def test_lark_grammar_with_inline_schema(lm):
    """A tool call's shape: fixed text around a JSON value, the Lark grammar the server builds."""
    model, tok = lm
    args = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
            "additionalProperties": False}
    grammar = f'start: "<tool_call>\\n" {lark_json(args)} "\\n</tool_call>"'
    out = generate(model, torch.tensor([tok.encode("Call:")]), max_new_tokens=60, grammar=grammar,
                   eos_token_id=EOS, do_sample=True, seed=0, tokenizer=tok)
    text = _text(tok, out[0, 2:].tolist())
    text = text[text.index("<tool_call>"):]
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    jsonschema.validate(json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")]), args)


def test_bad_grammars_are_refused(lm):
    model, tok = lm
    table = token_table(tok, 403, [EOS])
    with pytest.raises(GrammarError, match="foo"):
        check_grammar(json_schema_grammar({"type": "object", "properties": {"a": {"type": "foo"}}}), table)
    with pytest.raises(GrammarError):
        check_grammar("start: (", table)
    with pytest.raises(GrammarError):
        json_schema_grammar(["not", "a", "schema"])
    with pytest.raises(ConfigError, match="beam"):
        GenerationConfig(grammar="start: \"a\"", num_beams=2)
    with pytest.raises(GrammarError, match="tokenizer.json"):
        generate(model, torch.tensor([[5, 6]]), max_new_tokens=3, grammar='start: "a"', eos_token_id=EOS,
                 tokenizer=lambda ids: "")


def test_engine_preemption_keeps_the_grammar_state(lm):
    """A pool too small for all requests at once: preempted requests are recomputed from their tokens, the
    grammar's state stays with the request, and the answers are those of a pool with room for all."""
    model, tok = lm
    cfg = GenerationConfig(max_new_tokens=80, grammar=json_schema_grammar(SCHEMA), eos_token_id=EOS,
                           do_sample=True)
    prompts = [tok.encode(f"Record {i}:") for i in range(4)]

    def run(num_blocks):
        engine = Engine(model, tokenizer=tok, block_size=4, num_blocks=num_blocks, eos_token_id=EOS)
        rids = [engine.add_request(p, cfg.replace(seed=i)) for i, p in enumerate(prompts)]
        out = engine.run()
        return [out[r] for r in rids], engine.counters.preemptions

    roomy, none = run(256)
    tight, preempted = run(34)
    assert none == 0 and preempted > 0
    assert tight == roomy
    for out in tight:
        jsonschema.validate(json.loads(_text(tok, out)), SCHEMA)
