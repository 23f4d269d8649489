"""What `qkv generate` decodes with: a setting the user gives wins over the folder's generation_config.json or
the task's sampling defaults even when it equals GenerationConfig's default (--greedy, do_sample=False,
--temperature 1.0), as in transformers; beams switch off a folder's sampling; stop_strings from a file work;
a byte-level BPE run streams whole characters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_generate_spacing import MAX_NEW, _reference

from qkv.cli.main import main
from qkv.config import ConfigError
from qkv.generate import GenerationConfig, beam_search, generate
from qkv.generate.config import resolve
from qkv.tasks import build_task

transformers = pytest.importorskip("transformers")


@pytest.fixture
def sampling_folder(llama_sp, tmp_path):
    """llama_sp with an instruct model's generation_config.json: it samples by default."""
    folder, tok, model = llama_sp
    dst = tmp_path / "instruct"
    shutil.copytree(folder, dst)
    (dst / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.7, "top_k": 50, "bos_token_id": 1, "eos_token_id": 2,
        "transformers_version": "5.0"}))
    return dst, tok, model


def test_a_setting_given_at_its_default_wins_over_the_folder():
    folder = {"do_sample": True, "temperature": 0.7, "top_k": 20}
    cfg = resolve(folder, GenerationConfig(do_sample=False, temperature=1.0), {})
    assert (cfg.do_sample, cfg.temperature, cfg.top_k) == (False, 1.0, 20)
    assert resolve(folder, GenerationConfig(), {}).do_sample  # not given: the folder's
    assert resolve(folder, GenerationConfig().replace(temperature=1.0), {}).temperature == 1.0
    # beams asked for: the folder's sampling is off
    assert not resolve(folder, None, {"num_beams": 2}).do_sample
    with pytest.raises(ConfigError, match="beam search is deterministic"):
        resolve(folder, None, {"num_beams": 2, "do_sample": True})  # both asked for: a contradiction


@pytest.mark.parametrize("seed", ["1", "2"])
def test_greedy_flag_is_greedy_on_a_sampling_folder(sampling_folder, llama_sp, seed, capsys):
    want = _reference(llama_sp, "Hello")  # transformers, do_sample=False
    assert main(["generate", str(sampling_folder[0]), "--prompt", "Hello", "--max-new-tokens", str(MAX_NEW),
                 "--min-new-tokens", str(MAX_NEW), "--greedy", "--seed", seed]) == 0
    assert capsys.readouterr().out == "Hello" + want + "\n"


def test_do_sample_false_in_a_config_is_greedy_and_beams_run(sampling_folder):
    import qkv

    folder, tok, hf = sampling_folder
    model = qkv.from_pretrained(folder).eval()
    ids = torch.tensor([tok.encode("The class of").ids])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                           pad_token_id=2)
        beams = hf.generate(ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, num_beams=3,
                            pad_token_id=2)
    for seed in (1, 2):
        cfg = GenerationConfig(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, seed=seed)
        assert generate(model, ids, cfg).tolist() == want.tolist()
    # the folder's do_sample no longer makes beam search a contradiction
    out = beam_search(model, ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, num_beams=3)
    assert out.sequences.tolist() == beams.tolist()


def test_stop_strings_from_a_file(sampling_folder, llama_sp, tmp_path, capsys):
    full = "Hello" + _reference(llama_sp, "Hello")
    stop = full.split()[2]  # a word the greedy continuation reaches after a few tokens
    (tmp_path / "stop.json").write_text(json.dumps({"stop_strings": [stop]}))
    for extra in ([], ["--stream"]):
        assert main(["generate", str(sampling_folder[0]), "--prompt", "Hello", "--max-new-tokens",
                     str(MAX_NEW),
                     "--min-new-tokens", str(MAX_NEW), "--greedy", "--generation-config",
                     str(tmp_path / "stop.json"),
                     *extra]) == 0
        out = capsys.readouterr().out.rstrip("\n")
        assert stop in out and full.startswith(out) and len(out) < len(full), (out, full)


def test_several_return_sequences_are_refused(sampling_folder, tmp_path, capsys):
    (tmp_path / "n.json").write_text(json.dumps({"num_return_sequences": 3, "do_sample": True}))
    assert main(["generate", str(sampling_folder[0]), "--prompt", "Hello", "--generation-config",
                 str(tmp_path / "n.json")]) == 2
    assert "prints one sequence" in capsys.readouterr().err


