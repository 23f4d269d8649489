"""`qkv generate DIR --input ...` on pretrained encoder-decoder folders, with their tokenizers: a Marian
folder with only SentencePiece files (source.spm / target.spm / vocab.json, read with the `sentencepiece`
package) and a BART folder with a tokenizer.json. The text equals transformers' generate + its own tokenizer's
decode."""

from __future__ import annotations

import io
import json
import random
import warnings

import pytest
import torch
from _seq2seq_models import V, bart, marian, t5

from qkv.cli.main import main
from qkv.tasks.tokenizers import find_tokenizer

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TEXTS = ["abc dea fgh", "hhh gab", "ef ef ef cab"]
EMPTY = "(empty output: the model ended the sequence at once, or generated only special tokens)"


def _spm_files(folder) -> None:
    """A tiny SentencePiece model trained here (on random words of 8 letters) and Marian's vocab.json."""
    rnd = random.Random(0)
    words = ["".join(rnd.choice("abcdefgh") for _ in range(rnd.randint(2, 6))) for _ in range(200)]
    lines = [" ".join(rnd.choice(words) for _ in range(8)) for _ in range(300)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=30,
                                   model_type="unigram", minloglevel=2)
    for name in ("source.spm", "target.spm"):
        (folder / name).write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    pieces = [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}, "<pad>": V - 1}
    # the model's other ids: pieces the SentencePiece model does not know (both decoders read them as unknown)
    vocab.update({f"\u2581q{i}": i for i in range(len(pieces) + 2, V - 1)})
    (folder / "vocab.json").write_text(json.dumps(vocab))


def _run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()  # what building the folders printed
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out.strip(), out.err.strip()


def test_marian_sentencepiece_folder(tmp_path, capsys):
    hf = marian(tmp_path, seed=3)
    _spm_files(tmp_path)
    ref_tok = transformers.MarianTokenizer(str(tmp_path / "source.spm"), str(tmp_path / "target.spm"),
                                           str(tmp_path / "vocab.json"))
    tok = find_tokenizer(tmp_path)
    for text in TEXTS:
        ids = ref_tok(text).input_ids
        assert tok.encode(text) == ids
        assert tok.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True)
    opts = dict(num_beams=4, length_penalty=0.6, no_repeat_ngram_size=3, max_new_tokens=10)
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([ref_tok(TEXTS[0]).input_ids]), early_stopping=True, **opts)
    expected = ref_tok.decode(ref[0], skip_special_tokens=True)
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", TEXTS[0], "--num-beams", "4",
                        "--length-penalty", "0.6", "--no-repeat-ngram-size", "3", "--max-new-tokens", "10",
                        "--early-stopping", "true")
    assert rc == 0, err
    assert out == (expected if expected.strip() else EMPTY)


def _bart_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, V)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>"])
    tok.save(str(folder / "tokenizer.json"))


def test_bart_tokenizer_json_folder_greedy_with_forced_bos_eos(tmp_path, capsys):
    hf = bart(tmp_path, seed=4)
    _bart_tokenizer(tmp_path)
    ref_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "w5 w9 w17 w30 w8"
    ids = ref_tok(text).input_ids
    assert ids[0] == 0 and ids[-1] == 2
    with torch.no_grad():  # greedy with the folder's generation_config.json (forced BOS / EOS)
        ref = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=9)
    expected = ref_tok.decode(ref[0], skip_special_tokens=True)
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", text, "--max-new-tokens", "9")
    assert rc == 0, err
    assert out == (expected if expected.strip() else EMPTY)


def test_folder_without_tokenizer_is_one_clear_error(tmp_path, capsys):
    bart(tmp_path)
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", "w5 w6")
    assert rc == 2 and err.startswith("qkv: error:") and "tokenizer" in err and len(err.splitlines()) == 1


# -- the folder's settings, the flags, and what the command says about them ------------------
from _seq2seq_models import _add_generation_settings  # noqa: E402


