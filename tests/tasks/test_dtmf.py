"""DTMF task: the tones carry exactly the keypad frequencies (checked with an FFT), held-out digit strings,
deterministic batches, the WER/edit-distance helpers, and model overrides that fit the clip to the window."""

import random

import numpy as np
import pytest
import torch

from qkv.config import ConfigError
from qkv.tasks import build_task
from qkv.tasks.base import in_val_split
from qkv.tasks.dtmf import KEYPAD, DTMFOptions, dtmf_clip, edit_distance, word_error_rate
from qkv.tasks.tokenizers import EOS


@pytest.mark.parametrize("digit", list("0159"))
def test_tone_has_the_keypad_frequencies(digit):
    o = DTMFOptions(min_snr_db=60, max_snr_db=60, min_tone_ms=200, max_tone_ms=200)
    x = dtmf_clip(digit, random.Random(0), o)
    spec = np.abs(np.fft.rfft(x))
    freqs = np.fft.rfftfreq(len(x), 1 / o.sample_rate)
    lo, hi = KEYPAD[digit]
    low_band, high_band = (freqs > 600) & (freqs < 1000), (freqs > 1150) & (freqs < 1700)
    f_lo = freqs[low_band][spec[low_band].argmax()]
    f_hi = freqs[high_band][spec[high_band].argmax()]
    assert abs(f_lo - lo) < 0.02 * lo and abs(f_hi - hi) < 0.02 * hi  # the tone may be detuned by 1.5 %
    near = (np.abs(freqs - f_lo) < 30) | (np.abs(freqs - f_hi) < 30)
    assert (spec[near] ** 2).sum() > 0.9 * (spec ** 2).sum()  # nearly all the energy is in the two tones


def test_batches_split_and_shapes():
    task = build_task("dtmf", family="whisper", max_digits=4)
    b = task.batch(0, 8)
    assert b["audio"].shape == (8, 32000) and b["audio"].dtype == torch.float32
    assert torch.equal(b["audio"], task.batch(0, 8)["audio"])
    strings = []
    for row in b["labels"].tolist():
        row = [t for t in row if t != -100]
        assert row[-1] == EOS
        strings.append(task.tokenizer.decode(row[:-1]))
    assert all(1 <= len(s) <= 4 and s.isdigit() and not in_val_split(s, 0.1) for s in strings)
    val = task.eval_examples(20)
    assert all(in_val_split(s, 0.1) for s, _ in val)
    with pytest.raises(ConfigError, match=r"task.clip_seconds \(2.0\) is below what 20 digits can last"):
        build_task("dtmf", family="whisper", max_digits=20)


def test_error_rates():
    assert edit_distance(list("1234"), list("1234")) == 0
    assert edit_distance(list("1234"), list("124")) == 1
    assert edit_distance(list("1234"), list("4321")) == 4
    assert edit_distance([], list("12")) == 2
    assert word_error_rate([list("12"), list("5")], [list("13"), list("56")]) == pytest.approx(2 / 4)


def test_overrides_fit_the_model_and_evaluate_runs():
    task = build_task("dtmf", family="whisper", max_digits=3, clip_seconds=1.0)
    model = task.build_model("whisper-digits", n_encoder_layers=1, n_decoder_layers=1, d_model=32, n_heads=2,
                             d_ff=64)
    assert model.config.n_samples == 16000 and model.config.n_text_ctx == 5
    b = task.batch(0, 4)
    out = model(**b)
    assert torch.isfinite(out.loss)
    m = task.evaluate(model, n=8)
    assert set(m) == {"exact_match", "wer", "n"} and m["n"] == 8
    assert len(task.samples(model, 2)) == 2
