"""`qkv attention DIR --input ...` on Hugging Face encoder-decoder folders (T5, BART, Marian): the decoder
sequence the maps are drawn for is the one transformers decodes or teacher-forces, and the maps are
transformers'.

- no --target: [decoder start] + transformers' greedy generate under the folder's generation_config.json
  (BART: decoder start </s>, forced BOS <s>, forced EOS; Marian: start = pad, banned words; T5: start = pad);
- --target TEXT: the decoder_input_ids transformers builds from labels = tokenizer(text_target=TEXT) by
  shift_tokens_right (the labels' final eos is dropped, the decoder start put first);
- the decoder self- and cross-attention maps equal transformers' output_attentions=True on those ids."""

from __future__ import annotations

import json

import pytest
import torch
from _seq2seq_models import V, bart, marian, t5

import qkv
from qkv.cli.main import main
from qkv.experiments.attention import attention_from_checkpoint, collect_attentions

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _word_tokenizer(folder, specials: list[str], single: str) -> None:
    """A word-level tokenizer.json over the model's ids (w{i} for the ids after the special tokens), with the
    folder family's post-processor (T5, Marian: "$A </s>"; BART: "<s> $A </s>")."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), V) if i not in vocab.values()})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(s, vocab[s]) for s in ("<s>", "</s>") if s in single])
    tok.save(str(folder / "tokenizer.json"))


def _t5(folder):
    hf = t5(folder, gated=True, seed=2)
    _word_tokenizer(folder, ["<pad>", "</s>", "<unk>"], "$A </s>")
    return hf


def _bart(folder):
    hf = bart(folder, seed=4)
    _word_tokenizer(folder, ["<s>", "<pad>", "</s>", "<unk>"], "<s> $A </s>")
    return hf


def _marian(folder):
    hf = marian(folder, seed=3)
    # Marian: </s> = 0 (eos), <unk> = 1, <pad> = V - 1 (the decoder start)
    _word_tokenizer(folder, ["</s>", "<unk>"] + [f"w{i}" for i in range(2, V - 1)] + ["<pad>"], "$A </s>")
    return hf


FOLDERS = {"t5": _t5, "bart": _bart, "marian": _marian}
SOURCE, TARGET = "w5 w9 w17 w30 w8", "w12 w40 w7"


def _hf_tokenizer(folder):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))


def _check_maps(hf, folder, src: list[int], dec: list[int], json_path) -> None:
    """qkv's maps on (src, dec) equal transformers' (every layer and head), and the maps the command drew
    (their per-head entropies in <stem>_entropy.json) are those."""
    hf = type(hf).from_pretrained(folder, attn_implementation="eager").eval()  # sdpa returns no weights
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([dec]), output_attentions=True)
    mine = collect_attentions(qkv.from_pretrained(folder), {"input_ids": torch.tensor([src]),
                                                            "decoder_input_ids": torch.tensor([dec])})
    for kind, ref in (("cross", out.cross_attentions), ("decoder self", out.decoder_attentions),
                      ("encoder self", out.encoder_attentions)):
        assert len(mine[kind]) == len(ref)
        for a, b in zip(mine[kind], ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    heads = json.loads(json_path.read_text())["heads"]
    ours = {(h["kind"], h["layer"], h["head"]): h["entropy_nats"] for h in heads}
    for kind, ref in (("cross", out.cross_attentions), ("decoder self", out.decoder_attentions),
                      ("encoder self", out.encoder_attentions)):
        for layer, w in enumerate(ref):  # the per-head entropy of transformers' maps equals ours
            p = w[0].double()
            ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
            # causal: the first query sees one key (one-hot), left out of the stats
            if kind == "decoder self":
                ent = ent[:, 1:]
            for h in range(p.shape[0]):
                assert (ours[(kind, layer, h)]
                        == pytest.approx(float(ent[h].mean()), abs=1e-4)), (kind, layer, h)


@pytest.mark.parametrize("name", list(FOLDERS))
def test_default_target_is_transformers_greedy_generate(tmp_path, name):
    hf = FOLDERS[name](tmp_path)
    tok = _hf_tokenizer(tmp_path)
    src = tok(SOURCE).input_ids
    with torch.no_grad():  # greedy under the folder's generation_config.json (its num_beams overridden)
        ref = hf.generate(input_ids=torch.tensor([src]), max_new_tokens=6, num_beams=1,
                          do_sample=False)[0].tolist()
    assert ref[0] == hf.config.decoder_start_token_id
    res = attention_from_checkpoint(tmp_path, SOURCE, tmp_path / "maps.png", max_new_tokens=6)
    assert res.tokens["target"] == tok.convert_ids_to_tokens(ref)
    assert res.tokens["source"] == tok.convert_ids_to_tokens(src)
    _check_maps(hf, tmp_path, src, ref, res.json_path)


@pytest.mark.parametrize("name", list(FOLDERS))
def test_target_text_is_teacher_forced_as_transformers_shifts_labels(tmp_path, name):
    hf = FOLDERS[name](tmp_path)
    tok = _hf_tokenizer(tmp_path)
    src, labels = tok(SOURCE).input_ids, tok(text_target=TARGET).input_ids
    c = hf.config
    dec = transformers.models.bart.modeling_bart.shift_tokens_right(
        torch.tensor([labels]), c.pad_token_id, c.decoder_start_token_id)[0].tolist()
    assert dec[0] == c.decoder_start_token_id and dec[1:] == labels[:-1] and labels[-1] == c.eos_token_id
    # the command draws them (through attention_from_checkpoint, as the test above)
    assert main(["attention", str(tmp_path), "--input", SOURCE, "--target", TARGET, "--out",
                 str(tmp_path / "cli.png")]) == 0
    assert json.loads((tmp_path / "cli_entropy.json").read_text())["tokens"]["target"] == \
        tok.convert_ids_to_tokens(dec)
    _check_maps(hf, tmp_path, src, dec, tmp_path / "cli_entropy.json")
    # and qkv explore's page teacher-forces a typed target the same way (it built [bos] + the target's ids)
    from qkv.explore import analyze, load

    assert analyze(load(tmp_path), SOURCE, target=TARGET)["ids"]["target"] == dec
