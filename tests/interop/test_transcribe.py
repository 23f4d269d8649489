"""`qkv transcribe`: a tiny random-weight Hugging Face Whisper folder (a word-level vocabulary with Whisper's
special and timestamp tokens) decodes a window into the tokens transformers' WhisperForConditionalGeneration
.generate gives (language given or detected, transcribe or translate, with and without timestamps); long
audio is cut into the pipeline's overlapping windows and stitched as transformers' `_decode_asr` stitches
them; the text / JSON / SRT outputs; bad input is one clear line, exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
sf = pytest.importorskip("soundfile")
pytest.importorskip("scipy")

from qkv.cli.main import main  # noqa: E402
from qkv.interop import load_hf  # noqa: E402
from qkv.transcribe import (  # noqa: E402
    DecodeSettings,
    WhisperPrompts,
    decode_window,
    language_id,
    read_audio,
    stitch,
    windows,
)

N_WORDS = 30
EOS, SOT, EN, DE, TRANSLATE, TRANSCRIBE, NOCAPTIONS, NOTS = range(N_WORDS, N_WORDS + 8)
N_STAMPS = 40
VOCAB = NOTS + 1 + N_STAMPS
SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
            "<|nocaptions|>", "<|notimestamps|>"]
GEN = dict(decoder_start_token_id=SOT, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=EOS,
           no_timestamps_token_id=NOTS, lang_to_id={"<|en|>": EN, "<|de|>": DE},
           task_to_id={"translate": TRANSLATE, "transcribe": TRANSCRIBE}, is_multilingual=True,
           suppress_tokens=[3, 7], begin_suppress_tokens=[4, EOS], max_initial_timestamp_index=5,
           max_length=32)


def save_tokenizer(folder):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(N_WORDS)}
    vocab.update({t: N_WORDS + i for i, t in enumerate(SPECIALS)})
    vocab.update({f"<|{i * 0.02:.2f}|>": NOTS + 1 + i for i in range(N_STAMPS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)


def whisper_folder(folder, seed=0):
    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80,
        max_source_positions=12, max_target_positions=32, pad_token_id=EOS, bos_token_id=EOS,
        eos_token_id=EOS, decoder_start_token_id=SOT, suppress_tokens=None, begin_suppress_tokens=None)
    torch.manual_seed(seed)
    hf = transformers.WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF init zeros biases and sets norms to (1, 0): perturb so every weight matters
        for name, p in hf.named_parameters():
            if "embed_positions" not in name or "decoder" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.generation_config = transformers.GenerationConfig(**GEN)
    hf.save_pretrained(folder)
    save_tokenizer(folder)
    return hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("whisper")
    whisper_folder(d)
    return d


def hf_tokens(hf, feats, max_new_tokens=12, **kw):
    """transformers' generate: the tokens after its prompt (which short-form decoding without timestamps
    returns too)."""
    with torch.no_grad():
        out = hf.generate(input_features=feats, max_new_tokens=max_new_tokens, **kw)
    seq = (out["sequences"] if isinstance(out, dict) else out)[0].tolist()
    while seq and (seq[0] in (SOT, EN, DE, TRANSLATE, TRANSCRIBE, NOTS)):
        seq = seq[1:]
    return seq


@pytest.mark.parametrize("kw", [dict(language="en", task="transcribe"), dict(language="de", task="translate"),
                                dict(task="transcribe"), dict(), dict(language="de"),
                                dict(language="en", return_timestamps=True), dict(return_timestamps=True),
                                dict(task="translate", return_timestamps=True)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_tokens_equal_transformers_generate(folder, kw, seed):
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(folder).eval()
    ours = load_hf(folder)
    p = WhisperPrompts.from_folder(folder)
    torch.manual_seed(seed)
    audio = torch.randn(1, ours.config.n_samples) * 0.2
    feats = ours.features(audio)
    ref = hf_tokens(hf, feats, **kw)
    lang = language_id(p, kw["language"]) if "language" in kw else None
    got, _ = decode_window(ours, feats, p, language=lang, task=kw.get("task"),
                           timestamps=kw.get("return_timestamps", False), max_new_tokens=12)
    assert got == ref


class FakeWhisperTokenizer:
    """What transformers' _decode_asr reads of a tokenizer, for this vocabulary."""

    all_special_ids = list(range(EOS, NOTS + 1))

    def convert_tokens_to_ids(self, token):
        return {"<|notimestamps|>": NOTS, "<|startoftranscript|>": SOT, "<|startofprev|>": -1}[token]

    def decode(self, ids):
        if len(ids) == 1 and EOS <= ids[0] <= NOTS:
            return SPECIALS[ids[0] - EOS]
        return "".join(f" w{i}" for i in ids)

    def _strip_prompt(self, ids, *_):
        return ids


