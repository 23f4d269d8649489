"""qkv.interop.tokenizer against transformers' own tokenizer on the same locally built folder: the encoding,
the special tokens, the chat template's rendering (string equality) and the assistant-token mask."""

from __future__ import annotations

import json
import pydoc_data.topics

import pytest

from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.storage import CheckpointError

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]

# Qwen2's template (ChatML with a default system prompt), in the multi-line `{%-` style of real folders
CHATML = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# the same conversation format with the assistant's part in {% generation %} blocks, written without `-`
# so that trim_blocks / lstrip_blocks decide the whitespace
CHATML_GENERATION = """{% for message in messages %}
    {{ '<|im_start|>' + message['role'] + '\\n' }}
    {% if message['role'] == 'assistant' %}
        {% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}
    {% else %}
        {{ message['content'] + '<|im_end|>' }}
    {% endif %}
    {{ '\\n' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|im_start|>assistant\\n' }}
{% endif %}
"""
CHATML_PLAIN = CHATML_GENERATION.replace("{% generation %}",
                                         "{% if true %}").replace("{% endgeneration %}", "{% endif %}")

# Llama-2's template: bos_token / eos_token variables, .strip(), raise_exception on non-alternating roles
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% "
          "endif %}{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' "
          "%}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What does the with statement do?"},
    {"role": "assistant", "content": "It wraps a block in a context manager's enter and exit."},
    {"role": "user", "content": "And  é 日本 <tricky> & \"quotes\"?"},
    {"role": "assistant", "content": "  Text with surrounding spaces.  "},
]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE of 400 tokens trained on pydoc's topics text, with chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:40], trainer)
    return tok


def save_folder(bpe, path, template, *, bos="<|endoftext|>", eos="<|im_end|>", post_bos=False):
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(bpe.to_str())
    if post_bos:  # a Llama-style post-processor that adds bos
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                                pad_token="<|endoftext|>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION, LLAMA2],
                         ids=["chatml", "generation", "llama2"])
@pytest.mark.parametrize("gen_prompt", [False, True])
def test_chat_template_renders_like_transformers(bpe, tmp_path, template, gen_prompt):
    bos, eos = ("<s>", "</s>") if template is LLAMA2 else ("<|endoftext|>", "<|im_end|>")
    ref = save_folder(bpe, tmp_path, template, bos=bos, eos=eos)
    tok = load_hf_tokenizer(tmp_path)
    assert tok.has_chat_template
    msgs = CONVERSATION if not gen_prompt else CONVERSATION[:4]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
    got = tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt)
    assert got == want
    assert ("You answer in one short sentence." in got) and got.count("<|im_start|>") != 1
    want_ids = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen_prompt,
                                       return_dict=False)
    assert tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt, tokenize=True) == list(want_ids)


def test_template_in_tokenizer_config_field(bpe, tmp_path):
    ref = save_folder(bpe, tmp_path, CHATML)
    (tmp_path / "chat_template.jinja").unlink()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_hf_tokenizer(tmp_path).apply_chat_template(CONVERSATION) == ref.apply_chat_template(
        CONVERSATION, tokenize=False)


def test_assistant_mask_from_generation_blocks_equals_transformers(bpe, tmp_path):
    ref = save_folder(bpe, tmp_path, CHATML_GENERATION)
    out = ref.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids, mask = load_hf_tokenizer(tmp_path).apply_chat_template(CONVERSATION, return_assistant_mask=True)
    assert ids == list(out["input_ids"])
    assert mask == list(out["assistant_masks"])
    assert 0 < sum(mask) < len(mask)


def test_assistant_mask_without_generation_blocks_locates_the_content(bpe, tmp_path):
    """A template without generation blocks: the located spans (content + the eos that follows) give the same
    mask transformers computes for the same format written with generation blocks around content + eos."""
    ref = save_folder(bpe, tmp_path / "ref", CHATML_GENERATION)
    out = ref.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    save_folder(bpe, tmp_path / "plain", CHATML_PLAIN)
    tok = load_hf_tokenizer(tmp_path / "plain")
    ids, mask = tok.apply_chat_template(CONVERSATION, return_assistant_mask=True)
    assert ids == list(out["input_ids"])
    assert mask == list(out["assistant_masks"])
    # decoded, the masked tokens are exactly the two answers and their end-of-turn tokens
    said = tok.decode([i for i, m in zip(ids, mask) if m])
    assert said == CONVERSATION[2]["content"] + "<|im_end|>" + CONVERSATION[4]["content"] + "<|im_end|>"


