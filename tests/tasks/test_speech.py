"""espeak-ng speech task: a clear error without espeak-ng; with it (skipped otherwise), synthesis, held-out
voices and cached pools."""

import shutil

import pytest

from qkv.config import ConfigError
from qkv.tasks import build_task
from qkv.tasks.speech import TEST_VOICES, TRAIN_VOICES, EspeakMissingError

HAVE_ESPEAK = shutil.which("espeak-ng") is not None


def test_voices_held_out():
    assert not set(TRAIN_VOICES) & set(TEST_VOICES)
    train_accents = {v.split("+")[0] for v in TRAIN_VOICES}
    assert not train_accents & {v.split("+")[0] for v in TEST_VOICES}
    # nor variants
    assert not {v.split("+")[1] for v in TRAIN_VOICES} & {v.split("+")[1] for v in TEST_VOICES}
    with pytest.raises(ConfigError, match="both in train and test"):
        build_task("speech", family="whisper", test_voices=[TRAIN_VOICES[0]])


def test_missing_espeak_says_how_to_install(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(EspeakMissingError, match="apt-get install espeak-ng"):
        build_task("speech", family="whisper")


@pytest.mark.skipif(not HAVE_ESPEAK, reason="espeak-ng is not installed (apt-get install espeak-ng)")
def test_speech_pool_batches(tmp_path):
    task = build_task("speech", family="whisper", pool_size=4, test_pool_size=2, cache_dir=str(tmp_path))
    b = task.batch(0, 3)
    assert b["audio"].shape == (3, 48000) and float(b["audio"].abs().max()) > 0.05
    assert list(tmp_path.glob("speech/train-*.npz"))
    again = build_task("speech", family="whisper", pool_size=4, test_pool_size=2, cache_dir=str(tmp_path))
    assert (again.batch(0, 3)["audio"] == b["audio"]).all()  # same pool from the cache, same augmentation
    texts, clips = task.pool("val")
    assert len(texts) == 2 and all(len(t) == 4 and t.isdigit() for t in texts)


def test_augmentation_options_validated():
    with pytest.raises(ConfigError, match=r"task.speed_perturb must be in \[0, 1\), got 1.5"):
        build_task("speech", family="whisper", speed_perturb=1.5)
    with pytest.raises(ConfigError, match="task.freq_masks must be at least 0, got -1"):
        build_task("speech", family="whisper", freq_masks=-1)


@pytest.mark.skipif(not HAVE_ESPEAK, reason="espeak-ng is not installed (apt-get install espeak-ng)")
def test_augmentation_train_only_deterministic_and_cache_shared(tmp_path):
    common = dict(family="whisper", pool_size=4, test_pool_size=2, cache_dir=str(tmp_path))
    aug = dict(speed_perturb=0.2, time_masks=2, time_mask_seconds=0.1, freq_masks=2, freq_mask_hz=1000.0)
    plain = build_task("speech", **common)
    task = build_task("speech", **common, **aug)
    assert not (task.batch(0, 3)["audio"] == plain.batch(0, 3)["audio"]).all()  # train clips change
    assert (task.batch(0, 2, "val")["audio"] == plain.batch(0, 2, "val")["audio"]).all()  # val never does
    again = build_task("speech", **common, **aug)
    assert (again.batch(5, 3)["audio"] == task.batch(5, 3)["audio"]).all()  # deterministic in (seed, index)
    assert len(list(tmp_path.glob("speech/*.npz"))) == 2  # per-batch options reuse the same rendered pools


@pytest.mark.skipif(not HAVE_ESPEAK, reason="espeak-ng is not installed (apt-get install espeak-ng)")
def test_perturbations_do_what_they_say(tmp_path):
    import random

    import numpy as np

    sr = 16000
    x = np.sin(2 * np.pi * 1000 * np.arange(sr) / sr).astype(np.float32)  # 1 s of a 1 kHz tone
    common = dict(family="whisper", pool_size=1, test_pool_size=1, cache_dir=str(tmp_path))
    fast = build_task("speech", **common, speed_perturb=0.3)
    for seed in range(5):  # resampling by f in [0.7, 1.3]: length len/f, the tone moves to 1000 * f Hz
        y = fast._perturb(x, random.Random(seed))
        f = len(x) / len(y)
        assert 0.69 < f < 1.31
        peak_hz = np.argmax(np.abs(np.fft.rfft(y))) * sr / len(y)
        assert abs(peak_hz - 1000 * f) < 5
    notch = build_task("speech", **common, freq_masks=1, freq_mask_hz=8000.0)
    energies = [np.sum(notch._perturb(x, random.Random(s)) ** 2) / np.sum(x**2) for s in range(20)]
    assert min(energies) < 0.01 and max(energies) > 0.99  # a band over 1 kHz removes the tone, others keep it
    gaps = build_task("speech", **common, time_masks=1, time_mask_seconds=0.5)
    y = gaps._perturb(x, random.Random(0))
    assert np.sum(y == 0) > np.sum(x == 0) and np.array_equal(y[y != 0], x[y != 0])  # zeroed, else untouched


def test_pool_cache_round_trips_without_leftovers(tmp_path, monkeypatch):
    """The rendered pool is written once (atomically, no temporary file left) and read back unchanged."""
    import numpy as np

    from qkv.tasks.speech import SpeechTask

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/espeak-ng")  # never run: the pool is stubbed
    clips = [np.arange(5, dtype=np.float32), np.arange(3, dtype=np.float32) - 1]
    monkeypatch.setattr(SpeechTask, "_render_pool", lambda self, split: (["12", "345"], clips))
    task = build_task("speech", family="whisper", cache_dir=str(tmp_path))
    task.pool("train")
    assert [p.name.endswith(".npz") for p in (tmp_path / "speech").iterdir()] == [True]
    texts, again = build_task("speech", family="whisper", cache_dir=str(tmp_path)).pool("train")
    assert texts == ["12", "345"] and all((a == b).all() for a, b in zip(again, clips))