def ts(t):
    return NOTS + 1 + t


STITCH_CASES = [
    # no timestamps: three windows whose text overlaps
    ([[EN, 1, 2, 3, 4, 5, EOS], [EN, 4, 5, 6, 7, 8, EOS], [EN, 7, 8, 9, 10, EOS]], False),
    # no overlap found (fewer than two matches): plain concatenation at the edges
    ([[EN, 1, 2, 3, EOS], [EN, 9, 10, 11, EOS]], False),
    # timestamps, a segment crossing the window boundary, segments inside the strides
    ([[EN, ts(0), 1, 2, ts(4), ts(4), 3, 4, 5, ts(10), ts(10), 6, 7, EOS],
      [EN, ts(1), 5, 6, 7, ts(6), ts(6), 8, 9, ts(11), EOS]], True),
    ([[DE, ts(0), 1, 2, 3, ts(5), ts(6), 4, 5, ts(12), EOS],
      [DE, ts(2), 4, 5, 6, ts(8), ts(8), 11, ts(12), EOS], [DE, ts(1), 11, 12, ts(3), EOS]], True),
]


@pytest.mark.parametrize("outputs, timestamps", STITCH_CASES)
def test_stitch_equals_transformers_decode_asr(outputs, timestamps):
    from transformers.models.whisper.tokenization_whisper import _decode_asr

    p = WhisperPrompts(SOT, EOS, NOTS, {"<|en|>": EN, "<|de|>": DE}, {"transcribe": TRANSCRIBE})
    precision, window = 0.02, 12
    strides = [(0.24, 0.0 if i == 0 else 0.04, 0.0 if i == len(outputs) - 1 else 0.04)
               for i in range(len(outputs))]
    model_outputs = [{"tokens": torch.tensor([o]), "stride": s} for o, s in zip(outputs, strides)]
    text, optional = _decode_asr(FakeWhisperTokenizer(), model_outputs, return_timestamps=timestamps,
                                 return_language=True, time_precision=precision, segment_size=window)
    segments = stitch(list(zip(outputs, strides)), p, timestamps, precision, window)
    assert "".join(f" w{i}" for s in segments for i in s.text_ids) == text
    for s, ref in zip(segments, optional["chunks"], strict=True):
        assert FakeWhisperTokenizer().decode(s.text_ids) == ref["text"]
        assert SPECIALS[s.language - EOS][2:-2] == {"english": "en", "german": "de"}[ref["language"]]
        if timestamps:
            assert (s.start, s.end) == tuple(ref["timestamp"])


def test_windows_are_the_pipeline_chunks():
    from transformers.pipelines.automatic_speech_recognition import chunk_iter

    class Features:
        sampling_rate = 16000

        def __call__(self, chunk, **_):
            return {"n": len(chunk)}

    wave = np.zeros(10_000, dtype=np.float32)
    ref = [(c["n"], c["stride"]) for c in chunk_iter(wave, Features(), 3840, 640, 640)]
    got = [(len(w.audio), tuple(round(x * 16000) for x in w.stride)) for w in windows(wave, 3840, 16000)]
    assert got == ref


def test_read_audio_resamples_and_mixes(tmp_path):
    from scipy.signal import resample_poly

    rng = np.random.default_rng(0)
    stereo = (rng.standard_normal((8000, 2)) * 0.1).astype(np.float32)
    sf.write(tmp_path / "a.wav", stereo, 8000, subtype="FLOAT")
    got = read_audio(tmp_path / "a.wav", 16000)
    assert got.shape == (16000,) and got.dtype == np.float32
    np.testing.assert_allclose(got, resample_poly(stereo.mean(1), 2, 1), atol=1e-6)
    sf.write(tmp_path / "b.flac", stereo[:, 0], 16000)  # FLAC: what soundfile reads
    np.testing.assert_allclose(read_audio(tmp_path / "b.flac", 16000), stereo[:, 0], atol=1e-4)


