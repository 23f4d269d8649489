"""`qkv speedrun` end to end at a test's scale (the quick profile with a tiny model, a few modules, a few
steps) walking every phase and every join: killed mid-pretrain and mid-SFT and continued from the
checkpoints, then the chat model answering through qkv chat and qkv serve (openai client), exported to
transformers with equal logits and equal greedy text. Then the bad inputs: one clear line each, and a phase
cut short never recorded."""

from __future__ import annotations

import dataclasses
import errno
import json

import pytest
from _chatrun import check_explore, check_export_parity, check_serve

import qkv.speedrun.phases as phases
from qkv.cli.main import main
from qkv.config import ConfigError
from qkv.speedrun import PHASES, load_profile, speedrun
from qkv.speedrun.data import module_name
from qkv.speedrun.state import STATE_FILE

TINY = """data.max_modules=8 tokenizer.vocab_size=400 pretrain.model.d_model=32 pretrain.model.n_layers=1
pretrain.model.n_heads=2 pretrain.model.n_kv_heads=1 pretrain.context=96 pretrain.train.max_steps=12
pretrain.train.save_every=4 pretrain.train.plot=false pretrain.train.tensorboard=false pretrain.eval_windows=8
sft.synthetic=40 sft.max_doc_qa=40 sft.epochs=1 sft.identity_copies=1 sft.train.max_steps=4
sft.train.tensorboard=false eval.doc_qa=4 eval.synthetic=4 eval.code=2 eval.max_new_tokens=8
eval.code_tokens=16 eval.samples=2""".split()


class Killed(Exception):
    """Stands for the process dying mid-pretrain."""


def _killed(out, name, cut):
    """Run the speedrun with phases.`name` replaced by `cut` (which raises Killed): the phase is left behind
    unrecorded, its checkpoints written."""
    real = getattr(phases, name)
    setattr(phases, name, lambda *a, **kw: cut(real, *a, **kw))
    try:
        with pytest.raises(Killed):
            speedrun(out, "quick", TINY, quiet=True, log=lambda _: None)
    finally:
        setattr(phases, name, real)


def _pretrain_4_steps(real, cfg, folder, **kw):
    real({**cfg, "train": {**cfg["train"], "max_steps": 4}}, folder, **kw)
    raise Killed


def _sft_2_steps(real, settings, **kw):
    real(dataclasses.replace(settings, train={**settings.train, "max_steps": 2}), **kw)
    raise Killed


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """The tiny speedrun killed after 4 pretraining steps, rerun and killed after 2 fine-tuning steps (each
    time a checkpoint written, the phase unrecorded), then rerun to the end: (DIR, the last run's stderr
    lines)."""
    out = tmp_path_factory.mktemp("speedrun") / "run"
    _killed(out, "train_run", _pretrain_4_steps)
    assert set(json.loads((out / STATE_FILE).read_text())["phases"]) == {"data", "tokenizer"}
    _killed(out, "finetune", _sft_2_steps)
    assert set(json.loads((out / STATE_FILE).read_text())["phases"]) == {"data", "tokenizer", "pretrain"}
    said: list[str] = []
    speedrun(out, "quick", TINY, quiet=True, log=said.append)
    return out, said


