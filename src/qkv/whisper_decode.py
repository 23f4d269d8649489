"""Decoding one Whisper window as transformers' WhisperForConditionalGeneration.generate decodes it: the
special ids of a folder's generation_config.json (WhisperPrompts), Whisper's logits processors (`process`:
suppressed tokens, begin-suppressed tokens, the timestamp rules), greedy decoding, sampling and beam search
(qkv.generate.beams' bookkeeping, with Whisper's processors on the log-probabilities), and the temperature
fallback of generate_with_fallback (DecodeSettings). qkv.transcribe builds the prompt and cuts the audio.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError, check_fields, setting
from qkv.generate.beams import BeamBook
from qkv.generate.config import GenerationConfig
from qkv.models.whisper import Whisper


@dataclass
class WhisperPrompts:
    """The special ids of a Whisper folder's generation_config.json that decoding reads."""

    decoder_start: int
    eos: int
    no_timestamps: int
    lang_to_id: dict[str, int] = field(default_factory=dict)
    task_to_id: dict[str, int] = field(default_factory=dict)
    suppress: list[int] = field(default_factory=list)
    begin_suppress: list[int] = field(default_factory=list)
    max_initial_timestamp_index: int | None = None
    multilingual: bool = False

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @classmethod
    def from_folder(cls, folder: str | Path) -> WhisperPrompts:
        path = Path(folder) / "generation_config.json"
        if not path.is_file():
            raise ConfigError(f"{folder}: no generation_config.json (a Whisper folder's special token ids: "
                              "decoder_start_token_id, no_timestamps_token_id, lang_to_id, task_to_id)")
        try:
            g = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        for key in ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id"):
            if not isinstance(g.get(key), int):
                raise ConfigError(f"{path}: {key} must be one integer, got {g.get(key)!r}")
        return cls(decoder_start=g["decoder_start_token_id"], eos=g["eos_token_id"],
                   no_timestamps=g["no_timestamps_token_id"], lang_to_id=dict(g.get("lang_to_id") or {}),
                   task_to_id=dict(g.get("task_to_id") or {}), suppress=list(g.get("suppress_tokens") or []),
                   begin_suppress=list(g.get("begin_suppress_tokens") or []),
                   max_initial_timestamp_index=g.get("max_initial_timestamp_index"),
                   multilingual=bool(g.get("is_multilingual", bool(g.get("lang_to_id")))))


def timestamp_rules(seq: list[int], scores: Tensor, p: WhisperPrompts, first: bool) -> None:
    """WhisperTimeStampLogitsProcessor on one row's generated tokens `seq` (in place on scores (V,))."""
    begin, inf = p.timestamp_begin, float("-inf")
    scores[p.no_timestamps] = inf
    last_ts = len(seq) >= 1 and seq[-1] >= begin
    penultimate_ts = len(seq) < 2 or seq[-2] >= begin
    if last_ts:
        if penultimate_ts:
            scores[begin:] = inf
        else:
            scores[:p.eos] = inf
    stamps = [t for t in seq if t >= begin]
    lowest = begin if not stamps else stamps[-1] if (last_ts and not penultimate_ts) else stamps[-1] + 1
    scores[begin:lowest] = inf
    if first:
        scores[:begin] = inf
        if p.max_initial_timestamp_index is not None:
            scores[begin + p.max_initial_timestamp_index + 1:] = inf
    logprobs = torch.log_softmax(scores.float(), dim=-1)
    if logprobs[begin:].logsumexp(-1) > logprobs[:begin].max():
        scores[:begin] = inf


def process(seq: list[int], logits: Tensor, p: WhisperPrompts, timestamps: bool) -> Tensor:
    """The logits processors of transformers' Whisper generate, in its order, on (V,) logits."""
    scores = logits.float().clone()
    first = not seq
    if first and p.begin_suppress:
        scores[p.begin_suppress] = float("-inf")
    if p.suppress:
        scores[p.suppress] = float("-inf")
    if timestamps:
        timestamp_rules(seq, scores, p, first)
    return scores