# answers that also occur inside the template's own text ("a" in "assistant", "end" in <|im_end|>)
SHORT_ANSWERS = [
    {"role": "system", "content": "Answer with one letter."},
    {"role": "user", "content": "First?"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "Then?"},
    {"role": "assistant", "content": "d"},
    {"role": "user", "content": "And?"},
    {"role": "assistant", "content": "end"},
]


@pytest.mark.parametrize("conversation", [CONVERSATION, SHORT_ANSWERS], ids=["sentences", "short"])
@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"])
def test_assistant_mask_without_generation_blocks_like_transformers(bpe, tmp_path, conversation, eos):
    """The located spans equal transformers' mask of the same format written with generation blocks: also when
    an answer occurs inside the template's own text before it (searched from where the generation prompt of
    the messages before it ends), and when the end-of-turn token (<|im_end|>) is not the folder's eos (a base
    model's <|endoftext|>): the token the template writes after an answer is learned, so a fine-tuned model
    stops."""
    ref = save_folder(bpe, tmp_path / "ref", CHATML_GENERATION, eos=eos)
    out = ref.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    save_folder(bpe, tmp_path / "plain", CHATML_PLAIN, eos=eos)
    tok = load_hf_tokenizer(tmp_path / "plain")
    ids, mask = tok.apply_chat_template(conversation, return_assistant_mask=True)
    assert ids == list(out["input_ids"])
    assert mask == list(out["assistant_masks"])
    assert tok.end_of_turn_ids >= {tok.token_to_id("<|im_end|>"), tok.token_to_id(eos)}


SYSTEM_FIRST = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('start with a system message') "
                "}}{% endif %}")


def test_end_of_turn_found_when_the_template_wants_a_system_message(bpe, tmp_path):
    """A template that refuses a conversation without a system message first refused the end-of-turn probe too
    (user + assistant), so <|im_end|>, not the folder's eos, was left out of the assistant mask: a model tuned
    on it never learns to stop. The probe is retried with a system message; the mask equals transformers' mask
    of the same format written with generation blocks."""
    eos = "<|endoftext|>"
    ref = save_folder(bpe, tmp_path / "ref", CHATML_GENERATION, eos=eos)
    out = ref.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    save_folder(bpe, tmp_path / "plain", SYSTEM_FIRST + CHATML_PLAIN, eos=eos)
    tok = load_hf_tokenizer(tmp_path / "plain")
    assert tok.token_to_id("<|im_end|>") in tok.end_of_turn_ids
    ids, mask = tok.apply_chat_template(CONVERSATION, return_assistant_mask=True)
    assert ids == list(out["input_ids"]) and mask == list(out["assistant_masks"])


def test_end_of_turn_after_a_newline(bpe, tmp_path):
    """A template that writes a newline between the answer and its end-of-turn token: found all the same."""
    template = CHATML_PLAIN.replace("message['content'] + '<|im_end|>'",
                                    "message['content'] + '\\n<|im_end|>'")
    assert template != CHATML_PLAIN
    save_folder(bpe, tmp_path, template, eos="<|endoftext|>")
    tok = load_hf_tokenizer(tmp_path)
    assert tok.token_to_id("<|im_end|>") in tok.end_of_turn_ids
    ids, mask = tok.apply_chat_template(CONVERSATION, return_assistant_mask=True)
    said = tok.decode([i for i, m in zip(ids, mask) if m])
    assert said == CONVERSATION[2]["content"] + "\n<|im_end|>" + CONVERSATION[4]["content"] + "\n<|im_end|>"


