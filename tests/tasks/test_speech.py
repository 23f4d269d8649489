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
