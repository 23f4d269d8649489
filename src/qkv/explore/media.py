"""Images and audio into the explorer: an image's pixels for the page, a WAV file (or a run's rendered DTMF
digits) at a Whisper model's sample rate, and how audio maps onto encoder frames. The built-in sample images
come from qkv.tasks, so adapter.py reads them."""

from __future__ import annotations

import base64
import io
import math
import random
import wave

import numpy as np
import torch
from torch import Tensor

from qkv.explore.loaded import ExploreError, Loaded, config


# -- images and audio --------------------------------------------------------------------------------------
def pixels_for_display(px: Tensor) -> list[list[list[float]]]:
    """(H, W, 3) floats in [0, 1] for a canvas: min-max scaled (the model's normalisation is unknown here)."""
    x = px[0].float()
    x = (x - x.min()) / (x.max() - x.min()).clamp_min(1e-8)
    if x.shape[0] == 1:
        x = x.repeat(3, 1, 1)
    return x[:3].permute(1, 2, 0).mul(1000).round().div(1000).tolist()


def audio(ld: Loaded, text: str, wav_base64: str | None) -> tuple[Tensor, str]:
    """(1, N) waveform at the model's sample rate: a WAV file sent by the page, or, for a run whose task
    renders its own audio (DTMF digits), the typed text rendered by the task."""
    c = config(ld)
    if wav_base64:
        return _read_wav(base64.b64decode(wav_base64), c.sample_rate, c.n_samples), "uploaded WAV"
    if ld.task is not None and hasattr(ld.task, "render"):
        text = text.strip()
        if not text:
            raise ExploreError("the input is empty: type the digits to render as audio")
        alphabet = set(getattr(ld.task.tokenizer, "symbols", "0123456789"))
        bad = sorted(set(text) - alphabet)
        if bad:
            raise ExploreError(f"this task renders only {''.join(sorted(alphabet))}; unknown: "
                               f"{' '.join(map(repr, bad))}")
        most = getattr(getattr(ld.task, "options", None), "max_digits", None)
        # the task cuts its clip: the last digits would not be heard
        if most is not None and len(text) > most:
            raise ExploreError(f"{len(text)} digits: type at most {most} (the task's max_digits; a longer "
                               "string "
                               f"may not fit its {c.n_samples / c.sample_rate:.2f} s clip), as a longer WAV "
                               "is refused")
        samples = ld.task.render(text, random.Random(0), "val")
        clip = torch.as_tensor(samples, dtype=torch.float32)[None, : c.n_samples]
        return clip, f"{text!r} rendered by the task"
    raise ExploreError("this audio model has no task to render text: choose a WAV file")


def _read_wav(data: bytes, rate: int, max_samples: int) -> Tensor:
    try:
        with wave.open(io.BytesIO(data)) as w:
            sr, ch, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError) as e:
        raise ExploreError(f"not a PCM WAV file ({e})") from None
    if width not in (1, 2, 4):
        raise ExploreError(f"unsupported WAV sample width {width} bytes")
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
    x = np.frombuffer(raw, dtype=dtype).astype(np.float64)
    x = (x - 128.0) / 128.0 if width == 1 else x / float(2 ** (8 * width - 1))
    x = x.reshape(-1, ch).mean(1)
    if sr != rate:
        from scipy.signal import resample_poly  # noqa: PLC0415  (scipy: an optional extra, for resampling)

        g = math.gcd(sr, rate)
        x = resample_poly(x, rate // g, sr // g)
    if len(x) == 0:
        raise ExploreError("the WAV file holds no samples")
    if len(x) > max_samples:
        raise ExploreError(f"the audio is {len(x) / rate:.2f} s; this model's window is "
                           f"{max_samples / rate:.2f} s")
    return torch.tensor(x, dtype=torch.float32)[None]


def audio_frames(ld: Loaded, waveform: Tensor) -> int:
    """Encoder positions that hold the audio (the rest of the window is silence padding)."""
    c = config(ld)
    return min(int(c.n_audio_ctx), max(1, math.ceil(waveform.shape[-1] / c.hop_length / 2)))


def frame_seconds(ld: Loaded) -> float:
    c = config(ld)
    return 2 * c.hop_length / c.sample_rate
