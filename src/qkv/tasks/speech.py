"""Spoken digit strings synthesised with espeak-ng, with voices held out for evaluation (family whisper).

Each example: a digit string ("3141") spoken as words ("three one four one") by `espeak-ng` with a voice
(accent + variant, e.g. "en-gb-scotland+f3"), a speed (words per minute) and a pitch drawn at random, read
from espeak-ng's WAV output (22,050 Hz), resampled to `sample_rate` (polyphase, scipy), given random gain,
leading silence and white noise, and zero-padded to `clip_seconds`.

Held-out voices: training clips use `train_voices` only; evaluation ("val") clips use `test_voices`, whose
accents and variants appear nowhere in training. Digit strings are also hash-split (base.in_val_split).

Synthesis costs ~30 ms a clip, so each split is rendered once into a pool (`pool_size` clips, cached as .npz
under `cache_dir`, keyed by the options) and batches draw from the pool with fresh gain/noise/offset.
espeak-ng is a system package (`apt-get install espeak-ng`); without it building this task fails with that
instruction. The DTMF task (qkv.tasks.dtmf) is the dependency-free stand-in for tests and CI.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import shutil
import subprocess
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from qkv.config import ConfigError
from qkv.tasks.base import register_task, rng_for
from qkv.tasks.digits import DIGIT_WORDS
from qkv.tasks.dtmf import AudioDigitsTask
from qkv.tasks.tokenizers import Tokenizer

TRAIN_VOICES = ["en-us+m1", "en-us+f1", "en-gb+m3", "en-gb+f3", "en-gb-scotland+m5", "en-gb-scotland+f2",
                "en-gb-x-rp+m7", "en-gb-x-rp+f4", "en-029+m2", "en-029+f5", "en-us+m6", "en-gb+klatt"]
TEST_VOICES = ["en-us-nyc+m4", "en-us-nyc+f3", "en-gb-x-gbclan+m8", "en-gb-x-gbcwmd+f1"]


class EspeakMissingError(RuntimeError):
    """espeak-ng is not installed."""


def espeak_binary() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise EspeakMissingError("the speech task needs the espeak-ng synthesiser: install it with "
                                 "`apt-get install espeak-ng` (Debian/Ubuntu) or `brew install espeak-ng`; "
                                 "the dtmf task needs nothing installed")
    return exe


def synthesize(text: str, voice: str, speed: int, pitch: int, sample_rate: int = 16000) -> np.ndarray:
    """espeak-ng's rendering of `text` as float32 samples in [-1, 1] at `sample_rate`."""
    from scipy.signal import resample_poly

    proc = subprocess.run([espeak_binary(), "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout", text],
                          capture_output=True, check=False, timeout=60)
    if proc.returncode != 0 or len(proc.stdout) < 44:
        raise RuntimeError(f"espeak-ng failed for voice {voice!r}: {proc.stderr.decode(errors='replace').strip()}")
    with wave.open(io.BytesIO(proc.stdout)) as w:  # streamed WAV: the header's length is bogus, read to EOF
        sr, width = w.getframerate(), w.getsampwidth()
        raw = w.readframes(1 << 30)
    if width != 2:
        raise RuntimeError(f"espeak-ng returned {8 * width}-bit audio; expected 16-bit")
    x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    if sr != sample_rate:
        g = math.gcd(sr, sample_rate)
        x = resample_poly(x, sample_rate // g, sr // g).astype(np.float32)
    return x


@dataclass
class SpeechOptions:
    min_digits: int = 4
    max_digits: int = 4
    sample_rate: int = 16000
    clip_seconds: float = 3.0
    min_speed: int = 130  # words per minute
    max_speed: int = 200
    min_pitch: int = 25  # espeak-ng pitch, 0..99
    max_pitch: int = 75
    min_snr_db: float = 10.0
    max_snr_db: float = 40.0
    train_voices: list[str] = field(default_factory=lambda: list(TRAIN_VOICES))
    test_voices: list[str] = field(default_factory=lambda: list(TEST_VOICES))
    pool_size: int = 3000  # training clips rendered once and reused with fresh noise/gain/offset
    test_pool_size: int = 400
    cache_dir: str | None = None  # default: $QKV_CACHE or ~/.cache/qkv/speech
    seed: int = 0
    val_fraction: float = 0.1

    def validate(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ConfigError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if set(self.train_voices) & set(self.test_voices):
            raise ConfigError(f"voices both in train and test: {sorted(set(self.train_voices) & set(self.test_voices))}")
        if not self.train_voices or not self.test_voices:
            raise ConfigError("train_voices and test_voices must be non-empty")
        if not 0 < self.min_speed <= self.max_speed or not 0 <= self.min_pitch <= self.max_pitch <= 99:
            raise ConfigError("need 0 < min_speed <= max_speed and 0 <= min_pitch <= max_pitch <= 99")
        if self.pool_size < 1 or self.test_pool_size < 1:
            raise ConfigError("pool_size and test_pool_size must be positive")

    @property
    def n_samples(self) -> int:
        return int(round(self.clip_seconds * self.sample_rate))


class SpeechTask(AudioDigitsTask):
    def __init__(self, options: SpeechOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(options, family, tokenizer)
        espeak_binary()  # fail now, with the install instruction, not at the first batch
        self._pools: dict[str, tuple[list[str], list[np.ndarray]]] = {}

    # -- the rendered pools -------------------------------------------------------------------------------
    def _cache_file(self, split: str) -> Path:
        o = self.options
        root = Path(o.cache_dir or os.environ.get("QKV_CACHE", Path.home() / ".cache" / "qkv")) / "speech"
        keys = {k: v for k, v in asdict(o).items() if k not in ("cache_dir", "min_snr_db", "max_snr_db")}
        digest = hashlib.sha256(json.dumps({"split": split, **keys}, sort_keys=True).encode()).hexdigest()[:16]
        return root / f"{split}-{digest}.npz"

    def pool(self, split: str) -> tuple[list[str], list[np.ndarray]]:
        if split in self._pools:
            return self._pools[split]
        path = self._cache_file(split)
        if path.is_file():
            data = np.load(path, allow_pickle=False)
            texts, flat, ends = list(data["texts"]), data["audio"], data["ends"]
            clips = [flat[a:b] for a, b in zip(np.r_[0, ends[:-1]], ends)]
        else:
            texts, clips = self._render_pool(split)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, texts=np.array(texts), audio=np.concatenate(clips),
                     ends=np.cumsum([len(c) for c in clips]))
            os.replace(tmp, path)
        self._pools[split] = (texts, clips)
        return texts, clips

    def _render_pool(self, split: str) -> tuple[list[str], list[np.ndarray]]:
        o = self.options
        n = o.pool_size if split == "train" else o.test_pool_size
        voices = o.train_voices if split == "train" else o.test_voices
        rng = rng_for(o.seed, split, 0, "speech-pool")
        texts, clips = [], []
        limit = o.n_samples - int(0.1 * o.sample_rate)
        while len(texts) < n:
            s = self.digit_string(rng, split)
            words = " ".join(DIGIT_WORDS[int(d)] for d in s)
            x = synthesize(words, voices[len(texts) % len(voices)], rng.randint(o.min_speed, o.max_speed),
                           rng.randint(o.min_pitch, o.max_pitch), o.sample_rate)
            nz = np.flatnonzero(np.abs(x) > 1e-3)  # trim espeak's silences; the offset is re-drawn per batch
            x = x[nz[0]:nz[-1] + 1] if len(nz) else x
            if len(x) > limit:
                continue  # too slow for the window: draw again
            texts.append(s)
            clips.append(x.astype(np.float32))
        return texts, clips

    # -- examples -----------------------------------------------------------------------------------------
    def examples(self, index: int, batch_size: int, split: str) -> list[tuple[str, np.ndarray]]:
        o = self.options
        texts, clips = self.pool(split)
        rng = rng_for(o.seed, split, index, "speech")
        out = []
        for k in range(batch_size):
            # val: walk the pool in order (a fixed test set); train: draw at random
            i = (index * batch_size + k) % len(texts) if split == "val" else rng.randrange(len(texts))
            out.append((texts[i], self._augment(clips[i], rng)))
        return out

    def _augment(self, x: np.ndarray, rng: random.Random) -> np.ndarray:
        o = self.options
        room = o.n_samples - len(x)
        start = rng.randint(0, max(0, min(room, int(0.3 * o.sample_rate))))
        y = np.zeros(o.n_samples, dtype=np.float32)
        y[start:start + len(x)] = x * rng.uniform(0.5, 1.5)
        power = float(np.mean(x**2)) + 1e-8
        snr = rng.uniform(o.min_snr_db, o.max_snr_db)
        noise = np.random.default_rng(rng.getrandbits(32)).standard_normal(o.n_samples).astype(np.float32)
        return y + noise * math.sqrt(power / 10 ** (snr / 10))


register_task("speech", SpeechOptions, SpeechTask, ("whisper",),
              "digit strings spoken by espeak-ng (needs `apt-get install espeak-ng`), test voices held out")
