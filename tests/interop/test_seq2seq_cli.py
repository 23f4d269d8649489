"""`qkv generate DIR --input ...` on pretrained encoder-decoder folders, with their tokenizers: a Marian folder
with only SentencePiece files (source.spm / target.spm / vocab.json, read with the `sentencepiece` package)
and a BART folder with a tokenizer.json. The text equals transformers' generate + its own tokenizer's decode."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch
from _seq2seq_models import V, bart, marian, t5

from qkv.cli.main import main
from qkv.tasks.tokenizers import find_tokenizer

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TEXTS = ["abc dea fgh", "hhh gab", "ef ef ef cab"]


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
    assert out == (expected if expected.strip() else "(empty output: the model ended the sequence at once)")


def _bart_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, V)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
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
    assert out == (expected if expected.strip() else "(empty output: the model ended the sequence at once)")


def test_folder_without_tokenizer_is_one_clear_error(tmp_path, capsys):
    bart(tmp_path)
    rc, out, err = _run(capsys, "generate", str(tmp_path), "--input", "w5 w6")
    assert rc == 2 and err.startswith("qkv: error:") and "tokenizer" in err and len(err.splitlines()) == 1


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
            ref = hf.generate(input_ids=torch.tensor([ref_tok(text).input_ids]), max_new_tokens=9, min_new_tokens=9)
        assert plain == ref_tok.decode(ref[0], skip_special_tokens=True)
    writes = _Writes()
    monkeypatch.setattr("sys.stdout", writes)
    assert main([*argv, "--stream"]) == 0
    monkeypatch.undo()
    assert "".join(writes.pieces).strip() == plain
    assert len([p for p in writes.pieces if p.strip()]) > 1, writes.pieces


def test_t5_spiece_folder_reads_sentinels(tmp_path, capsys):
    """A T5 folder with only spiece.model (google/t5-v1_1-*): a source with <extra_id_N> sentinels is encoded as
    T5Tokenizer encodes it, so the output is transformers' generate decoded by T5Tokenizer."""
    hf = t5(tmp_path, gated=True, seed=5)
    rnd = random.Random(1)
    lines = [" ".join(rnd.choice("house small the is a big cat dog runs fast slow tree green".split()) for _ in range(8)) for _ in range(300)]
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
