"""qkv chat (src/qkv/chat.py and the CLI): prompts rendered by the folder's chat template exactly as
transformers renders them, stopping at the end-of-turn token, history / reset / context trimming, Ctrl-C
stopping only the answer, the plain-transcript fallback, and the interactive loop on a scripted input."""

from __future__ import annotations

import io
import pydoc_data.topics

import pytest
import torch

from qkv.chat import ChatSession, chat_loop, end_of_turn_ids
from qkv.cli.main import main
from qkv.generate import GenerationConfig

transformers = pytest.importorskip("transformers")

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IM_END = 2


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:30], trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def make_folder(bpe, path, template=CHATML, context=512, eos_token="<|endoftext|>"):
    """A random Qwen2 (tied, GQA) with a ChatML tokenizer; its generation_config says eos = <|endoftext|>
    only, so stopping at <|im_end|> must come from the template."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                                eos_token=eos_token, pad_token="<|endoftext|>")
    if template:
        fast.chat_template = template
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=context,
                                      initializer_range=0.3, bos_token_id=0, eos_token_id=0,
                                      tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(bpe, tmp_path_factory):
    return make_folder(bpe, tmp_path_factory.mktemp("chat"))


def greedy(n=8):
    return GenerationConfig(do_sample=False, max_new_tokens=n)


def test_end_of_turn_comes_from_the_template(folder):
    s = ChatSession.from_folder(folder, generation_config=greedy())
    assert IM_END in end_of_turn_ids(s.tokenizer) and 0 in s.stop_ids


def test_prompt_is_the_template_rendering_and_history_grows(folder):
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    s = ChatSession.from_folder(folder, system="Be brief.", generation_config=greedy())
    a1 = s.reply("What is a generator?")
    s.reply("And a coroutine?")
    assert [m["role"] for m in s.history] == ["user", "assistant", "user", "assistant"]
    assert s.history[1]["content"] == a1
    msgs = [{"role": "system", "content": "Be brief."}] + s.history
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert s.prompt_ids(8) == list(want)
    s.reset()
    assert s.history == []


def test_reply_stops_at_the_end_of_turn_token(bpe, tmp_path):
    path = make_folder(bpe, tmp_path)
    s = ChatSession.from_folder(path, generation_config=greedy(20))
    with torch.no_grad():  # make <|im_end|> the model's every next token
        s.model.tok_emb.weight[IM_END] = s.model.decoder.final_norm.weight.sign() * 5
    steps = []
    step = s.model.step
    s.model.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]  # decoding steps after the prefill
    assert s.reply("hello") == "" and steps == []  # <|im_end|> came first: no second token
    s.stop_ids.discard(IM_END)  # the control: without the template's end of turn, 20 tokens are generated
    assert s.reply("hello") == "" and len(steps) == 19


def test_ctrl_c_stops_the_answer_not_the_session(folder):
    s = ChatSession.from_folder(folder, generation_config=greedy(40), note=lambda m: None)
    pieces = []

    def on_text(piece):
        pieces.append(piece)
        if len(pieces) == 3:
            raise KeyboardInterrupt

    partial = s.reply("tell me a story", on_text=on_text)
    assert s.history[-1] == {"role": "assistant", "content": partial}
    full = ChatSession.from_folder(folder, generation_config=greedy(40)).reply("tell me a story")
    assert full.startswith(partial) and len(partial) < len(full)
    assert s.reply("again")  # the session goes on


def test_context_trimming_keeps_the_system_prompt(bpe, tmp_path):
    path = make_folder(bpe, tmp_path, context=96)
    notes = []
    s = ChatSession.from_folder(path, system="sys", generation_config=greedy(16), note=notes.append)
    for i in range(4):
        s.reply(f"message number {i} with some words in it")
    assert any("dropped" in n for n in notes)
    assert s.history[0]["role"] == "user" and "number 0" not in s.history[0]["content"]
    assert len(s.prompt_ids(16)) + 16 <= 96
    before = list(s.history)
    with pytest.raises(ValueError, match="does not fit the model's context of 96"):
        s.reply("word " * 200)
    assert s.history == before


def test_folder_without_template_uses_a_plain_transcript(bpe, tmp_path):
    path = make_folder(bpe, tmp_path, template=None)
    notes = []
    s = ChatSession.from_folder(path, system="Be brief.", generation_config=greedy(12), note=notes.append)
    assert notes and "no chat template" in notes[0]
    answer = s.reply("hi")
    assert "User:" not in answer
    text = s.tokenizer.decode(s.prompt_ids(12))
    assert text == f"Be brief.\n\nUser: hi\nAssistant: {answer}<|endoftext|>\nAssistant:"


def test_plain_prompt_is_a_prefix_of_what_finetuning_trains_on(bpe, tmp_path):
    """Without a template, the prompt qkv chat builds for a later turn is the start of the text qkv finetune
    trains on for the same conversation: the eos after earlier answers, and the bos tokenizer_config.json asks
    for."""
    import json

    from qkv.finetune.chat import IGNORE, encode_chat

    path = make_folder(bpe, tmp_path, template=None)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    s = ChatSession.from_folder(path, system="Be brief.", generation_config=greedy(4), note=lambda m: None)
    s.history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there."},
                 {"role": "user", "content": "Sure?"}]
    prompt = s.prompt_ids(4)
    ids, labels = encode_chat(s.tokenizer, [{"role": "system", "content": "Be brief."}, *s.history,
                                            {"role": "assistant", "content": "Yes."}])
    assert prompt[0] == s.tokenizer.bos_token_id and ids[:len(prompt)] == prompt
    learned = s.tokenizer.decode([t for t in labels if t != IGNORE])
    assert learned == " Hello there.<|endoftext|> Yes.<|endoftext|>"


def test_interactive_loop_on_scripted_input(folder):
    s = ChatSession.from_folder(folder, generation_config=greedy(6))
    out = io.StringIO()
    n = chat_loop(s, ["hello\n", "/reset\n", "\n", "/what\n", "second\n", "/exit\n", "never read\n"], out)
    text = out.getvalue()
    assert n == 2 and "(conversation cleared)" in text and "unknown command /what" in text
    assert [m["content"] for m in s.history if m["role"] == "user"] == ["second"]  # /reset forgot "hello"
    assert "never read" not in text
    s.reset()
    assert chat_loop(s, ["one\n"], io.StringIO()) == 1  # end of input leaves too


def test_cli_chat_message_and_errors(folder, tmp_path, capsys):
    assert main(["chat", str(folder), "--message", "hi", "--message", "more", "--greedy", "--max-new-tokens",
                 "5"]) == 0
    out = capsys.readouterr().out
    s = ChatSession.from_folder(folder, generation_config=greedy(5))
    assert out == s.reply("hi") + "\n" + s.reply("more") + "\n"
    assert main(["chat", str(tmp_path), "--message", "hi"]) == 2
    assert "qkv: error:" in capsys.readouterr().err
    assert main(["chat", str(folder), "--message", "hi", "--top-p", "2"]) == 2


def test_default_answer_length_is_capped_by_a_small_context(bpe, tmp_path):
    """No --max-new-tokens on a 64-position model: the 512-token default never fits; the answer gets the room
    the context leaves instead of an error, so the prompt plus the answer fill the context exactly."""
    path = make_folder(bpe, tmp_path, context=64)
    s = ChatSession.from_folder(path, generation_config=GenerationConfig(do_sample=False),
                                note=lambda m: None)
    s.stop_ids.clear()  # no end of turn: every answer runs to its length limit
    steps = []
    step = s.model.step
    # the first token comes from the prefill
    s.model.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
    for message in ("hello", "word " * 10):  # a short prompt, and one longer than half the context
        s.reset()
        steps.clear()
        prompt = s._render([{"role": "user", "content": message}])
        s.reply(message)
        assert len(steps) + 1 == 64 - len(prompt)
    assert len(prompt) > 32  # the second prompt was longer than the room kept for answers when trimming
    s.reset()
    # nothing fits: the clear error
    with pytest.raises(ValueError, match="does not fit the model's context of 64"):
        s.reply("word " * 200)
    assert s.history == []


def test_chat_help_says_what_decides_greedy_and_lists_no_training_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "greedy when it says nothing" in text and "a new one each run, printed on stderr" in text
    assert "NaN guard" not in text and "--resume" not in text
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "NaN guard" in " ".join(capsys.readouterr().out.split())


def test_unseeded_sampling_draws_a_seed_and_says_it(folder, capsys):
    """Without --seed a sampling chat differs between runs (it always used seed 0) and prints the seed it
    drew; --seed with that number repeats the answer. A greedy chat says nothing about seeds."""
    import re

    args = ["chat", str(folder), "--message", "hello there", "--temperature", "1.5", "--max-new-tokens", "12"]
    seeds, answers = [], []
    for _ in range(2):
        assert main(args) == 0
        captured = capsys.readouterr()
        seeds.append(int(re.search(r"qkv: sampling with seed (\d+) \(--seed \1 repeats it\)",
                                   captured.err).group(1)))
        answers.append(captured.out)
    assert seeds[0] != seeds[1]
    assert main([*args, "--seed", str(seeds[0])]) == 0
    captured = capsys.readouterr()
    assert captured.out == answers[0] and "seed" not in captured.err
    assert main(["chat", str(folder), "--message", "hi", "--max-new-tokens", "4"]) == 0  # the folder: greedy
    assert "seed" not in capsys.readouterr().err


def test_interactive_chat_has_line_editing(folder, monkeypatch):
    """The interactive loop reads with input() after importing readline (arrow keys, history), where it
    exists."""
    import builtins
    import sys

    s = ChatSession.from_folder(folder, generation_config=greedy(2))
    monkeypatch.delitem(sys.modules, "readline", raising=False)
    monkeypatch.setattr(builtins, "input", lambda: (_ for _ in ()).throw(EOFError))
    assert chat_loop(s, out=io.StringIO()) == 0
    assert "readline" in sys.modules