def test_greedy_and_temperature_flags_on_a_run(tiny_lm_run, capsys):
    folder, task, model = tiny_lm_run
    ids = torch.tensor([task.tokenizer.encode("def ")])
    with torch.no_grad():  # greedy, by a plain loop over full forwards
        for _ in range(10):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    want = "def " + task.tokenizer.decode(ids[0, 4:].tolist())
    for seed in ("1", "2"):
        assert main(["generate", str(folder), "--prompt", "def ", "--max-new-tokens", "10", "--greedy",
                     "--seed", seed]) == 0
        assert capsys.readouterr().out == want + "\n"
    assert main(["generate", str(folder), "--prompt", "def ", "--max-new-tokens", "10", "--num-beams",
                 "2"]) == 0
    outs = {}
    # the task samples at 0.8: a flag of 1.0 must not be dropped as "the default"
    for t in (None, "0.8", "1.0"):
        capsys.readouterr()
        assert main(["generate", str(folder), "--prompt", "def ", "--max-new-tokens", "30", "--seed", "3",
                     *(["--temperature", t] if t else [])]) == 0
        outs[t] = capsys.readouterr().out
    assert outs[None] == outs["0.8"] != outs["1.0"]


def test_a_byte_level_bpe_run_streams_whole_characters(tmp_path, monkeypatch, capsys):
    import qkv.generate
    from qkv.run.generation import _stream_lm

    (tmp_path / "ascii.txt").write_text("plain ascii words only\n" * 300, encoding="utf-8")
    tok = build_task("bpelm", family="gpt", path=str(tmp_path / "ascii.txt"), context=16,
                     bpe_vocab_size=300).tokenizer
    ids = tok.encode("日本語 ok")
    assert len(ids) > 4  # every CJK character is three byte tokens here
    monkeypatch.setattr(qkv.generate, "stream", lambda *a, **k: iter(torch.tensor([[i]]) for i in ids))
    assert _stream_lm(None, tok, "> ", GenerationConfig()) == "> 日本語 ok"
    assert capsys.readouterr().out == "> 日本語 ok\n"


def test_the_folders_own_length_is_the_default(sampling_folder, llama_sp, capsys):
    # a decoder folder's generation_config.json max_new_tokens was overridden by the CLI's 200
    folder, tok, _ = sampling_folder
    meta = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**meta, "max_new_tokens": 3,
                                                               "min_new_tokens": 3}))
    assert main(["generate", str(folder), "--prompt", "Hello", "--greedy"]) == 0
    want = _reference(llama_sp, "Hello")  # 8 greedy tokens; the first 3 are the folder's answer
    out = capsys.readouterr().out.rstrip("\n")
    assert want.startswith(out[len("Hello"):]) and 0 < len(out) - len("Hello") < len(want)
    assert len(tok.encode(out).ids) == len(tok.encode("Hello").ids) + 3


def test_a_dataclasses_copy_does_not_give_every_field():
    import dataclasses

    folder = {"do_sample": True, "temperature": 0.6}
    copy = dataclasses.replace(GenerationConfig(), max_new_tokens=5)
    cfg = resolve(folder, copy, {})
    # the folder's, as .replace gives
    assert (cfg.do_sample, cfg.temperature, cfg.max_new_tokens) == (True, 0.6, 5)


def test_context_overflow_flag_on_a_folder_with_a_fixed_context(tmp_path, capsys):
    """A GPT-2 folder (learned positions, n_positions=24) refuses prompt + new tokens over its context and
    names the flag that slides instead; with --context-overflow slide each new token is the argmax of
    transformers' logits over the last 24 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(vocab), n_positions=24, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=None, eos_token_id=None, initializer_range=0.5)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path)
    prompt = "the quick brown fox"  # 19 tokens
    capsys.readouterr()
    assert main(["generate", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "10", "--greedy"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context of 24" in err and "--context-overflow slide" in err
    assert main(["generate", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "10", "--greedy",
                 "--context-overflow", "slide"]) == 0
    ids = [vocab[c] for c in prompt]
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(hf(torch.tensor([ids[-24:]])).logits[0, -1].argmax()))
    inverse = {i: c for c, i in vocab.items()}
    # the prompt as typed, then the new tokens as the WordLevel decoder joins them (with spaces)
    assert capsys.readouterr().out.rstrip("\n") == prompt + " " + " ".join(inverse[i] for i in ids[19:])