def test_assistant_mask_llama2_strips_and_covers_eos(bpe, tmp_path):
    save_folder(bpe, tmp_path, LLAMA2, bos="<s>", eos="</s>")
    tok = load_hf_tokenizer(tmp_path)
    ids, mask = tok.apply_chat_template(CONVERSATION, return_assistant_mask=True)
    said = tok.decode([i for i, m in zip(ids, mask) if m])
    assert said.replace(" ", "") == ("It wraps a block in a context manager's enter and exit.</s>"
                                     "Text with surrounding spaces.</s>").replace(" ", "")


def test_raise_exception_and_sandbox(bpe, tmp_path):
    save_folder(bpe, tmp_path, LLAMA2, bos="<s>", eos="</s>")
    tok = load_hf_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    evil = "{{ messages.__class__.__mro__ }}"
    (tmp_path / "chat_template.jinja").write_text(evil)
    with pytest.raises(ValueError, match="chat template"):
        load_hf_tokenizer(tmp_path).apply_chat_template(CONVERSATION)


HOSTILE = {
    "include": ("{% include 'other.jinja' %}", "includes, imports or extends 'other.jinja'"),
    "repeat": ("{{ 'x' * 3000000000 }}", "repetition of 1 x 3000000000 is over the size limit"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                 "{% endfor %}", "concatenation over the size limit"),
    "filter": ("{{ 'x'|center(3000000000) }}", "argument of 3000000000 is over the size limit"),
    "method": ("{{ 'x'.ljust(3000000000) }}", "argument of 3000000000 is over the size limit"),
    "format": ("{{ '{:>3000000000}'.format('x') }}", "format width over the size limit"),
    "percent": ("{{ '%3000000000s' % 'x' }}", "format width over the size limit"),
    "loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
              "rendering took longer than 0.5 s"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_refused_in_one_line_naming_it(bpe, tmp_path, monkeypatch, name):
    """A template that would read other files, allocate gigabytes or loop for hours is refused (a TypeError
    traceback, a MemoryError, a hang), with the folder it came from in the message."""
    from qkv.interop import chat_sandbox

    monkeypatch.setattr(chat_sandbox, "MAX_SECONDS", 0.5)
    source, message = HOSTILE[name]
    save_folder(bpe, tmp_path, CHATML)
    (tmp_path / "chat_template.jinja").write_text(source)
    with pytest.raises(ValueError, match=f"chat template of {tmp_path}: .*{message}") as e:
        load_hf_tokenizer(tmp_path).apply_chat_template(CONVERSATION)
    assert "\n" not in str(e.value)


def test_the_limits_leave_ordinary_templates_alone(bpe, tmp_path):
    save_folder(bpe, tmp_path, CHATML)
    (tmp_path / "chat_template.jinja").write_text(
        "{{ '=' * 3 }}{{ 'a' ~ 1 }}{{ '%d' % 5 }}{{ '{}!'.format('b') }}{{ 'c'|center(3) }}{{ 2 ** 10 }}"
        "{% for m in messages %}{{ m.role + ':' }}{% endfor %}")
    text = load_hf_tokenizer(tmp_path).apply_chat_template(CONVERSATION)
    assert text == "===a15b! c 1024" + "".join(m["role"] + ":" for m in CONVERSATION)


def test_encode_decode_and_special_ids_like_transformers(bpe, tmp_path):
    ref = save_folder(bpe, tmp_path, None, bos="<s>", eos="</s>", post_bos=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4], "bos_token_id": 3}))
    tok = load_hf_tokenizer(tmp_path)
    assert not tok.has_chat_template
    text = "def f(x):\n    return x  # é 日本 <|im_end|>"
    for special in (True, False):
        assert tok.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == ref.bos_token_id == SPECIALS.index("<s>")
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.pad_token_id == ref.pad_token_id == 0
    assert tok.eos_token_ids == {ref.eos_token_id, 2, 4}
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CONVERSATION)


def test_stream_decoder_concatenates_to_decode(bpe, tmp_path):
    save_folder(bpe, tmp_path, None)
    tok = load_hf_tokenizer(tmp_path)
    text = "Unicode: é, 日本語, emoji 🙂 and <|im_end|> plain ascii"
    ids = tok.encode(text, add_special_tokens=False)
    stream = tok.stream_decoder(skip_special_tokens=False)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_missing_or_broken_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizers library"):
        load_hf_tokenizer(tmp_path)
