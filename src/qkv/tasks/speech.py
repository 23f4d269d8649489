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
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from qkv.config import setting
from qkv.storage import atomic_write
from qkv.tasks.base import register_task, rng_for
from qkv.tasks.digits import DIGIT_WORDS
from qkv.tasks.dtmf import AudioDigitsTask
from qkv.tasks.options import check_option, check_options
from qkv.tasks.tokenizers import Tokenizer

# Training voices: 5 accents x 28 espeak-ng variants (140 voices). Speaker variety is what generalises to
# unseen voices: 12 voices gave 11.9% held-out WER, these 140 (with the train-only augmentation) 1.0%. The
# test voices' accents (nyc, Lancaster, West Midlands) and variants (m4, m8, f1, f3) occur nowhere in
# training.
TRAIN_ACCENTS = ["en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029"]
TRAIN_VARIANTS = ["m1", "m2", "m3", "m5", "m6", "m7", "f2", "f4", "f5", "klatt", "klatt2",
                  "klatt3", "Alex", "Andy",
                  "Annie", "adam", "david", "ed", "edward", "john", "linda", "max", "michael", "paul",
                  "robert", "steph", "travis", "zac"]
TRAIN_VOICES = [f"{a}+{v}" for v in TRAIN_VARIANTS for a in TRAIN_ACCENTS]
TEST_VOICES = ["en-us-nyc+m4", "en-us-nyc+f3", "en-gb-x-gbclan+m8", "en-gb-x-gbcwmd+f1"]


class EspeakMissingError(FileNotFoundError, RuntimeError):
    """espeak-ng is not installed: a missing program, so a user error (FileNotFoundError: the CLI prints one
    line with the install instruction and exits 2); still a RuntimeError for code that caught it as one."""


def espeak_binary() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise EspeakMissingError("the speech task needs the espeak-ng synthesiser: install it with "
                                 "`apt-get install espeak-ng` (Debian/Ubuntu) or `brew install espeak-ng`; "
                                 "the dtmf task needs nothing installed")
    return exe


def synthesize(text: str, voice: str, speed: int, pitch: int, sample_rate: int = 16000) -> np.ndarray:
    """espeak-ng's rendering of `text` as float32 samples in [-1, 1] at `sample_rate`."""
    from scipy.signal import resample_poly  # noqa: PLC0415  (scipy: an optional extra, for resampling)

    proc = subprocess.run([espeak_binary(), "-v", voice, "-s", str(speed), "-p", str(pitch),
                           "--stdout", text],
                          capture_output=True, check=False, timeout=60)
    if proc.returncode != 0 or len(proc.stdout) < 44:
        raise RuntimeError(f"espeak-ng failed for voice {voice!r}: "
                           f"{proc.stderr.decode(errors='replace').strip()}")
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
    min_digits: int = setting(4, "fewest digits spoken per clip", ge=1)
    max_digits: int = setting(4, "most digits spoken per clip")
    sample_rate: int = setting(16000, "samples per second")
    clip_seconds: float = setting(3.0, "every clip is padded to this length (the model's audio window)")
    min_speed: int = setting(130, "slowest espeak-ng speech, in words per minute", gt=0)
    max_speed: int = setting(200, "fastest espeak-ng speech, in words per minute")
    min_pitch: int = setting(25, "lowest espeak-ng pitch", ge=0)
    max_pitch: int = setting(75, "highest espeak-ng pitch", le=99)
    min_snr_db: float = setting(10.0, "lowest signal-to-noise ratio of the added noise, in dB")
    max_snr_db: float = setting(40.0, "highest signal-to-noise ratio of the added noise, in dB")
    train_voices: list[str] = setting(TRAIN_VOICES, "espeak-ng voices of the training clips")
    test_voices: list[str] = setting(TEST_VOICES, "espeak-ng voices of the held-out clips (none in training)")
    pool_size: int = setting(3000, "training clips rendered once, reused with fresh noise/gain/offset", ge=1)
    test_pool_size: int = setting(400, "held-out clips rendered", ge=1)
    cache_dir: str | None = setting(None, "rendered clips' folder", none="$QKV_CACHE or ~/.cache/qkv/speech")
    seed: int = setting(0, "seeds the rendered pools and the batch streams")
    val_fraction: float = setting(0.1, "share of the digit strings (by hash) held out", gt=0, lt=1)
    # train-split augmentation on top of gain/offset/noise (0 = off; val clips never get these):
    speed_perturb: float = setting(0.0, "resample by a factor in [1 - p, 1 + p] (tempo, pitch)", ge=0, lt=1)
    time_masks: int = setting(0, "SpecAugment-style: zero this many spans of up to time_mask_seconds", ge=0)
    time_mask_seconds: float = setting(0.05, "longest zeroed span", ge=0, unit="s")
    freq_masks: int = setting(0, "SpecAugment-style: zero this many bands of up to freq_mask_hz each", ge=0)
    freq_mask_hz: float = setting(400.0, "widest zeroed band", ge=0, unit="Hz")

    def validate(self) -> None:
        check_options(self, ("min_digits", "max_digits"), ("min_speed", "max_speed"),
                     ("min_pitch", "max_pitch"))
        for key in ("train_voices", "test_voices"):
            check_option(bool(getattr(self, key)), key, "must name at least one voice")
        both = sorted(set(self.train_voices) & set(self.test_voices))
        check_option(not both, "test_voices", f": voices both in train and test: {both}")

    @property
    def n_samples(self) -> int:
        return int(round(self.clip_seconds * self.sample_rate))


