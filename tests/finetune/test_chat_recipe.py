"""The chat recipe on tiny local folders: labels exactly on the assistant's tokens (against transformers'
own assistant mask), fine-tuning that learns (a test that can fail), output folders that qkv and transformers
load, LoRA merged on save, and one seed = one run in a new process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.cli.main import main
from qkv.finetune.chat import IGNORE, ChatData, assistant_loss, build_examples, encode_chat, read_chats
from qkv.interop.tokenizer import load_hf_tokenizer

FACTS = [("What is the capital of France?", "Paris."), ("Which planet is red?", "Mars."),
         ("What do bees make?", "Honey."), ("How many legs has a spider?", "Eight."),
         ("What is frozen water?", "Ice."), ("Who wrote Hamlet?", "Shakespeare."),
         ("What gas do plants take in?", "Carbon dioxide."), ("What is the opposite of hot?", "Cold.")]
SYSTEM = "You answer in one word."


def chats(with_system: bool = True) -> list[dict]:
    rows = []
    for i, (q, a) in enumerate(FACTS):
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if with_system and i % 2 == 0:
            msgs.insert(0, {"role": "system", "content": SYSTEM})
        rows.append({"messages": msgs})
    rows.append({"prompt": "Say hi.", "completion": "Hi."})  # the prompt/completion form
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What do bees make?"},
                {"role": "assistant", "content": "Honey, mostly."},
                {"role": "user", "content": "And  é 日本?"},
                {"role": "assistant", "content": "  Nothing else.  "}]


def test_labels_are_exactly_the_assistant_tokens(gpt2_chat, chatml_generation):
    """Rendered text equals transformers' apply_chat_template; every label outside transformers' assistant
    mask (from the same template with {% generation %} blocks) is ignored, every one inside is the token."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(gpt2_chat)
    tok = load_hf_tokenizer(gpt2_chat)
    assert tok.apply_chat_template(CONVERSATION) == hf.apply_chat_template(CONVERSATION, tokenize=False)
    ids, labels = encode_chat(tok, CONVERSATION)
    ref = hf.apply_chat_template(CONVERSATION, chat_template=chatml_generation, tokenize=True,
                                 return_dict=True, return_assistant_tokens_mask=True)
    assert ids == ref["input_ids"]
    mask = ref["assistant_masks"]
    assert sum(mask) > 0
    assert labels == [i if m else IGNORE for i, m in zip(ids, mask)]
    # and the labelled tokens decode to the answers with their end-of-turn token, nothing else
    said = hf.decode([i for i in labels if i != IGNORE])
    assert said == "Honey, mostly.<|im_end|>  Nothing else.  <|im_end|>"


def test_plain_fallback_without_a_template(gpt2_plain):
    tok = load_hf_tokenizer(gpt2_plain)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "No."}]
    ids, labels = encode_chat(tok, msgs)
    assert (tok.decode(ids)
            == "Be brief.\n\nUser: Hi?\nAssistant: Yes.<|im_end|>\nUser: Sure?\nAssistant: No.<|im_end|>")
    assert tok.decode([i for i in labels if i != IGNORE]) == " Yes.<|im_end|> No.<|im_end|>"
    # the prompt qkv chat builds for the first turn is exactly the start of the training text
    from qkv.chat import ChatSession

    session = ChatSession.from_folder(gpt2_plain, system="Be brief.")
    session.history.append({"role": "user", "content": "Hi?"})
    prompt = session.prompt_ids(4)
    assert ids[: len(prompt)] == prompt and tok.decode(prompt).endswith("Assistant:")


def test_batches_are_deterministic_padded_and_grouped(gpt2_chat, tmp_path):
    tok = load_hf_tokenizer(gpt2_chat)
    records = read_chats(write_jsonl(tmp_path / "d.jsonl", chats() * 4))
    ex, skipped = build_examples(tok, records, 96, "d.jsonl", "error")
    assert not skipped and len(ex) == 36
    a, b = ChatData(ex, [], pad_id=0, seed=3), ChatData(ex, [], pad_id=0, seed=3)
    seen = []
    for i in range(ChatData(ex, [], 0).batches_per_epoch(4)):
        x, y = a.batch(i, 4), b.batch(i, 4)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
        pad = x["labels"] == IGNORE
        assert (x["input_ids"][pad & (torch.arange(x["input_ids"].shape[1]) >= 0)] >= 0).all()
        seen += [tuple(r[r != IGNORE].tolist()) for r in x["labels"]]
    assert len(seen) == 36  # one epoch visits every example once
    assert not torch.equal(a.batch(0, 4)["input_ids"], ChatData(ex, [], 0, seed=4).batch(0, 4)["input_ids"])


