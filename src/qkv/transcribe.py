"""`qkv transcribe MODEL AUDIO...`: speech to text with a Whisper folder (Hugging Face `whisper`, loaded by
interop/whisper.py).

    qkv transcribe whisper-folder talk.wav [--language en] [--task transcribe|translate] [--timestamps]
        [--format text|json|srt] [--max-new-tokens N] [--num-beams K]
        [--temperature 0,0.2,0.4,0.6,0.8,1 --compression-ratio-threshold 2.4 --logprob-threshold -1
         --no-speech-threshold 0.6]

Audio: any file soundfile reads (WAV, FLAC, OGG, ...), averaged to mono and resampled to the model's 16 kHz
(scipy's polyphase resample_poly). The model hears one window at a time (30 s for every released Whisper: its
encoder's 1500 positions x 2 frames x 10 ms). Longer audio is cut as transformers' speech-recognition pipeline
cuts it (chunk_length_s = the window, stride_length_s = a sixth of it on each side: windows every 20 s that
overlap by 10 s), each window is decoded on its own, and the windows' tokens are stitched as the pipeline's
Whisper decoder stitches them (`stitch`, a port of transformers' `_decode_asr`): inside each pair of
overlapping windows the longest run of equal tokens is found, the left window kept up to its middle and the
right window from there; with timestamps, segments are cut at the timestamp tokens and those inside the
strides are resolved the same way.

Decoding follows transformers' WhisperForConditionalGeneration.generate, greedy or beam search, with its
temperature fallback (DecodeSettings) on each window: the prompt is
<|startoftranscript|> <|language|> <|task|> [<|notimestamps|>] from the folder's generation_config.json
(lang_to_id, task_to_id, no_timestamps_token_id); without --language a multilingual model's language is the
most likely language token after <|startoftranscript|> (transformers' detect_language); the logits pass
suppress_tokens, begin_suppress_tokens (first step only) and, with --timestamps, Whisper's timestamp rules
(timestamps come in pairs, never decrease, the first token is one, at most max_initial_timestamp_index; a
timestamp is forced when the timestamps' total probability beats every text token).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.config import ConfigError
from qkv.extras import require
from qkv.interop import load_hf
from qkv.interop.tokenizer import load_hf_tokenizer
from qkv.models.whisper import Whisper, WhisperConfig
from qkv.whisper_decode import DecodeSettings, WhisperPrompts, decode_with_fallback, parse_temperatures

FORMATS = ("text", "json", "srt")
TASKS = ("transcribe", "translate")


# -- audio --------------------------------------------------------------------------------------------------
def read_audio(path: str | Path, sample_rate: int) -> np.ndarray:
    """A mono float32 waveform at `sample_rate` from any file soundfile reads; a ConfigError naming the file
    when it is missing, empty or not audio."""
    sf = require("soundfile", "reading audio files")
    resample_poly = require("scipy.signal", "resampling audio").resample_poly

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such audio file")
    try:
        data, rate = sf.read(str(p), dtype="float32", always_2d=True)
    except (RuntimeError, sf.SoundFileError) as e:  # libsndfile's "Format not recognised" and kin
        why = str(e).splitlines()[0]
        raise ConfigError(f"{path}: not an audio file soundfile can read ({why})") from None
    if data.shape[0] == 0:
        raise ConfigError(f"{path}: the audio file holds no samples")
    wave = data.mean(axis=1)
    if rate != sample_rate:
        g = math.gcd(int(rate), sample_rate)
        wave = resample_poly(wave, sample_rate // g, int(rate) // g).astype(np.float32)
    return np.ascontiguousarray(wave, dtype=np.float32)


@dataclass
class Window:
    audio: np.ndarray
    stride: tuple[float, float, float]  # (length, left stride, right stride) in seconds, as the pipeline's


def windows(wave: np.ndarray, window: int, sample_rate: int) -> list[Window]:
    """The pipeline's chunk_iter: windows of `window` samples every window - 2 * window / 6 samples."""
    stride = int(round(window / 6))
    step = window - 2 * stride
    out: list[Window] = []
    for start in range(0, len(wave), step):
        end = start + window
        chunk = wave[start:end]
        left = 0 if start == 0 else stride
        last = end >= len(wave)
        right = 0 if last else stride
        if len(chunk) > left:
            out.append(Window(chunk, (len(chunk) / sample_rate, left / sample_rate, right / sample_rate)))
        if last:
            break
    return out


