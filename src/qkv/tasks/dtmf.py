"""Speech-recognition stand-in that needs nothing installed: DTMF telephone tones for digit strings.

Each digit d is the sum of two sines, a row frequency and a column frequency of the keypad (ITU-T Q.23):

            1209 Hz  1336 Hz  1477 Hz
    697 Hz     1        2        3
    770 Hz     4        5        6
    852 Hz     7        8        9
    941 Hz              0

A clip = random leading silence, then for each digit a tone of random duration (`min_tone_ms`..`max_tone_ms`),
random level and slight detuning, followed by a random gap; plus white noise at a random SNR (`min_snr_db`..
`max_snr_db`), at `sample_rate` Hz, zero-padded to `clip_seconds`. The model (family whisper) hears the
waveform and writes the digit string.

Batch: {"audio": (B, N) float waveform, "labels": (B, L) digit ids + <eos>, -100 on padding}.
Held-out split: a digit string is "val" iff its hash falls in the first `val_fraction` of the hash range
(base.in_val_split), so evaluation strings are never heard in training, whatever their rendering.
Evaluation: greedy decoding through qkv.generate; exact-string accuracy and the digit error rate (WER with
each digit a word: edit distance / reference length).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.generate import generate
from qkv.tasks.base import Task, check_split, in_val_split, model_device, pad_rows, register_task, rng_for
from qkv.tasks.options import check_option, check_options
from qkv.tasks.tokenizers import EOS, CharTokenizer, Tokenizer

KEYPAD = {"1": (697, 1209), "2": (697, 1336), "3": (697, 1477), "4": (770, 1209), "5": (770, 1336),
          "6": (770, 1477), "7": (852, 1209), "8": (852, 1336), "9": (852, 1477), "0": (941, 1336)}


def edit_distance(a: list[Any], b: list[Any]) -> int:
    """Levenshtein distance (substitutions, insertions, deletions all cost 1)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def word_error_rate(hyps: list[list[Any]], refs: list[list[Any]]) -> float:
    """Corpus WER: total edit distance / total reference words."""
    errors = sum(edit_distance(h, r) for h, r in zip(hyps, refs))
    return errors / max(1, sum(len(r) for r in refs))


@dataclass
class DTMFOptions:
    min_digits: int = setting(1, "fewest digits per clip", ge=1)
    max_digits: int = setting(6, "most digits per clip")
    sample_rate: int = setting(16000, "samples per second")
    clip_seconds: float = setting(2.0, "every clip is padded to this length (the model's audio window)")
    min_tone_ms: float = setting(40.0, "shortest tone, in ms", gt=0)
    max_tone_ms: float = setting(120.0, "longest tone, in ms")
    min_gap_ms: float = setting(30.0, "shortest silence after a tone, in ms", ge=0)
    max_gap_ms: float = setting(100.0, "longest silence after a tone, in ms")
    min_snr_db: float = setting(0.0, "lowest signal-to-noise ratio of the added noise, in dB")
    max_snr_db: float = setting(30.0, "highest signal-to-noise ratio of the added noise, in dB")
    seed: int = setting(0, "seeds the train/val batch streams and the evaluation set")
    val_fraction: float = setting(0.1, "share of the digit strings (by hash) held out", gt=0, lt=1)

    def validate(self) -> None:
        check_options(self, ("min_digits", "max_digits"), ("min_tone_ms", "max_tone_ms"),
                     ("min_gap_ms", "max_gap_ms"), ("min_snr_db", "max_snr_db"))
        worst = 0.2 + self.max_digits * (self.max_tone_ms + self.max_gap_ms) / 1000
        check_option(worst <= self.clip_seconds, "clip_seconds",
                     f"({self.clip_seconds}) is below what {self.max_digits} digits can last ({worst:.2f} s)")

    @property
    def n_samples(self) -> int:
        return int(round(self.clip_seconds * self.sample_rate))


def dtmf_clip(digits: str, rng: random.Random, o: DTMFOptions) -> np.ndarray:
    """One noisy DTMF rendering of `digits` as a float32 waveform of o.n_samples samples."""
    sr = o.sample_rate
    parts = [np.zeros(int(rng.uniform(0.0, 0.2) * sr), dtype=np.float32)]
    for d in digits:
        lo, hi = KEYPAD[d]
        n = int(rng.uniform(o.min_tone_ms, o.max_tone_ms) * sr / 1000)
        t = np.arange(n) / sr
        detune = 1 + rng.uniform(-0.015, 0.015)  # Q.24 allows +-1.5 %
        tone = np.sin(2 * math.pi * lo * detune * t + rng.uniform(0, 6.3)) \
            + rng.uniform(0.7, 1.0) * np.sin(2 * math.pi * hi * detune * t + rng.uniform(0, 6.3))
        parts.append((rng.uniform(0.1, 0.5) * tone).astype(np.float32))
        parts.append(np.zeros(int(rng.uniform(o.min_gap_ms, o.max_gap_ms) * sr / 1000), dtype=np.float32))
    x = np.concatenate(parts)[: o.n_samples]
    x = np.pad(x, (0, o.n_samples - len(x)))
    power = float(np.mean(x[x != 0] ** 2)) if np.any(x) else 1e-4
    snr = rng.uniform(o.min_snr_db, o.max_snr_db)
    noise = np.random.default_rng(rng.getrandbits(32)).standard_normal(o.n_samples).astype(np.float32)
    return (x + noise * math.sqrt(power / 10 ** (snr / 10))).astype(np.float32)