def test_transcribe_cli_formats(folder, tmp_path, capsys):
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(folder).eval()
    ours = load_hf(folder)
    rng = np.random.default_rng(1)
    short = (rng.standard_normal(3000) * 0.2).astype(np.float32)
    sf.write(tmp_path / "short.wav", short, 16000, subtype="FLOAT")
    assert main(["transcribe", str(folder), str(tmp_path / "short.wav"), "--language", "en",
                 "--max-new-tokens", "10"]) == 0
    text = capsys.readouterr().out.strip()
    ref = hf_tokens(hf, ours.features(torch.from_numpy(short)[None]), language="en", task="transcribe")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    words = [i for i in ref[:14] if i < EOS]
    assert text.split() == tok.decode(words[:10]).split()

    long = (rng.standard_normal(9000) * 0.2).astype(np.float32)  # 0.56 s: three 0.24-s windows
    sf.write(tmp_path / "long.wav", long, 16000, subtype="FLOAT")
    assert main(["transcribe", str(folder), str(tmp_path / "long.wav"), "--format", "json", "--timestamps",
                 "--max-new-tokens", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["file"].endswith("long.wav") and out[0]["language"] in ("en", "de")
    assert out[0]["text"] == "".join(s["text"] for s in out[0]["segments"])
    assert main(["transcribe", str(folder), str(tmp_path / "long.wav"), "--format", "srt",
                 "--max-new-tokens", "10"]) == 0
    srt = capsys.readouterr().out
    blocks = [b for b in srt.strip().split("\n\n") if b]
    assert len(blocks) == len(out[0]["segments"])
    for n, b in enumerate(blocks, 1):
        lines = b.splitlines()
        assert lines[0] == str(n) and " --> " in lines[1] and lines[1].count(",") == 2


def test_bad_input_is_one_line(folder, tmp_path, capsys):
    note = tmp_path / "note.wav"
    note.write_text("this is not audio\n")
    for argv, message in [
        ([str(note)], "not an audio file soundfile can read"),
        ([str(tmp_path / "missing.wav")], "no such audio file"),
        ([str(note), "--language", "xx"], "not an audio file"),  # files are read before the language
    ]:
        assert main(["transcribe", str(folder), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("qkv: error: ") and message in err and err.count("\n") == 1
    wav = tmp_path / "ok.wav"
    sf.write(wav, np.zeros(1600, dtype=np.float32), 16000)
    assert main(["transcribe", str(folder), str(wav), "--language", "xx"]) == 2
    assert "--language xx: not a language of this model" in capsys.readouterr().err
    bert = tmp_path / "bert"
    transformers.BertModel(transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=8)
                           ).save_pretrained(bert)
    assert main(["transcribe", str(bert), str(wav)]) == 2
    assert "needs a Whisper folder" in capsys.readouterr().err


def test_missing_soundfile_names_the_extra(monkeypatch, tmp_path):
    import sys

    from qkv.config import ConfigError

    monkeypatch.setitem(sys.modules, "soundfile", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"soundfile, which is not installed: pip install 'qkv\[audio\]'"):
        read_audio(tmp_path / "x.wav", 16000)


# -- beam search and the temperature fallback (transformers' generate_with_fallback) -------------------------
def _window(folder, seed):
    ours = load_hf(folder)
    torch.manual_seed(seed)
    feats = ours.features(torch.randn(1, ours.config.n_samples) * 0.2)
    return transformers.WhisperForConditionalGeneration.from_pretrained(folder).eval(), ours, feats


@pytest.fixture(scope="module")
def folder3(tmp_path_factory):
    """Weights (seed 3) whose beams find other tokens than greedy decoding: beam search is not vacuous."""
    d = tmp_path_factory.mktemp("whisper3")
    whisper_folder(d, seed=3)
    return d


@pytest.mark.parametrize("kw", [dict(language="en", task="transcribe"), dict(),
                                dict(language="de", return_timestamps=True)])
@pytest.mark.parametrize("num_beams", [2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_beam_search_tokens_equal_transformers(folder3, kw, num_beams, seed):
    hf, ours, feats = _window(folder3, seed)
    p = WhisperPrompts.from_folder(folder3)
    ref = hf_tokens(hf, feats, max_new_tokens=20, num_beams=num_beams, **kw)
    lang = language_id(p, kw["language"]) if "language" in kw else None
    opts = dict(language=lang, task=kw.get("task"), timestamps=kw.get("return_timestamps", False),
                max_new_tokens=20)
    got, _ = decode_window(ours, feats, p, settings=DecodeSettings(num_beams=num_beams), **opts)
    assert got == ref
    if num_beams == 4 and "language" in kw:  # measured: 4 beams end elsewhere than greedy on these windows
        assert got != decode_window(ours, feats, p, **opts)[0]


FALLBACK = dict(temperature=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0), compression_ratio_threshold=1.35,
                logprob_threshold=-1.0, no_speech_threshold=0.6)


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_fallback_where_deterministic_equals_transformers(folder, num_beams, seed):
    """The fallback settings transformers' long-form recipe uses; thresholds the temperature-0 result passes
    (none of ratio, log-probability or silence triggers: the greedy / beam tokens), and a silence threshold
    every window crosses (no_speech_threshold 0, logprob_threshold 0: the window is skipped, no tokens)."""
    hf, ours, feats = _window(folder, seed)
    p = WhisperPrompts.from_folder(folder)
    lenient = dict(FALLBACK, compression_ratio_threshold=100.0, logprob_threshold=-100.0)
    ref = hf_tokens(hf, feats, num_beams=num_beams, language="en", task="transcribe", **lenient)
    settings = DecodeSettings(lenient["temperature"], num_beams, 1.0, 100.0, -100.0, 0.6)
    got, _ = decode_window(ours, feats, p, language=EN, task="transcribe", timestamps=False,
                           max_new_tokens=12, settings=settings)
    assert got == ref and got
    silent = dict(FALLBACK, logprob_threshold=0.0, no_speech_threshold=0.0)
    ref = hf_tokens(hf, feats, num_beams=num_beams, language="en", task="transcribe", **silent)
    got, _ = decode_window(ours, feats, p, language=EN, task="transcribe", timestamps=False,
                           max_new_tokens=12, settings=DecodeSettings(silent["temperature"], num_beams,
                                                                     1.0, 1.35, 0.0, 0.0))
    assert got == ref == []


def test_fallback_samples_at_a_higher_temperature(folder, monkeypatch):
    """A ratio threshold every result crosses: each temperature is tried in turn and the last one's draw is
    kept (sampled, so seeded, not compared token by token)."""
    from qkv import whisper_decode as tr

    tried = []
    real = tr.sample_or_greedy
    monkeypatch.setattr(tr, "sample_or_greedy", lambda *a: (tried.append(a[6]), real(*a))[1])
    _, ours, feats = _window(folder, 0)
    p = WhisperPrompts.from_folder(folder)
    settings = DecodeSettings((0.0, 0.5, 1.0), compression_ratio_threshold=0.0, seed=3)
    got, _ = decode_window(ours, feats, p, language=EN, task="transcribe", timestamps=False,
                           max_new_tokens=12, settings=settings)
    assert tried == [0.0, 0.5, 1.0] and got
    again, _ = decode_window(ours, feats, p, language=EN, task="transcribe", timestamps=False,
                             max_new_tokens=12, settings=settings)
    assert again == got  # the seed makes the draw repeatable


@pytest.mark.parametrize("args, message", [
    (["--temperature", "0,hot"], "give numbers separated by commas"),
    (["--temperature", "-0.5"], "numbers >= 0"),
    (["--num-beams", "0"], "--num-beams must be at least 1"),
    (["--no-speech-threshold", "0.6"], "needs --logprob-threshold"),
])
def test_bad_decoding_settings(folder, tmp_path, capsys, args, message):
    wav = tmp_path / "a.wav"
    sf.write(wav, np.zeros(1600, dtype=np.float32), 16000)
    assert main(["transcribe", str(folder), str(wav), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and message in err and err.count("\n") == 1


def test_transcribe_cli_beams_and_fallback_settings(folder3, tmp_path, capsys):
    """--num-beams and the fallback flags reach every window: the text is transformers' beam tokens."""
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(folder3).eval()
    ours = load_hf(folder3)
    short = (np.random.default_rng(2).standard_normal(3000) * 0.2).astype(np.float32)
    sf.write(tmp_path / "short.wav", short, 16000, subtype="FLOAT")
    assert main(["transcribe", str(folder3), str(tmp_path / "short.wav"), "--language", "en",
                 "--max-new-tokens", "20", "--num-beams", "4", "--temperature", "0,0.2,0.4",
                 "--compression-ratio-threshold", "100", "--logprob-threshold", "-100",
                 "--no-speech-threshold", "0.6"]) == 0
    text = capsys.readouterr().out.strip()
    feats = ours.features(torch.from_numpy(short)[None])
    ref = hf_tokens(hf, feats, max_new_tokens=20, num_beams=4, language="en", task="transcribe")
    greedy = hf_tokens(hf, feats, max_new_tokens=20, language="en", task="transcribe")
    tok = transformers.AutoTokenizer.from_pretrained(folder3)
    assert text.split() == tok.decode([i for i in ref if i < EOS]).split()
    assert text.split() != tok.decode([i for i in greedy if i < EOS]).split()  # the beams were used