@dataclass
class DecodeSettings:
    """How a window is decoded, as transformers' Whisper generate takes it (generate_with_fallback): each
    temperature in turn, 0 = greedy (or beam search with num_beams > 1), above 0 = sampling; the next one is
    tried when the result repeats itself (its tokens' zlib compression ratio above
    compression_ratio_threshold) or is unlikely (average log-probability below logprob_threshold; a beam's
    length-penalised score), unless the window is silence (also no_speech_prob above no_speech_threshold:
    then the window gives no tokens)."""

    # the CLI's --temperature is one comma-separated list (TranscribeArgs.temperature, parse_temperatures)
    temperatures: tuple[float, ...] = setting((0.0,), "temperatures tried in turn (0 = greedy / beams)",
                                              flag=False)
    num_beams: int = setting(1, "beam search at temperature 0", ge=1, note="1 = greedy")
    length_penalty: float = setting(1.0, "beam score = sum log p / length ** this")
    compression_ratio_threshold: float | None = setting(
        None, "fall back to the next temperature above this zlib ratio of a window's tokens (e.g. 2.4)", ge=0)
    logprob_threshold: float | None = setting(None, "fall back below this average token log-probability "
                                                    "(e.g. -1.0)")
    no_speech_threshold: float | None = setting(
        None, "a window is silence (no text) above this <|nocaptions|> probability when also below "
              "--logprob-threshold (e.g. 0.6)", ge=0, le=1)
    seed: int | None = setting(None, "the seed of the fallback's sampling (temperatures above 0)")

    def __post_init__(self) -> None:
        check_fields(self, "")
        if not self.temperatures or any(not math.isfinite(t) or t < 0 for t in self.temperatures):
            raise ConfigError(f"--temperature must be one or more numbers >= 0, got "
                              f"{list(self.temperatures)}")
        if self.no_speech_threshold is not None and self.logprob_threshold is None:
            raise ConfigError("--no-speech-threshold needs --logprob-threshold (a window is silence when "
                              "both say so)")


def parse_temperatures(text: str) -> tuple[float, ...]:
    """--temperature "0,0.2,0.4" -> (0.0, 0.2, 0.4)."""
    try:
        return tuple(float(t) for t in text.split(","))
    except ValueError:
        raise ConfigError(f"--temperature {text!r}: give numbers separated by commas, e.g. 0,0.2,0.4"
                          ) from None


@dataclass
class Attempt:
    tokens: list[int]  # generated, the end-of-text token included when reached
    logprob: float  # average log-probability of the tokens (greedy, sampling) or the beam's score


def compression_ratio(tokens: list[int], vocab_size: int) -> float:
    """Bytes of the tokens (little-endian, as few bytes as the vocabulary needs) over their zlib size."""
    width = int(math.log2(vocab_size) / 8) + 1
    raw = b"".join(t.to_bytes(width, "little") for t in tokens)
    return len(raw) / len(zlib.compress(raw))