# -- decoding ------------------------------------------------------------------------------------------------
def init_tokens(p: WhisperPrompts, language: int | None, task: str | None, timestamps: bool,
                given_language: bool) -> list[int]:
    """The decoder prompt, as transformers builds it: a task token when one is given, <|transcribe|> when
    only the language is given (a detected language adds none), <|notimestamps|> without timestamps."""
    out = [p.decoder_start]
    if p.multilingual:
        if language is not None:
            out.append(language)
        if task is not None or given_language:
            name = task or "transcribe"
            if name not in p.task_to_id:
                raise ConfigError(f"--task {name}: the folder's task_to_id has {sorted(p.task_to_id)}")
            out.append(p.task_to_id[name])
    if not timestamps:
        out.append(p.no_timestamps)
    return out


def kept_tokens(seq: list[int], p: WhisperPrompts, timestamps: bool) -> list[int]:
    """What transformers' Whisper generate returns of a window's tokens: without the end-of-text token, and
    with timestamps, cut after the last pair of timestamps unless the tokens end in a single one (the words
    after that pair belong to a segment the window cut off)."""
    seq = seq[:-1] if seq and seq[-1] == p.eos else list(seq)
    if not timestamps:
        return seq
    is_ts = [t >= p.timestamp_begin for t in seq]
    pairs = [i + 1 for i in range(len(seq) - 1) if is_ts[i] and is_ts[i + 1]]
    if not pairs or is_ts[-2:] == [False, True]:
        return seq
    return seq[:pairs[-1] + 1]


def language_id(p: WhisperPrompts, language: str) -> int:
    """--language en / <|en|> -> its token id (an English-only model takes none)."""
    if not p.multilingual:
        raise ConfigError("--language: this Whisper folder is English-only (no lang_to_id)")
    token = language if language.startswith("<|") else f"<|{language.lower()}|>"
    if token not in p.lang_to_id:
        known = ", ".join(sorted(t.strip("<|>") for t in p.lang_to_id)[:20])
        raise ConfigError(f"--language {language}: not a language of this model ({known}, ...)")
    return p.lang_to_id[token]


@torch.no_grad()
def detect_language(model: Whisper, source: Any, p: WhisperPrompts) -> int:
    """The most likely language token right after <|startoftranscript|>."""
    ids = torch.tensor([[p.decoder_start]], device=source.memory.device)
    logits, _ = model.prefill(ids, None, source=source)
    allowed = torch.tensor(sorted(p.lang_to_id.values()), device=logits.device)
    return int(allowed[logits[0, allowed].argmax()])


@torch.no_grad()
def decode_window(model: Whisper, features: Tensor, p: WhisperPrompts, *, language: int | None,
                  task: str | None, timestamps: bool, max_new_tokens: int | None,
                  settings: DecodeSettings | None = None) -> tuple[list[int], int | None]:
    """The tokens of one (1, n_mels, frames) window after the prompt (kept_tokens: as transformers' generate
    returns them; none for a window skipped as silence), and the language token it was decoded in."""
    source = model.encode_source(features)
    given = language is not None
    if language is None and p.multilingual:
        language = detect_language(model, source, p)
    prompt = init_tokens(p, language, task, timestamps, given)
    room = model.config.n_text_ctx - len(prompt)
    n = room if max_new_tokens is None else min(max_new_tokens, room)
    seq = decode_with_fallback(model, source, prompt, p, timestamps, n, settings or DecodeSettings())
    return (kept_tokens(seq, p, timestamps) if seq is not None else []), language


