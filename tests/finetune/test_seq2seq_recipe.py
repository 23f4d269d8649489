"""`qkv finetune DIR --task seq2seq`: a tiny random T5 (built by transformers from our config, saved locally)
learns to reverse short words from a TSV file of pairs to a high exact match on held-out words; the output
folder loads in transformers and in qkv with the same logits; bad data is one clear line."""

from __future__ import annotations

import json
import random

import pytest
import torch

from qkv.cli.main import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("sacrebleu")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
LETTERS = "abcdef"


def _t5_folder(folder, seed=0):
    """A tiny random T5 with a tokenizer.json of single letters (words are letters separated by spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(LETTERS)}}
    torch.manual_seed(seed)
    cfg = transformers.T5Config(vocab_size=len(vocab), d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=16,
                                relative_attention_max_distance=32, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _pairs(path, words):
    path.write_text("".join(f"{' '.join(w)}\t{' '.join(reversed(w))}\n" for w in words))
    return path


def _words(n, seed, exclude=()):
    rnd, out = random.Random(seed), []
    while len(out) < n:
        w = "".join(rnd.choice(LETTERS) for _ in range(rnd.randint(2, 4)))
        if w not in exclude and w not in out:
            out.append(w)
    return out


def test_tiny_t5_learns_to_reverse_words_and_round_trips(tmp_path, capsys):
    model_dir = _t5_folder(tmp_path / "t5")
    dev_words = _words(40, 1)
    train = _pairs(tmp_path / "train.tsv", _words(1000, 0, exclude=dev_words))
    dev = _pairs(tmp_path / "dev.tsv", dev_words)
    out = tmp_path / "out"
    rc = main(["finetune", str(model_dir), "--task", "seq2seq", "--data", str(train), "--dev", str(dev),
               "--out", str(out), "--epochs", "10", "--batch-size", "32", "--lr", "3e-3", "--no-progress",
               "train.best_metric=exact_match", "train.schedule=constant", "train.warmup=20",
               "train.plot=false", "train.tensorboard=false"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    best = json.loads((out / "checkpoints" / "best" / "eval.json").read_text())
    assert best["exact_match"] >= 0.9, best  # held-out words: the model reverses, it did not memorise
    assert best["chrf"] > 80
    # the output folder: transformers and qkv load it to the same logits
    import qkv

    hf = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    ours = qkv.from_pretrained(out)
    x = torch.tensor([[3, 4, 5, 6, 1], [8, 7, 3, 1, 0]])
    mask = (x != 0).long()
    dec = torch.tensor([[0, 6, 5, 4], [0, 3, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(ours(x, attention_mask=mask, decoder_input_ids=dec).logits,
                                   hf(input_ids=x, attention_mask=mask, decoder_input_ids=dec).logits,
                                   atol=1e-4, rtol=1e-4)
    # and it reverses a held-out word through the CLI
    rc = main(["generate", str(out), "--input", " ".join(dev_words[0]), "--max-new-tokens", "8"])
    assert rc == 0 and capsys.readouterr().out.strip() == " ".join(reversed(dev_words[0]))


@pytest.mark.parametrize("content,message", [
    ("a b\tb a\na b c\n", "train.tsv:2: no tab between source and target"),
    ("a b\tb a\n\t\n", "train.tsv:2: empty source"),
    ("a b\t \n", "train.tsv:1: empty target"),
    ("a b\tb a\tx\n", "train.tsv:1: 2 tabs"),
    ("a b c d e f a b c d e f\tb a\n", "train.tsv:1: source is 13 tokens, over --max-source-length 8"),
])
def test_bad_data_is_one_clear_line(tmp_path, capsys, content, message):
    model_dir = _t5_folder(tmp_path / "t5")
    (tmp_path / "train.tsv").write_text(content)
    capsys.readouterr()
    rc = main(["finetune", str(model_dir), "--task", "seq2seq", "--data", str(tmp_path / "train.tsv"),
               "--out", str(tmp_path / "out"), "--max-source-length", "8", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("qkv: error:") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out" / "config.json").exists()


def _bart_folder(folder, max_positions: int):
    """A tiny random BART with learned positions (a decoder context of `max_positions`) and a word-level
    tokenizer.json over the same letters as the T5's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(LETTERS)}}
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=len(vocab), d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                  decoder_ffn_dim=48, max_position_embeddings=max_positions, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                                  forced_eos_token_id=2)
    transformers.BartForConditionalGeneration(cfg).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>"])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_dev_decoding_fits_the_decoder_context(tmp_path, capsys):
    """The targets may be as long as the decoder's context (8 positions); decoding the dev set then asks for
    at most context - 1 new tokens (the start token takes one position), not a target's length: the epoch's
    evaluation used to stop the run with '1 start token + 8 new tokens exceeds the context of 8'."""
    model_dir = _bart_folder(tmp_path / "bart", max_positions=8)
    train = _pairs(tmp_path / "train.tsv", _words(16, 0))
    dev = _pairs(tmp_path / "dev.tsv", _words(4, 1))
    capsys.readouterr()
    rc = main(["finetune", str(model_dir), "--task", "seq2seq", "--data", str(train), "--dev", str(dev),
               "--out", str(tmp_path / "out"), "--epochs", "1", "--batch-size", "8", "--no-progress",
               "train.plot=false", "train.tensorboard=false"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "checkpoints" / "best" / "eval.json").is_file()


def test_pairs_file_bom_blank_lines_and_encoding(tmp_path):
    """A UTF-8 byte order mark is dropped, blank lines (a trailing one included) are skipped as the other
    readers skip them, and bytes that are not UTF-8 are one error naming the file and line."""
    from qkv.config import ConfigError
    from qkv.finetune.seq2seq import read_pairs

    path = tmp_path / "p.tsv"
    path.write_bytes(b"\xef\xbb\xbfa b\tb a\n\nc\tc\n\n")
    assert read_pairs(path) == [("a b", "b a", 1), ("c", "c", 3)]
    path.write_bytes(b"a\tb\nc\xe9\td\n")
    with pytest.raises(ConfigError, match=r"p.tsv:2: not UTF-8 text \(byte 0xe9 at column 2\)"):
        read_pairs(path)