def test_every_phase_recorded_and_the_cut_phases_continued(done):
    out, said = done
    state = json.loads((out / STATE_FILE).read_text())
    assert set(state["phases"]) == set(PHASES)
    assert "speedrun: pretrain ..." not in said and "speedrun: sft ..." in said
    for run, last in (("base", 12), ("chat", 4)):  # one history each, continued from steps 4 and 2
        steps = [json.loads(line)["step"] for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(set(steps)) and steps[-1] == last
    assert state["phases"]["sft"]["steps"] == 4
    pre = state["phases"]["pretrain"]
    assert pre["steps"] == 12 and pre["tokens_seen"] == 12 * 16 * 96
    assert 0 < pre["val_bits_per_byte"] < 16


def test_report_card(done):
    out, _ = done
    report = (out / "report.md").read_text()
    for part in ("## Phases", "| pretrain |", "doc QA ROUGE-L", "ast.parse", "addition exact match",
                 "## Sample chats", "**user:** Who are you?"):
        assert part in report
    assert (out / "report" / "pretrain_loss.png").stat().st_size > 1000
    results = json.loads((out / "eval" / "results.json").read_text())
    for score in (results["doc_qa"]["sft"]["rouge_l"], results["doc_qa"]["base_few_shot"]["rouge_l"],
                  results["code"]["parse_rate"], results["synthetic"]["exact_match"]):
        assert 0.0 <= score <= 1.0


def test_held_out_modules_are_only_evaluated(done):
    """The SFT data asks about train modules only, the evaluation about held-out modules only."""
    out, _ = done
    split = json.loads((out / "data" / "split.json").read_text())
    train = {module_name(p) for p in split["train"]}
    val = {module_name(p) for p in split["val"]}
    assert train and val and not train & val
    ev = json.loads((out / "data" / "eval.json").read_text())
    asked = [x["q"].split("`")[1] for x in ev["doc_qa"]]
    assert asked and all(any(q.startswith(m + ".") for m in val) for q in asked)
    sft = [json.loads(line)["messages"] for line in (out / "data" / "sft.jsonl").read_text().splitlines()]
    doc = [m[0]["content"].split("`")[1] for m in sft if m[0]["content"].startswith("What does `")]
    assert doc and all(any(q.startswith(m + ".") for m in train) for q in doc)


def test_rerun_skips_every_phase(done, capsys):
    out, _ = done
    before = (out / "report.md").stat().st_mtime_ns
    assert main(["speedrun", "--profile", "quick", "--out", str(out), "--no-progress", *TINY]) == 0
    assert "data, tokenizer, pretrain, sft, evaluate, report already complete" in capsys.readouterr().err
    assert (out / "report.md").stat().st_mtime_ns == before


def test_chat_model_answers_in_chat_serve_explore_and_export(done, tmp_path):
    pytest.importorskip("transformers")
    from qkv.chat import ChatSession
    from qkv.generate import GenerationConfig

    out, _ = done
    session = ChatSession.from_folder(out / "chat", generation_config=GenerationConfig(max_new_tokens=12))
    assert session.templated
    answer = session.reply("Who are you?")
    assert check_serve(out / "chat").strip() == answer.strip()
    check_explore(out / "chat")
    check_export_parity(out / "chat", tmp_path / "hf")


# -- bad input: one line each -------------------------------------------------------------------------------
def _error(capsys, argv) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # the phases' progress lines, then the error
    assert lines[-1].startswith("qkv: error: ") and all(line.startswith("speedrun: ") for line in lines[:-1])
    return lines[-1]


def test_misspelt_profile(tmp_path, capsys):
    line = _error(capsys, ["speedrun", "--profile", "quik", "--out", str(tmp_path / "x")])
    assert "unknown speedrun profile 'quik'; did you mean 'quick'?" in line
    assert not (tmp_path / "x").exists()


def test_misspelt_override(tmp_path, capsys):
    argv = ["speedrun", "--profile", "quick", "--out", str(tmp_path / "x"), "pretrain.contxt=9"]
    line = _error(capsys, argv)
    assert "contxt" in line and "context" in line


def test_out_holding_other_files(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    line = _error(capsys, ["speedrun", "--profile", "quick", "--out", str(tmp_path)])
    assert "holds other files (notes.txt), not a speedrun" in line
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_out_holding_another_speedrun(tmp_path, capsys):
    other = load_profile("quick", ["pretrain.train.max_steps=7"]).to_dict()
    (tmp_path / STATE_FILE).write_text(json.dumps({"profile": other, "phases": {}}))
    line = _error(capsys, ["speedrun", "--profile", "quick", "--out", str(tmp_path)])
    assert "holds another speedrun (pretrain.train.max_steps=7, not 400)" in line


def test_disk_full_leaves_the_phase_unrecorded(tmp_path, capsys, monkeypatch):
    real = phases.atomic_write_text

    def full(text, path):
        if path.name == "sft.jsonl":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(text, path)

    monkeypatch.setattr(phases, "atomic_write_text", full)
    line = _error(capsys, ["speedrun", "--profile", "quick", "--out", str(tmp_path / "x"), *TINY])
    assert "speedrun phase data: cannot write" in line and "No space left on device" in line
    assert "not marked complete" in line
    assert json.loads((tmp_path / "x" / STATE_FILE).read_text())["phases"] == {}


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun_every_rank_trains_and_rank_0_writes(tmp_path, torchrun):
    """torchrun, 2 CPU processes (gloo): pretrain and SFT run data-parallel, each rank taking half of the
    profile's batch, so they see the sequences one process sees with half the batch and 2 accumulation
    steps, and their figures equal that run's (losses to the order of gloo's sums); rank 0 alone writes the
    data, the tokenizer, the evaluation and the report, and tells the story once."""
    r = torchrun(["-m", "qkv.cli.main", "speedrun", "--profile", "quick", "--out", tmp_path / "two", *TINY])
    assert "distributed ddp x2, global batch 16 sequences" in r.stderr
    assert r.stderr.count("speedrun: report done") == 1
    two = json.loads((tmp_path / "two" / STATE_FILE).read_text())["phases"]
    assert set(two) == set(PHASES) and (tmp_path / "two" / "report.md").is_file()
    accumulated = [f"{phase}.train.{key}={value}" for phase in ("pretrain", "sft")
                   for key, value in (("batch_size", 8), ("grad_accum", 2))]
    speedrun(tmp_path / "one", "quick", [*TINY, *accumulated], quiet=True, log=lambda _: None)
    one = json.loads((tmp_path / "one" / STATE_FILE).read_text())["phases"]
    for phase, key in (("pretrain", "tokens_seen"), ("pretrain", "steps"), ("sft", "steps"),
                       ("sft", "conversations")):
        assert two[phase][key] == one[phase][key], (phase, key)
    for phase, key in (("pretrain", "val_loss"), ("pretrain", "final_train_loss"),
                       ("sft", "final_train_loss")):
        assert two[phase][key] == pytest.approx(one[phase][key], rel=1e-5), (phase, key)


def test_a_batch_that_does_not_divide_among_the_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"pretrain.train.batch_size=16 does not divide among the 3 proc"):
        phases.pretrain_config(tmp_path, load_profile("quick"))


def test_lora_sft_phase(done, tmp_path):
    """sft.lora: true fine-tunes the same base through LoRA adapters (merged on save), a chat folder still."""
    import shutil

    from qkv.interop.tokenizer import load_hf_tokenizer

    out, _ = done
    for part in ("data", "tokenizer", "base"):
        shutil.copytree(out / part, tmp_path / part)
    figures = phases.sft_phase(tmp_path, load_profile("quick", [*TINY, "sft.lora=true"]), quiet=True)
    assert figures["lora"] is True and figures["trainable_parameters"] < figures["parameters"]
    assert figures["steps"] == 4 and load_hf_tokenizer(tmp_path / "chat").has_chat_template