# -- stitching (transformers' _decode_asr, segment timestamps) ---------------------------------------------
def longest_common_sequence(sequences: Sequence[list[int]]) -> list[int]:
    """The windows' token lists joined at their best overlap (transformers' _find_longest_common_sequence):
    for every alignment of the running left sequence with the next, the share of equal tokens (+ a small
    bonus for longer overlaps); at the best (with more than one match), the left is kept to the overlap's
    middle and the right from its middle on."""
    left = list(sequences[0])
    total: list[int] = []
    for right in sequences[1:]:
        best, where = 0.0, (len(left), len(left), 0, 0)
        for i in range(1, len(left) + len(right)):
            l0, l1 = max(0, len(left) - i), min(len(left), len(left) + len(right) - i)
            r0, r1 = max(0, i - len(left)), min(len(right), i)
            matches = int(np.sum(np.array(left[l0:l1]) == np.array(right[r0:r1])))
            score = matches / i + i / 10000.0
            if matches > 1 and score > best:
                best, where = score, (l0, l1, r0, r1)
        l0, l1, r0, r1 = where
        total += left[:(l0 + l1) // 2]
        left = list(right)[(r0 + r1) // 2:]
    return total + left


@dataclass
class Segment:
    text_ids: list[int]
    start: float | None = None
    end: float | None = None
    language: int | None = None


def stitch(outputs: Sequence[tuple[list[int], tuple[float, float, float]]], p: WhisperPrompts,
           timestamps: bool, time_precision: float, window_positions: int) -> list[Segment]:
    """Each window's tokens and stride (seconds) -> segments of text tokens, as transformers' pipeline
    resolves them (`_decode_asr`; segment-level timestamps)."""
    languages = set(p.lang_to_id.values())
    begin = p.timestamp_begin
    chunks: list[Segment] = []
    chunk = Segment([])
    last_language = None
    time_offset = 0.0
    previous: list[list[int]] = []
    skip = False
    for tokens, (chunk_len, stride_left, stride_right) in outputs:
        last_timestamp = None
        first_timestamp = float(begin)
        cur_max = prev_len = penultimate = 0.0
        time_offset -= stride_left
        right_stride_start = chunk_len - stride_right
        if stride_left:
            first_timestamp = stride_left / time_precision + begin
        if stride_right:
            for t in reversed(tokens):
                if t >= begin:
                    if last_timestamp is not None and (t - begin) * time_precision < right_stride_start:
                        break
                    last_timestamp = t
        current: list[int] = []
        for i, t in enumerate(tokens):
            if p.eos <= t < begin:  # a special token: a language switches the chunk's language
                if t in languages:
                    if last_language is not None and t != last_language and not timestamps:
                        previous.append(current)
                        chunk.text_ids = longest_common_sequence(previous)
                        chunks.append(chunk)
                        previous, current, chunk = [], [], Segment([], language=last_language)
                    chunk.language = last_language = t
            elif t >= begin:
                stamp = float((t - begin) * time_precision)
                if stamp < cur_max:  # a new segment within the window (long-form generate's output)
                    single_ending = i >= 2 and not (tokens[i - 1] >= begin and tokens[i - 2] >= begin)
                    if single_ending:
                        prev_len += time_precision * window_positions
                    else:
                        cur_max = penultimate
                        prev_len += penultimate
                penultimate, cur_max = cur_max, stamp
                time = round((t - begin) * time_precision + time_offset + prev_len, 2)
                if last_timestamp and t >= last_timestamp:
                    skip = True
                elif skip or (previous and t < first_timestamp):
                    skip = False
                elif chunk.start is None:
                    chunk.start = time
                elif time != chunk.start:
                    chunk.end = time
                    previous.append(current)
                    chunk.text_ids = longest_common_sequence(previous)
                    chunks.append(chunk)
                    previous, current, chunk = [], [], Segment([], language=last_language)
            else:
                current.append(t)
        time_offset += chunk_len - stride_right
        if current:
            previous.append(current)
        elif not any(previous):
            chunk, previous = Segment([], language=last_language), []
    if previous:
        chunk.text_ids = longest_common_sequence(previous)
        chunks.append(chunk)
    return chunks


# -- the command ---------------------------------------------------------------------------------------------
@dataclass
class Transcript:
    path: str
    text: str
    segments: list[dict[str, Any]]  # {"start", "end", "text"} (timestamps: seconds; None where unknown)
    language: str | None


def transcribe_file(model: Whisper, tokenizer: Any, p: WhisperPrompts, path: str, wave: np.ndarray, *,
                    language: str | None, task: str | None, timestamps: bool,
                    max_new_tokens: int | None, settings: DecodeSettings | None = None) -> Transcript:
    """One file's transcript; `wave` is its audio at the model's sample rate (read_audio)."""
    c = model.config
    lang = language_id(p, language) if language else None
    device = next(model.parameters()).device
    outputs, detected = [], None
    for w in windows(wave, c.n_samples, c.sample_rate):
        feats = model.features(torch.from_numpy(w.audio)[None].to(device))
        tokens, used = decode_window(model, feats, p, language=lang, task=task, timestamps=timestamps,
                                     max_new_tokens=max_new_tokens, settings=settings)
        detected = detected if detected is not None else used
        outputs.append((tokens, w.stride))
    precision = c.n_samples / c.sample_rate / c.n_audio_ctx  # 0.02 s for every released Whisper
    segments = stitch(outputs, p, timestamps, precision, c.n_audio_ctx)
    names = {v: k.strip("<|>") for k, v in p.lang_to_id.items()}
    rows = [{"start": s.start, "end": s.end, "text": tokenizer.decode(s.text_ids, skip_special_tokens=True)}
            for s in segments]
    return Transcript(path, "".join(r["text"] for r in rows), rows,
                      names.get(detected) if detected is not None else None)


def srt_time(seconds: float | None) -> str:
    ms = int(round((seconds or 0.0) * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d},{ms % 1000:03d}"


def format_transcripts(items: list[Transcript], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([{"file": t.path, "text": t.text, "language": t.language, "segments": t.segments}
                           for t in items], ensure_ascii=False, indent=2)
    if fmt == "srt":
        blocks = []
        for t in items:
            for n, s in enumerate(t.segments, 1):
                blocks.append(f"{n}\n{srt_time(s['start'])} --> {srt_time(s['end'])}\n{s['text'].strip()}\n")
        return "\n".join(blocks)
    return "\n".join(t.text.strip() if len(items) == 1 else f"{t.path}: {t.text.strip()}" for t in items)


def transcribe(folder: str, audio: list[str], *, language: str | None = None, task: str | None = None,
               timestamps: bool = False, fmt: str = "text", max_new_tokens: int | None = None,
               device: str = "auto", settings: DecodeSettings | None = None) -> str:
    """What `qkv transcribe` prints."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {list(FORMATS)}, got {fmt!r}")
    if task is not None and task not in TASKS:
        raise ConfigError(f"--task must be one of {list(TASKS)}, got {task!r}")
    if fmt == "srt" and not timestamps:
        timestamps = True  # subtitles need times
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not audio:
        raise ConfigError("give the audio files to transcribe")
    waves = [read_audio(a, WhisperConfig.sample_rate) for a in audio]  # every file read before the model
    model = load_hf(folder)  # a Hugging Face folder: its generation_config.json is read here, not there
    if not isinstance(model, Whisper):
        raise ConfigError(f"{folder}: qkv transcribe needs a Whisper folder, not {type(model).__name__}")
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    model = model.to(dev).eval()
    p, tokenizer = WhisperPrompts.from_folder(folder), load_hf_tokenizer(folder)
    items = [transcribe_file(model, tokenizer, p, a, w, language=language, task=task, timestamps=timestamps,
                             max_new_tokens=max_new_tokens, settings=settings) for a, w in zip(audio, waves)]
    return format_transcripts(items, fmt)


__all__ = ["FORMATS", "DecodeSettings", "Transcript", "WhisperPrompts", "decode_window", "format_transcripts",
           "longest_common_sequence", "parse_temperatures", "read_audio", "stitch", "transcribe", "windows"]
