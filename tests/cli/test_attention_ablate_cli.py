"""`qkv attention`, `qkv ablate` and the speech task's missing espeak-ng: the file written is
the file printed, the ViT draws the first N held-out images in order, and user errors are one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkv.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _train(out: Path, config: str, overrides: list[str]) -> Path:
    from qkv.run import load_run_config, train_run

    cfg = load_run_config(config, overrides + ["train.progress=false", "eval.n=4", "eval.samples=0"])
    train_run(cfg, out=out, quiet=True)
    return out


@pytest.fixture(scope="module")
def rev_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("rev") / "run", "reverse",
                  ["train.max_steps=2", "train.warmup=0", "task.min_len=3", "task.max_len=5",
                   "model.d_model=32", "model.d_ff=64"])


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("gpt") / "run", "reverse",
                  ["model.preset=gpt-nano", "model.d_model=32", "model.n_heads=2", "model.n_layers=1",
                   "train.max_steps=2",
                   "train.warmup=0", "task.min_len=3", "task.max_len=5"])


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("vit") / "run", str(ROOT / "configs" / "vit_digits.yaml"),
                  ["train.max_steps=2", "train.warmup=0"])


# -- the path printed is the file written ----------------------------------------------------------------
def test_attention_out_without_extension_writes_and_prints_the_png(gpt_run, rev_run, tmp_path, capsys):
    # one attention kind (decoder-only): the file is --out itself, so matplotlib used to add .png unseen
    assert main(["attention", str(gpt_run), "--input", "123", "--out", str(tmp_path / "gpt" / "att")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'gpt' / 'att.png'}\n")
    assert sorted(p.name for p in (tmp_path / "gpt").iterdir()) == ["att.png", "att_entropy.json"]
    # three kinds (encoder-decoder): one file per kind, each printed as written
    assert main(["attention", str(rev_run), "--input", "123", "--out", str(tmp_path / "rev" / "att")]) == 0
    out = capsys.readouterr().out
    written = sorted(p.name for p in (tmp_path / "rev").iterdir())
    assert written == ["att_cross.png", "att_decoder_self.png", "att_encoder_self.png", "att_entropy.json"]
    # the per-head statistics file too: it was written (over any earlier one) unannounced
    for name in written:
        assert f"wrote {tmp_path / 'rev' / name}\n" in out


@pytest.mark.parametrize("preset, message", [("clip-digits", "CLIP is a two-tower model"),
                                             ("lstm-tiny", "an LSTM has no attention to show"),
                                             ("whisper-digits", "qkv attention draws text and image models")])
def test_attention_refuses_what_it_cannot_draw_in_one_line(tmp_path, capsys, preset, message):
    # CLIP crashed with a TypeError traceback; Whisper fed token ids in as audio ("audio must be a float
    # waveform")
    import qkv

    folder = tmp_path / preset
    qkv.build(preset).save_pretrained(folder)
    assert main(["attention", str(folder), "--input", "1 2 3", "--out", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error:") and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "a.png").exists()


# -- --out under a file, or a folder ----------------------------------------------------------------------
def test_attention_out_under_a_file_is_a_one_line_error(rev_run, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["attention", str(rev_run), "--input", "01", "--out", str(afile / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err == f"qkv: error: cannot write {afile / 'x.png'}: {afile} is a file, not a folder\n"
    assert main(["attention", str(rev_run), "--input", "01", "--out", str(tmp_path)]) == 2
    assert "is a folder, not an image file" in capsys.readouterr().err


def test_ablate_out_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["ablate", "01_sqrt_dk", "--quick", "--out", str(afile)]) == 2
    assert capsys.readouterr().err == f"qkv: error: --out {afile} is a file, not a folder\n"


# -- the ViT's --input N: the first N held-out images, in order ------------------------------------------
def test_vit_attention_draws_the_first_n_held_out_images_in_order(vit_run, tmp_path, capsys, monkeypatch):
    from qkv.models import vit
    from qkv.run import load_run_task

    drawn = {}

    def capture(model, pixel_values, path, layer=-1, titles=None):
        drawn["pixels"], drawn["titles"] = pixel_values, titles
        Path(path).write_bytes(b"\x89PNG")

    monkeypatch.setattr(vit, "save_attention_overlay", capture)
    assert main(["attention", str(vit_run), "--input", "5", "--out", str(tmp_path / "v")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'v.png'}\n"
    task = load_run_task(vit_run)
    idx = task.split_indices("val")[:5]
    assert torch.equal(drawn["pixels"], task.images[idx])  # distinct, in order, not sampled
    want = [task.classes[int(i)] for i in task.labels[idx]]
    assert [t.split(" / true ")[1] for t in drawn["titles"]] == want


@pytest.mark.parametrize("n", ["0", "33", "-2"])
def test_vit_attention_refuses_n_out_of_range(vit_run, tmp_path, capsys, n):
    assert main(["attention", str(vit_run), "--input", n, "--out", str(tmp_path / "v.png")]) == 2
    err = capsys.readouterr().err
    assert f"number of held-out images to show, 1..32 (at most 32 fit one figure), got {n}" in err
    assert not (tmp_path / "v.png").exists()


# -- espeak-ng missing ------------------------------------------------------------------------------------
def test_speech_task_without_espeak_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from qkv.tasks import speech

    monkeypatch.setattr(speech.shutil, "which", lambda name, *a, **k: None)
    code = main(["train", "--task", "speech", "--model", "whisper-digits", "--out", str(tmp_path / "s"),
                 "--max-steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("qkv: error: the speech task needs the espeak-ng synthesiser")
    assert err.count("\n") == 1 and "apt-get install espeak-ng" in err


def test_attention_loads_the_model_once_and_names_unknown_symbols(gpt_run, tmp_path, capsys, monkeypatch):
    # it loaded the model twice (a second full copy alive during the second load: twice the memory of a 7B
    # folder), and read symbols outside the vocabulary as <unk> without a word (qkv generate warns, explore
    # refuses)
    import qkv

    calls = []
    real = qkv.from_pretrained
    monkeypatch.setattr(qkv, "from_pretrained", lambda *a, **k: calls.append(a) or real(*a, **k))
    capsys.readouterr()
    assert main(["attention", str(gpt_run), "--input", "12x", "--out", str(tmp_path / "a.png")]) == 0
    assert len(calls) == 1
    err = capsys.readouterr().err
    assert "qkv: warning: 1 symbol(s) outside the model's vocabulary, drawn as <unk>: 'x'" in err
