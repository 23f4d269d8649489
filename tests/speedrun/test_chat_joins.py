"""The joins between qkv's own pretraining and the chat tools, each on its own: a `qkv train` run folder with
a byte-level BPE goes through `qkv finetune --task chat` (full and LoRA) with qkv's chat template written into
OUT, and the result answers through `qkv chat` (streamed, stopping at the end of the turn), `qkv serve` (the
openai client), `qkv explore`, and `qkv export` (transformers: same template ids, equal logits, equal greedy
text)."""

from __future__ import annotations

import pytest
from _chatrun import (
    ANSWER,
    QUESTION,
    check_explore,
    check_export_parity,
    check_serve,
    pretrain_tiny,
    write_chats,
)

from qkv.cli.main import main
from qkv.finetune.chat import IGNORE, encode_chat
from qkv.finetune.chat_template import CHAT_TEMPLATE_FILE, QKV_CHAT_TEMPLATE
from qkv.interop.tokenizer import load_hf_tokenizer

TEXT = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(300))


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    return pretrain_tiny(root / "run", root / "text.txt")


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory, base_run):
    """The run fine-tuned (full) until it has learned its one answer: a model that must stop on its own."""
    root = tmp_path_factory.mktemp("chat")
    out = root / "chat"
    assert main(["finetune", str(base_run), "--task", "chat", "--data", str(write_chats(root / "c.jsonl")),
                 "--out", str(out), "--no-progress", "train.max_steps=60", "train.lr=1e-2",
                 "train.batch_size=8", "train.warmup=0", "train.plot=false", "train.tensorboard=false"]) == 0
    return out


def test_run_folder_fine_tunes_with_qkv_chat_template(chat_folder):
    """OUT carries the run's tokenizer as Hugging Face files and qkv's chat template; the loss covers the
    answer and its <eos> only."""
    assert (chat_folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8") == QKV_CHAT_TEMPLATE
    tok = load_hf_tokenizer(chat_folder)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]
    assert tok.apply_chat_template(messages) == f"<|user|>\n{QUESTION}<eos>\n<|assistant|>\n{ANSWER}<eos>\n"
    ids, labels = encode_chat(tok, messages)
    learned = [i for i, label in zip(ids, labels, strict=True) if label != IGNORE]
    assert tok.decode(learned) == ANSWER + "<eos>"
    assert tok.eos_token_id in tok.end_of_turn_ids


def test_lora_fine_tune_of_a_run_folder(base_run, tmp_path):
    out, data = tmp_path / "lora", write_chats(tmp_path / "c.jsonl")
    assert main(["finetune", str(base_run), "--task", "chat", "--data", str(data),
                 "--out", str(out), "--lora", "--no-progress", "train.max_steps=3", "train.plot=false",
                 "train.tensorboard=false"]) == 0
    assert load_hf_tokenizer(out).chat_template == QKV_CHAT_TEMPLATE
    assert (out / "model.safetensors").is_file()


def test_char_run_is_refused_with_one_line(tmp_path, capsys):
    from qkv.run import train_run

    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    train_run({"model": {"preset": "gpt-nano"}, "task": {"name": "lm", "path": str(tmp_path / "t.txt"),
                                                         "context": 16},
               "train": {"max_steps": 1, "progress": False, "plot": False, "tensorboard": False},
               "eval": {"n": 1, "samples": 0}}, tmp_path / "run", quiet=True)
    code = main(["finetune", str(tmp_path / "run"), "--task", "chat", "--data",
                 str(write_chats(tmp_path / "c.jsonl")), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "byte-level BPE" in err[-1] and err[-1].startswith("qkv: error:")


def test_qkv_chat_streams_and_stops_at_end_of_turn(chat_folder):
    from qkv.chat import ChatSession
    from qkv.generate import GenerationConfig

    session = ChatSession.from_folder(chat_folder, generation_config=GenerationConfig(max_new_tokens=24))
    pieces: list[str] = []
    answer = session.reply(QUESTION, on_text=pieces.append)
    assert answer == ANSWER  # learned, and stopped at <eos> before the 24-token budget
    assert "".join(pieces).strip() == ANSWER and len(pieces) > 1


def test_qkv_serve_answers_the_openai_client(chat_folder):
    assert check_serve(chat_folder) == ANSWER


def test_qkv_explore_takes_the_chat_folder(chat_folder):
    check_explore(chat_folder)


def test_export_loads_in_transformers_with_equal_logits_and_text(chat_folder, tmp_path):
    pytest.importorskip("transformers")
    check_export_parity(chat_folder, tmp_path / "hf")


def test_exported_base_fine_tunes_with_chat_template_qkv(base_run, tmp_path, capsys):
    """`qkv export` of the run, then the chat recipe on that Hugging Face folder (which has no template): a
    note naming --chat-template qkv without it; with it, OUT carries qkv's template."""
    pytest.importorskip("transformers")
    hf, data = tmp_path / "hf", write_chats(tmp_path / "c.jsonl")
    assert main(["export", str(base_run), str(hf)]) == 0
    common = ["--task", "chat", "--data", str(data), "--no-progress", "train.max_steps=2", "train.plot=false",
              "train.tensorboard=false"]
    assert main(["finetune", str(hf), *common, "--out", str(tmp_path / "plain")]) == 0
    assert "--chat-template qkv" in capsys.readouterr().err
    assert not load_hf_tokenizer(tmp_path / "plain").has_chat_template
    assert main(["finetune", str(hf), *common, "--out", str(tmp_path / "qkv"), "--chat-template", "qkv"]) == 0
    tok = load_hf_tokenizer(tmp_path / "qkv")
    assert tok.chat_template == QKV_CHAT_TEMPLATE and tok.eos_token == "<eos>"
    again = ["finetune", str(tmp_path / "qkv"), *common, "--out", str(tmp_path / "x"), "--chat-template",
             "qkv"]
    assert main(again) == 2
    assert "has a chat template of its own" in capsys.readouterr().err