def _finetune(model: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["finetune", str(model), "--data", str(data), "--out", str(out), "--no-progress", *extra,
                 "train.plot=false", "train.tensorboard=false"])


def _answer_qkv(folder: Path, question: str, system: str | None = None) -> str:
    from qkv import from_pretrained

    tok = load_hf_tokenizer(folder)
    model = from_pretrained(folder).eval()
    msgs = [{"role": "user", "content": question}]
    if system:
        msgs.insert(0, {"role": "system", "content": system})
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         eos_token_id=sorted(tok.eos_token_ids))
    return tok.decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)


def test_full_finetuning_learns_the_answers_and_saves_a_folder_both_libraries_load(gpt2_chat, tmp_path,
                                                                                   capsys):
    import transformers

    data = write_jsonl(tmp_path / "train.jsonl", chats())
    dev = write_jsonl(tmp_path / "dev.jsonl", chats(with_system=False)[:4])
    out = tmp_path / "out"
    tok = load_hf_tokenizer(gpt2_chat)
    examples, _ = build_examples(tok, read_chats(dev), 96, "dev", "error")
    from qkv import from_pretrained

    before = assistant_loss(from_pretrained(gpt2_chat), examples, 0)
    assert _finetune(gpt2_chat, data, out, "--dev", str(dev), "train.max_steps=150", "train.lr=3e-3",
                     "train.batch_size=8", "train.warmup=5") == 0
    report = capsys.readouterr().out
    assert "full fine-tuning" in report and "dev loss (assistant tokens)" in report
    after = assistant_loss(from_pretrained(out), examples, 0)
    assert after < 0.2 * before, (before, after)  # random weights: ~ln(400) = 6 before
    # the trained model answers trained questions (greedy), each as it was asked in training
    assert _answer_qkv(out, "Who wrote Hamlet?") == "Shakespeare."
    assert _answer_qkv(out, "What do bees make?", SYSTEM) == "Honey."
    assert _answer_qkv(out, "What is the opposite of hot?") == "Cold."
    capsys.readouterr()
    # the shipped command
    assert main(["chat", str(out), "--message", "Which planet is red?", "--greedy", "--max-new-tokens",
                 "16"]) == 0
    assert capsys.readouterr().out.strip() == "Mars."
    # transformers loads the folder: same logits, and its tokenizer renders the same chat
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([examples[0].input_ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, from_pretrained(out)(x).logits, atol=1e-4, rtol=1e-4)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == \
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    settings = json.loads((out / "finetune.json").read_text())
    assert (settings["examples"] == len(chats()) and settings["lora"] is None
            and settings["format"] == "hf:gpt2")
    assert hf.config.eos_token_id == tok.eos_token_id  # the source's token ids, not the exporter's defaults


def test_lora_trains_only_adapters_and_merges_on_save(gpt2_chat_lora, tmp_path, capsys):
    import transformers

    from qkv import from_pretrained

    data = write_jsonl(tmp_path / "train.jsonl", chats())
    out = tmp_path / "lora"
    assert _finetune(gpt2_chat_lora, data, out, "--lora", "--lora-rank", "8", "--lora-targets", "all-linear",
                     "--lora-dropout", "0", "train.max_steps=100", "train.lr=1e-2", "train.warmup=5") == 0
    report = capsys.readouterr().out
    # r * (in + out) per adapted matrix: q, k, v (64 -> 64 each: all-linear adapts the fused c_attn slice by
    # slice), out (64 -> 64), up (64 -> 256), down (256 -> 64)
    expected = 2 * 8 * (3 * (64 + 64) + (64 + 64) + (64 + 256) + (256 + 64))
    assert f"{expected:,} of" in report
    tok = load_hf_tokenizer(gpt2_chat_lora)
    ex, _ = build_examples(tok, read_chats(data), 96, "train", "error")
    base, tuned = from_pretrained(gpt2_chat_lora), from_pretrained(out)
    assert assistant_loss(tuned, ex, 0) < 0.5 * assistant_loss(base, ex, 0)
    # merged on save: an ordinary GPT-2 folder; frozen parts (embeddings, norms) are the source's, bit for bit
    sd_base, sd_tuned = base.state_dict(), tuned.state_dict()
    assert set(sd_base) == set(sd_tuned)
    for k in sd_base:
        if "norm" in k or "emb" in k or k.endswith("bias"):
            assert torch.equal(sd_base[k], sd_tuned[k]), k
    assert not torch.equal(sd_base["decoder.blocks.0.attn.qkv_proj.weight"],
                           sd_tuned["decoder.blocks.0.attn.qkv_proj.weight"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([ex[0].input_ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, tuned(x).logits, atol=1e-4, rtol=1e-4)


def test_lora_on_a_llama_folder_round_trips_through_transformers(llama_chat, tmp_path, capsys):
    """A Llama folder (GQA, untied head): Hugging Face target names, the head adapted too (it is not tied),
    the count is the formula on the GQA slices, and the merged folder is a Llama folder transformers loads."""
    import transformers

    from qkv import from_pretrained

    data = write_jsonl(tmp_path / "train.jsonl", chats())
    out = tmp_path / "llama"
    assert _finetune(llama_chat, data, out, "--lora", "--lora-rank", "4", "--lora-targets",
                     "q_proj,v_proj,o_proj,lm_head", "--lora-dropout", "0", "train.max_steps=60",
                     "train.lr=1e-2", "train.warmup=5") == 0
    report = capsys.readouterr().out
    # per layer q (64 -> 64), v (64 -> 32: 2 kv heads of 16), o (64 -> 64); the head (64 -> 400) once
    expected = 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 64)) + 4 * (64 + 400)
    assert f"{expected:,} of" in report
    tok = load_hf_tokenizer(llama_chat)
    ex, _ = build_examples(tok, read_chats(data), 96, "train", "error")
    base, tuned = from_pretrained(llama_chat), from_pretrained(out)
    assert assistant_loss(tuned, ex, 0) < 0.5 * assistant_loss(base, ex, 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.eos_token_id == tok.eos_token_id
    x = torch.tensor([ex[0].input_ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, tuned(x).logits, atol=1e-4, rtol=1e-4)
    sd_base, sd_tuned = base.state_dict(), tuned.state_dict()
    changed = {k for k in sd_base if not torch.equal(sd_base[k], sd_tuned[k])}
    assert changed == {"lm_head.weight", "decoder.blocks.0.attn.qkv_proj.weight",
                       "decoder.blocks.1.attn.qkv_proj.weight",
                       "decoder.blocks.0.attn.out_proj.weight", "decoder.blocks.1.attn.out_proj.weight"}
    # inside the fused projection only the q and v rows moved, not k's
    w0, w1 = (sd_base["decoder.blocks.0.attn.qkv_proj.weight"],
              sd_tuned["decoder.blocks.0.attn.qkv_proj.weight"])
    assert (torch.equal(w0[64:96], w1[64:96]) and not torch.equal(w0[:64], w1[:64])
            and not torch.equal(w0[96:], w1[96:]))


def test_resume_continues_exactly(gpt2_chat, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", chats())
    # a constant LR: the schedule then does not depend on max_steps, which the first half of b stops early
    # with
    args = ("--lora", "--lora-targets", "q,v", "train.lr=1e-2", "train.batch_size=4", "train.save_every=3",
            "train.log_every=1", "train.schedule=constant", "train.warmup=0", "train.max_steps=6")
    assert _finetune(gpt2_chat, data, tmp_path / "a", *args) == 0
    assert _finetune(gpt2_chat, data, tmp_path / "b", *args[:-1], "train.max_steps=3") == 0
    assert _finetune(gpt2_chat, data, tmp_path / "b", *args, "--resume") == 0

    def losses(run):
        return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
                    if '"loss"' in x]

    assert losses(tmp_path / "a")[-3:] == losses(tmp_path / "b")[-3:]
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_one_seed_one_run_in_new_processes(gpt2_chat, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", chats())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(name: str) -> list[dict]:
        cmd = [sys.executable, "-m", "qkv.cli.main", "finetune", str(gpt2_chat), "--data", str(data), "--out",
               str(tmp_path / name), "--no-progress", "--lora", "--lora-dropout", "0.1", "--seed", "7",
               "train.max_steps=4", "train.log_every=1", "train.lr=1e-2", "train.plot=false",
               "train.tensorboard=false"]
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
        keep = ("step", "loss", "grad_norm", "lr")
        return [{k: r[k] for k in keep if k in r} for r in map(json.loads, (tmp_path / name / "metrics.jsonl")
                                                                  .read_text().splitlines())]

    a, b = run("a"), run("b")
    assert a == b and len(a) >= 4 and all("loss" in r for r in a)


def test_sharegpt_records_build_the_messages_forms_examples(gpt2_chat, tmp_path):
    """ShareGPT's {"conversations": [{from, value}]} (with a top-level or an in-line system prompt) encodes to
    exactly the ids and labels of the same conversations in the "messages" form."""
    def sharegpt(row: dict, top_level_system: bool) -> dict:
        speaker = {"system": "system", "user": "human", "assistant": "gpt"}
        turns = [{"from": speaker[m["role"]], "value": m["content"]} for m in row["messages"]]
        if turns[0]["from"] == "system" and top_level_system:  # LLaMA-Factory's place for it
            return {"system": turns[0]["value"], "conversations": turns[1:]}
        return {"conversations": turns}

    rows = [r for r in chats() if "messages" in r] + [{"messages": CONVERSATION}]
    converted = [sharegpt(r, top_level_system=i % 3 == 0) for i, r in enumerate(rows)]
    assert any("system" in c for c in converted)
    assert any(c["conversations"][0]["from"] == "system" for c in converted)
    tok = load_hf_tokenizer(gpt2_chat)
    want = read_chats(write_jsonl(tmp_path / "m.jsonl", rows))
    got = read_chats(write_jsonl(tmp_path / "s.jsonl", converted))
    assert got == want
    a, _ = build_examples(tok, got, 256, "s", "error")
    b, _ = build_examples(tok, want, 256, "m", "error")
    assert [(e.input_ids, e.labels) for e in a] == [(e.input_ids, e.labels) for e in b]


@pytest.mark.parametrize("content,message", [
    (b"", "the file is empty"),
    (b"\n\n", "the file is empty"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"text": '
     b'1}\n',
     ":2: missing 'messages'"),
    (b'{"messages": [{"role": "bot", "content": "hi"}]}\n', ":1: message 0 has unknown role 'bot'"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}\n', ":1: no assistant message"),
    (b'\n{"prompt": "caf\xe9", "completion": "x"}\n', ":2: not UTF-8 text"),
    (b'{"messages": [}\n', ":1: invalid JSON"),
    (b'[1, 2]\n', ":1: expected a JSON object"),
    (b'{"prompt": "a", "completion": 3}\n', ":1: a prompt/completion record needs both as strings"),
    (b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "f()"}]}\n',
     ":1: conversation turn 1 is from 'function_call'"),
    (b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": 7}]}\n',
     ":1: conversation turn 1: 'value' must be a string"),
    (b'{"conversations": [{"from": "human", "value": "hi"}, {"role": "gpt", "content": "x"}]}\n',
     ":1: conversation turn 1 must be an object with 'from' and 'value'"),
    (b'{"system": "s", "conversations": [{"from": "system", "value": "t"}, {"from": "human", "value": "a"}, '
     b'{"from": "gpt", "value": "b"}]}\n', ":1: a top-level 'system' and a system turn"),
])
def test_bad_data_is_one_line_naming_the_line(gpt2_chat, tmp_path, capsys, content, message):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(content)
    assert _finetune(gpt2_chat, data, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv: error: ") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # nothing written


def test_too_long_is_an_error_or_a_counted_skip(gpt2_chat, tmp_path, capsys):
    rows = chats()
    rows.insert(3, {"prompt": "word " * 200, "completion": "long"})  # line 4, over the context of 96
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    assert _finetune(gpt2_chat, data, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "d.jsonl:4: the conversation is" in err and "longer than the context of 96" in err
    assert _finetune(gpt2_chat, data, tmp_path / "o", "--too-long", "skip", "train.max_steps=1") == 0
    assert f"skipped 1 training record(s) over 96 tokens ({data} lines 4)" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "finetune.json").read_text())["skipped_lines"] == [4]
    # skipped dev records are named too, and a dev file left empty says there is no dev loss
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"prompt": "word " * 200, "completion": "long"}] * 2)
    assert _finetune(gpt2_chat, data, tmp_path / "o2", "--too-long", "skip", "--dev", str(dev),
                     "train.max_steps=1") == 0
    out = capsys.readouterr().out
    assert (f"skipped 2 dev record(s) over 96 tokens ({dev} lines 1, 2); no dev record is left: no dev loss"
            in out)