# options applied per batch, not at rendering: changing them must not invalidate the cached pools
_PER_BATCH_OPTIONS = ("cache_dir", "min_snr_db", "max_snr_db", "speed_perturb", "time_masks",
                      "time_mask_seconds", "freq_masks", "freq_mask_hz")


class SpeechTask(AudioDigitsTask):
    def __init__(self, options: SpeechOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(options, family, tokenizer)
        espeak_binary()  # fail now, with the install instruction, not at the first batch
        self._pools: dict[str, tuple[list[str], list[np.ndarray]]] = {}

    # -- the rendered pools -------------------------------------------------------------------------------
    def _cache_file(self, split: str) -> Path:
        o = self.options
        root = Path(o.cache_dir or os.environ.get("QKV_CACHE", Path.home() / ".cache" / "qkv")) / "speech"
        keys = {k: v for k, v in asdict(o).items() if k not in _PER_BATCH_OPTIONS}
        digest = hashlib.sha256(json.dumps({"split": split, **keys},
                                           sort_keys=True).encode()).hexdigest()[:16]
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

            def write(tmp: str) -> None:
                with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a name
                    np.savez(f, texts=np.array(texts), audio=np.concatenate(clips),
                             ends=np.cumsum([len(c) for c in clips]))

            atomic_write(path, write)
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
            x = self._perturb(clips[i], rng) if split == "train" else clips[i]
            out.append((texts[i], self._augment(x, rng)))
        return out

    def _perturb(self, x: np.ndarray, rng: random.Random) -> np.ndarray:
        """Train-only augmentation of the clean clip (before gain/offset/noise); draws nothing when off, so
        the default options leave the random stream, and so the batches, untouched."""
        o = self.options
        if o.speed_perturb > 0:  # linear-interpolation resampling: factor > 1 is faster and higher
            factor = rng.uniform(1 - o.speed_perturb, 1 + o.speed_perturb)
            n = min(int(len(x) / factor), o.n_samples - int(0.1 * o.sample_rate))
            x = np.interp(np.arange(n) * factor, np.arange(len(x)), x).astype(np.float32)
        if o.freq_masks > 0:  # zero random bands of the spectrum (SpecAugment's frequency masks, on the wave)
            spec = np.fft.rfft(x)
            hz_per_bin = o.sample_rate / 2 / (len(spec) - 1)
            for _ in range(o.freq_masks):
                width = rng.uniform(0, o.freq_mask_hz)
                lo = rng.uniform(0, o.sample_rate / 2 - width)
                spec[int(lo / hz_per_bin):int((lo + width) / hz_per_bin) + 1] = 0
            x = np.fft.irfft(spec, n=len(x)).astype(np.float32)
        if o.time_masks > 0:  # zero random spans (SpecAugment's time masks; noise is added afterwards)
            x = x.copy()
            for _ in range(o.time_masks):
                width = int(rng.uniform(0, o.time_mask_seconds) * o.sample_rate)
                start = rng.randint(0, max(0, len(x) - width))
                x[start:start + width] = 0
        return x

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


register_task("speech", SpeechOptions, SpeechTask, ("audio",),
              "digit strings spoken by espeak-ng (needs `apt-get install espeak-ng`), test voices held out",
              default_family="whisper", requires=("scipy",))