def test_greedy_overrides_a_folders_beams_and_sample_samples(tmp_path, capsys):
    """A folder whose generation_config.json asks for 4 beams (OPUS-MT, BART-CNN): --greedy is transformers'
    greedy (num_beams=1), not the beams; sampling flags without --sample are named in a warning; --sample
    samples with them, as transformers' do_sample=True with the same seed."""
    bart(tmp_path, seed=4)
    _bart_tokenizer(tmp_path)
    _add_generation_settings(tmp_path, num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0,
                             early_stopping=True)
    hf = transformers.BartForConditionalGeneration.from_pretrained(tmp_path).eval()
    ref_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "w10 w11 w12"
    x = torch.tensor([ref_tok(text).input_ids])
    with torch.no_grad():
        beams = hf.generate(input_ids=x, max_new_tokens=10)
        greedy = hf.generate(input_ids=x, max_new_tokens=10, num_beams=1)
    assert not torch.equal(beams, greedy)  # the case is one where the two differ
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", text, "--greedy",
                        "--max-new-tokens", "10")
    assert rc == 0 and out == (ref_tok.decode(greedy[0], skip_special_tokens=True) or EMPTY), err
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", text, "--temperature", "1.5",
                        "--max-new-tokens", "10")
    assert rc == 0 and out == (ref_tok.decode(beams[0], skip_special_tokens=True) or EMPTY)
    assert "qkv: warning: temperature only apply when sampling" in err and "beam search (4 beams)" in err
    import qkv

    model = qkv.from_pretrained(tmp_path)
    outs = set()
    for seed in (1, 2, 3):
        rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", text, "--sample", "--temperature",
                            "1.5", "--max-new-tokens", "10", "--seed", str(seed))
        want = model.generate(x, max_new_tokens=10, do_sample=True, num_beams=1, temperature=1.5, seed=seed)
        assert rc == 0 and "warning" not in err
        assert out == (ref_tok.decode(want[0], skip_special_tokens=True) or EMPTY)
        outs.add(out)
    assert len(outs) > 1  # sampled, not three greedy copies


def test_an_all_padding_source_row_is_refused(tmp_path):
    import qkv
    from qkv.generate import generate

    marian(tmp_path)
    model = qkv.from_pretrained(tmp_path)
    x = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match="a source in the batch is all padding"):
        generate(model, x, attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]), max_new_tokens=3)


def test_config_json_generation_keys_count_only_without_generation_config(tmp_path):
    """transformers 5 reads generation settings from generation_config.json alone when the folder has one."""
    import qkv

    hf = bart(tmp_path, seed=2)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta.update(num_beams=3, no_repeat_ngram_size=1, max_length=9, min_length=6)
    (tmp_path / "config.json").write_text(json.dumps(meta))
    model = qkv.from_pretrained(tmp_path)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert model.generation_defaults().get("num_beams", 1) == (hf.generation_config.num_beams or 1) == 1
    x = torch.tensor([[10, 11, 12, 13]])
    with torch.no_grad():
        assert (model.generate(x, max_new_tokens=6).tolist()
                == hf.generate(x, max_new_tokens=6)[:, 1:].tolist())
    (tmp_path / "generation_config.json").unlink()  # an older folder: config.json's keys are the settings
    assert qkv.from_pretrained(tmp_path).generation_defaults()["num_beams"] == 3


@pytest.mark.parametrize("content, message", [(b'{"num_beams": 4', "not valid JSON"),
                                              (b'{"num_beams": \xff}', "not UTF-8")])
def test_an_unreadable_generation_config_is_named_and_the_folder_still_loads(tmp_path, capsys,
                                                                             content, message):
    bart(tmp_path)
    _bart_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_bytes(content)
    with warnings.catch_warnings():
        # the module ignores them; this test reads the CLI's line
        warnings.simplefilter("always", UserWarning)
        rc, out, err = _run(capsys, "info", str(tmp_path))
    assert rc == 0 and "EncoderDecoder" in out, err
    assert f"qkv: warning: {tmp_path / 'generation_config.json'}: {message}" in err
    from qkv.generate import GenerationConfig

    with pytest.raises(Exception, match=f"generation_config.json: {message}"):
        GenerationConfig.from_file(tmp_path / "generation_config.json")