class AudioDigitsTask(Task):
    """Shared by DTMF and espeak-ng speech: audio of a digit string -> the string. Subclasses implement
    `render(digits, rng, split)` and set `options` with sample_rate / clip_seconds / min_digits /
    max_digits."""

    kinds = ("audio",)
    metrics = {"exact_match": "max", "wer": "min"}

    def __init__(self, options: Any, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options, self.family = options, family
        self.tokenizer = tokenizer or CharTokenizer("0123456789")

    def render(self, digits: str, rng: random.Random, split: str) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def digit_string(self, rng: random.Random, split: str) -> str:
        o = self.options
        for _ in range(10_000):
            s = "".join(rng.choice("0123456789") for _ in range(rng.randint(o.min_digits, o.max_digits)))
            if in_val_split(s, o.val_fraction) == (split == "val"):
                return s
        raise ConfigError("could not draw a digit string for this split; widen min_digits..max_digits")

    def examples(self, index: int, batch_size: int, split: str) -> list[tuple[str, np.ndarray]]:
        check_split(split)
        rng = rng_for(self.options.seed, split, index, type(self).__name__)
        out = []
        for _ in range(batch_size):
            s = self.digit_string(rng, split)
            out.append((s, self.render(s, rng, split)))
        return out

    def collate(self, examples: list[tuple[str, np.ndarray]]) -> dict[str, Tensor]:
        audio = torch.from_numpy(np.stack([a for _, a in examples]))
        labels = pad_rows([self.tokenizer.encode(s) + [EOS] for s, _ in examples], -100)
        return {"audio": audio, "labels": labels}

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        return self.collate(self.examples(index, batch_size, split))

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        o, tok = self.options, self.tokenizer
        hop = 160 * o.sample_rate // 16000  # 10 ms frames, like Whisper
        n_fft = 400 * o.sample_rate // 16000  # 25 ms windows
        frames = o.n_samples // hop
        # the audio kind's needs: the text side in shared names, the front end in the audio fields
        return {"vocab_size": tok.vocab_size, "context_length": o.max_digits + 2,
                "sample_rate": o.sample_rate,
                "hop_length": hop, "n_fft": n_fft, "n_audio_ctx": (frames + 1) // 2,
                "pad_token_id": tok.pad_id, "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}

    def eval_examples(self, n: int) -> list[tuple[str, np.ndarray]]:
        """A fixed held-out set: the val stream from index 0, in chunks of 64."""
        out: list[tuple[str, np.ndarray]] = []
        i = 0
        while len(out) < n:
            out.extend(self.examples(i, 64, "val"))
            i += 1
        return out[:n]

    @torch.no_grad()
    def transcribe(self, model: torch.nn.Module, audio: Tensor, batch_size: int = 64) -> list[str]:
        dev = model_device(model)
        hyps = []
        for s in range(0, len(audio), batch_size):
            ids = generate(model, audio[s:s + batch_size].to(dev), self.options.max_digits + 1,
                           eos_token_id=EOS)
            for row in ids.tolist():
                row = row[: row.index(EOS)] if EOS in row else row
                hyps.append(self.tokenizer.decode(row))
        return hyps

    def evaluate(self, model: torch.nn.Module, n: int = 500, batch_size: int = 64) -> dict[str, float]:
        """Greedy transcription of n held-out clips: exact-string accuracy and digit error rate (WER)."""
        ex = self.eval_examples(n)
        refs = [s for s, _ in ex]
        hyps = self.transcribe(model, torch.from_numpy(np.stack([a for _, a in ex])), batch_size)
        exact = sum(h == r for h, r in zip(hyps, refs)) / max(1, len(refs))
        return {"exact_match": exact,
                "wer": word_error_rate([list(h) for h in hyps], [list(r) for r in refs]),
                "n": float(len(refs))}

    def samples(self, model: torch.nn.Module, n: int = 5) -> list[str]:
        ex = self.eval_examples(n)
        hyps = self.transcribe(model, torch.from_numpy(np.stack([a for _, a in ex])))
        return [f"audio of {r} -> {h}" + ("  (ok)" if h == r else "") for (r, _), h in zip(ex, hyps)]


class DTMFTask(AudioDigitsTask):
    def render(self, digits: str, rng: random.Random, split: str) -> np.ndarray:
        return dtmf_clip(digits, rng, self.options)


register_task("dtmf", DTMFOptions, DTMFTask, ("audio",),
              "DTMF telephone tones of digit strings with noise and random timing -> the digits (speech "
              "stand-in)",
              default_family="whisper")