@torch.no_grad()
def sample_or_greedy(model: Whisper, source: Any, prompt: list[int], p: WhisperPrompts, timestamps: bool,
                     n: int, temperature: float, generator: torch.Generator | None) -> Attempt:
    """One window's tokens, greedy (temperature 0) or drawn from softmax(scores / temperature)."""
    device = source.memory.device
    cache = model.make_cache(1, len(prompt) + n)
    logits, _ = model.prefill(torch.tensor([prompt], device=device), cache, source=source)
    seq: list[int] = []
    total = 0.0
    while len(seq) < n:
        scores = process(seq, logits[0], p, timestamps)
        if temperature > 0:
            probs = torch.softmax(scores / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(scores.argmax())
        total += float(torch.log_softmax(scores, dim=-1)[token])
        seq.append(token)
        if token == p.eos:
            break
        logits = model.step(torch.tensor([[token]], device=device), cache)
    return Attempt(seq, total / max(1, len(seq)))


@torch.no_grad()
def beam_search(model: Whisper, source: Any, prompt: list[int], p: WhisperPrompts, timestamps: bool, n: int,
                settings: DecodeSettings) -> Attempt:
    """transformers' beam search with Whisper's processors on the log-probabilities (early_stopping False, its
    default): the best hypothesis and its length-penalised score."""
    K, device = settings.num_beams, source.memory.device
    cfg = GenerationConfig(num_beams=K, length_penalty=settings.length_penalty, early_stopping=False)
    book = BeamBook(1, cfg, n, {p.eos}, p.eos)
    cache = model.make_cache(1, len(prompt) + n)
    logits, _ = model.prefill(torch.tensor([prompt], device=device), cache, source=source)
    scores = torch.zeros(1, 1)
    seqs: list[list[int]] = [[]]
    for step in range(n):
        logp = torch.stack([process(seq, torch.log_softmax(row.float(), -1), p, timestamps)
                            for seq, row in zip(seqs, logits)])  # (Kc, V)
        cand = (logp + scores.view(-1, 1)).view(-1)
        top, flat = cand.topk(min(2 * K, cand.numel()))
        V = logp.shape[-1]
        generated = torch.tensor(seqs, dtype=torch.long)  # (Kc, step)
        beams = book.advance([top.tolist()], [(flat // V).tolist()], [(flat % V).tolist()], len(seqs),
                             generated, step + 1)
        if book.done[0] or step == n - 1:
            if not book.done[0]:
                pairs = zip(beams.sources[0].tolist(), beams.tokens[0].tolist())
                book.close(beams.scores, torch.tensor([seqs[s] + [t] for s, t in pairs]))
            break
        rows = beams.sources[0]
        seqs = [seqs[s] + [t] for s, t in zip(rows.tolist(), beams.tokens[0].tolist())]
        scores = beams.scores[0]
        cache.reorder(rows.to(device))
        logits = model.step(beams.tokens[0].view(-1, 1).to(device), cache)
    best, score = book.best(torch.device("cpu"))
    return Attempt(best[0].tolist(), float(score[0]))


@torch.no_grad()
def no_speech_probability(model: Whisper, source: Any, p: WhisperPrompts) -> float:
    """The probability of <|nocaptions|> (the id before <|notimestamps|>) right after <|startoftranscript|>,
    from the raw logits (transformers' WhisperNoSpeechDetection)."""
    ids = torch.tensor([[p.decoder_start]], device=source.memory.device)
    logits, _ = model.prefill(ids, None, source=source)
    return float(torch.softmax(logits[0].float(), -1)[p.no_timestamps - 1])


def decode_with_fallback(model: Whisper, source: Any, prompt: list[int], p: WhisperPrompts, timestamps: bool,
                         n: int, settings: DecodeSettings) -> list[int] | None:
    """A window's generated tokens after the temperature fallback; None when it is skipped as silence."""
    generator = None
    if any(t > 0 for t in settings.temperatures):
        generator = torch.Generator(device=source.memory.device)
        generator.manual_seed(settings.seed if settings.seed is not None else torch.seed())
    no_speech = (no_speech_probability(model, source, p) if settings.no_speech_threshold is not None else 0.0)
    for i, t in enumerate(settings.temperatures):
        if t == 0 and settings.num_beams > 1:
            a = beam_search(model, source, prompt, p, timestamps, n, settings)
        else:
            a = sample_or_greedy(model, source, prompt, p, timestamps, n, t, generator)
        limit = settings.compression_ratio_threshold
        again = limit is not None and compression_ratio(a.tokens, model.config.vocab_size) > limit
        unlikely = settings.logprob_threshold is not None and a.logprob < settings.logprob_threshold
        again = again or unlikely
        if unlikely and settings.no_speech_threshold is not None and no_speech > settings.no_speech_threshold:
            return None
        if not again or i == len(settings.temperatures) - 1:
            return a.tokens
    return None  # pragma: no cover  (the loop returns at its last temperature)


__all__ = ["Attempt", "DecodeSettings", "WhisperPrompts", "beam_search", "compression_ratio",
           "decode_with_fallback", "no_speech_probability", "parse_temperatures", "process",
           "sample_or_greedy", "timestamp_rules"]