def test_strict_and_the_unknown_word_warning_on_a_tokenizer_json_folder(tmp_path, capsys):
    bart(tmp_path)
    _bart_tokenizer(tmp_path)  # a WordLevel vocabulary with <unk>
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", "hello w10 bye", "--max-new-tokens",
                        "3", "--strict")
    assert rc == 2 and "2 symbol(s) outside the model's vocabulary: 'hello', 'bye'" in err
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", "hello w10", "--max-new-tokens", "3")
    assert rc == 0 and "warning: 1 prompt symbol(s) outside the model's vocabulary" in err


def test_the_default_length_fits_a_small_decoder_context(tmp_path, capsys):
    bart(tmp_path)  # max_position_embeddings 40: 200 new tokens would not fit
    _bart_tokenizer(tmp_path)
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", "w10 w11 w12")
    assert rc == 0, err


class _Writes:
    """A stdout that records each non-empty write: how many pieces arrive, and what they add up to."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def write(self, s: str) -> int:
        if s:
            self.pieces.append(s)
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["bart", "marian"])
@pytest.mark.parametrize("sampling", [False, True])
def test_stream_prints_the_target_piece_by_piece(tmp_path, monkeypatch, capsys, sampling, kind):
    """--stream on an encoder-decoder folder prints the target as the decoder produces it (it printed the
    whole text once, at the end): several pieces that add up to the non-streamed output, which for greedy
    decoding is transformers' generate under the folder's generation_config.json (forced BOS / EOS) decoded
    by its tokenizer (a tokenizer.json; Marian's SentencePiece files)."""
    if kind == "bart":
        hf = bart(tmp_path, seed=4)
        _bart_tokenizer(tmp_path)
        ref_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
        text = "w5 w9 w17 w30 w8"
    else:
        hf = marian(tmp_path, seed=3)
        _spm_files(tmp_path)
        ref_tok = transformers.MarianTokenizer(str(tmp_path / "source.spm"), str(tmp_path / "target.spm"),
                                               str(tmp_path / "vocab.json"))
        text = TEXTS[0]
    flags = ["--temperature", "1.5", "--top-k", "20"] if sampling else []
    argv = ["generate", str(tmp_path), "--input", text, "--max-new-tokens", "9", "--min-new-tokens", "9",
            "--seed", "3", *flags]
    rc, plain, err = _run(capsys, *argv)
    assert rc == 0, err
    if not sampling:
        with torch.no_grad():
            ref = hf.generate(input_ids=torch.tensor([ref_tok(text).input_ids]), max_new_tokens=9,
                              min_new_tokens=9)
        assert plain == ref_tok.decode(ref[0], skip_special_tokens=True)
    writes = _Writes()
    monkeypatch.setattr("sys.stdout", writes)
    assert main([*argv, "--stream"]) == 0
    monkeypatch.undo()
    assert "".join(writes.pieces).strip() == plain
    assert len([p for p in writes.pieces if p.strip()]) > 1, writes.pieces


def test_t5_spiece_folder_reads_sentinels(tmp_path, capsys):
    """A T5 folder with only spiece.model (google/t5-v1_1-*): a source with <extra_id_N> sentinels is encoded
    as T5Tokenizer encodes it, so the output is transformers' generate decoded by T5Tokenizer."""
    hf = t5(tmp_path, gated=True, seed=5)
    rnd = random.Random(1)
    lines = [" ".join(rnd.choice("house small the is a big cat dog runs fast slow tree green".split())
                          for _ in range(8)) for _ in range(300)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=30, pad_id=0,
                                   eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    (tmp_path / "spiece.model").write_bytes(buf.getvalue())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"extra_ids": V - 30}))  # ids 30..60
    ref_tok = transformers.T5Tokenizer.from_pretrained(tmp_path)
    text = "the big cat <extra_id_0> house <extra_id_1>"
    ids = ref_tok(text).input_ids
    assert V - 1 in ids and V - 2 in ids  # <extra_id_0>, <extra_id_1>
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8)
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", text, "--max-new-tokens", "8",
                        "--min-new-tokens", "8")
    assert rc == 0, err
    assert out == ref_tok.decode(ref[0], skip_special_tokens=True)