def test_bad_system_and_max_length_are_refused(gpt2_chat, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "completion": "c", "system": 5}])
    assert _finetune(gpt2_chat, bad, tmp_path / "o") == 2
    assert "bad.jsonl:1: 'system' must be a string" in capsys.readouterr().err
    data = write_jsonl(tmp_path / "d.jsonl", chats())
    for n in ("0", "-3"):
        assert _finetune(gpt2_chat, data, tmp_path / "o", "--max-length", n) == 2
        assert "--max-length must be a positive number of tokens" in capsys.readouterr().err


def test_bad_flags_and_out_folders(gpt2_chat, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chats())
    assert _finetune(gpt2_chat, data, tmp_path / "o", "--lora", "--lora-targets", "c_attn") == 2
    assert "LoRA target 'c_attn' matches no linear layer" in capsys.readouterr().err
    assert _finetune(gpt2_chat, data, tmp_path / "o", "model.x=1") == 2
    assert "train.key=value" in capsys.readouterr().err
    assert _finetune(gpt2_chat, data, tmp_path / "o", "train.lr_max=1") == 2
    assert "unknown key 'lr_max'" in capsys.readouterr().err
    assert _finetune(gpt2_chat, data, gpt2_chat) == 2  # never overwrite a model folder it did not write
    assert "already holds a model folder" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_under_torchrun_ddp_and_fsdp_give_the_same_folder(gpt2_chat, tmp_path, torchrun):
    """The recipe under torchrun (2 CPU processes, gloo): DDP and FSDP2 train the same adapters, and under
    FSDP the sharded model is rebuilt on rank 0 from the full checkpoint before merging and saving."""
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "d.jsonl", chats())
    for mode in ("ddp", "fsdp"):
        r = torchrun(["-m", "qkv.cli.main", "finetune", gpt2_chat, "--data", data, "--out", tmp_path / mode,
                      "--no-progress", "--lora", "--lora-targets", "all-linear", "train.max_steps=3",
                      "train.batch_size=2", "train.lr=1e-2", f"train.distributed={mode}", "train.plot=false",
                      "train.tensorboard=false"])
        assert f"distributed {mode} x2" in r.stderr
    a, b = (load_file(tmp_path / "ddp" / "model.safetensors"),
            load_file(tmp_path / "fsdp" / "model.safetensors"))
    base = load_file(gpt2_chat / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    assert not torch.equal(a["transformer.h.0.attn.c_attn.weight"],
                           base["transformer.h.0.attn.c_attn.weight"])
    assert torch.equal(a["transformer.wte.weight"], base["transformer.wte.weight"])  # frozen under LoRA


def test_sliding_window_is_the_length_limit(gpt2_chat, tmp_path, capsys):
    """A Mistral folder whose sliding window (24) is shorter than its context (96): the model refuses longer
    sequences, so the recipe's default --max-length and its upper bound are the window, checked before
    training (it used to check against 96 and die mid-run with a partial OUT)."""
    import shutil

    import transformers
    from _chatfolders import CHATML, _write_tokenizer_config
    from tokenizers import Tokenizer

    folder = tmp_path / "mistral"
    folder.mkdir()
    shutil.copyfile(gpt2_chat / "tokenizer.json", folder / "tokenizer.json")
    _write_tokenizer_config(folder, CHATML)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=400, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                                     sliding_window=24, eos_token_id=tok.token_to_id("<|im_end|>"))
    transformers.MistralForCausalLM(cfg).save_pretrained(folder)
    data = write_jsonl(tmp_path / "d.jsonl", chats())
    capsys.readouterr()
    assert _finetune(folder, data, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "d.jsonl:1: the conversation is" in err and "longer than the context of 24" in err, err
    assert _finetune(folder, data, tmp_path / "o", "--max-length", "32") == 2
    assert "--max-length 32 is over the model's context of 24" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    short = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "Hi", "completion": "Yo."}])
    assert _finetune(folder, short, tmp_path / "o", "train.max_steps=2", "train.batch_size=1") == 0


def test_resume_refuses_other_lora_settings(gpt2_chat, tmp_path, capsys):
    """A different rank would not fit the checkpoint, but a different alpha (the update's scale) loaded
    silently and trained another function; full fine-tuning vs LoRA likewise. Refused before anything is
    written."""
    data = write_jsonl(tmp_path / "d.jsonl", chats())
    args = ("--lora", "train.max_steps=1", "train.batch_size=2")
    assert _finetune(gpt2_chat, data, tmp_path / "o", *args) == 0
    capsys.readouterr()
    for extra, message in ((("--lora", "--lora-alpha", "32"), "trained with --lora-alpha 16, not 32"),
                           (("--lora", "--lora-targets", "q,k,v"),
                            "trained with --lora-targets q,v, not q,k,v"),
                           ((), "is a LoRA run; pass --lora and its settings")):
        assert _finetune(gpt2_chat, data, tmp_path / "o", *extra, "train.max_steps=2", "--resume") == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert _finetune(gpt2_chat, data, tmp_path / "o", *args[:1], "train.max_steps=2", "--resume") == 0
