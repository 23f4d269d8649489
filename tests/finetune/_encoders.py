"""Tiny BERT-family folders for the encoder recipe tests: random weights, a word-level tokenizer.json with
the family's special tokens and post-processor, all built here and saved to tmp_path (nothing downloaded)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(40)]
POS = ["good", "great", "fine", "nice"]  # a class-0 / class-1 signal for the synthetic task
NEG = ["bad", "awful", "poor", "worse"]
ENTITY = ["alice", "bob", "paris", "rome", "acme", "globex"]  # first words of entities (B-)
CONTINUATION = {"PER": ["smith", "jones"], "LOC": ["city", "north"], "ORG": ["inc", "corp"]}  # (I-)


def tokenizer_json(family: str) -> tuple[object, dict[str, int]]:
    """A tokenizers.Tokenizer over WORDS + signal words + entity words, with [CLS]/[SEP] (BERT, DistilBERT) or
    <s>/</s> (RoBERTa) added by its post-processor; words unknown to it become [UNK] / <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    if family == "roberta":
        specials = ["<s>", "<pad>", "</s>", "<unk>"]  # RoBERTa's ids: pad = 1
        cls, sep, unk = "<s>", "</s>", "<unk>"
    elif family == "deberta":
        specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]  # DeBERTa-v3's ids
        cls, sep, unk = "[CLS]", "[SEP]", "[UNK]"
    else:
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        cls, sep, unk = "[CLS]", "[SEP]", "[UNK]"
    cont = [w for ws in CONTINUATION.values() for w in ws]
    vocab = {t: i for i, t in enumerate(specials + WORDS + POS + NEG + ENTITY + cont)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # RoBERTa's pair template is <s> A </s></s> B </s>, all of token type 0 (its processor, RobertaProcessing)
    pair = f"{cls} $A {sep} {sep} $B {sep}" if family == "roberta" else f"{cls} $A {sep} $B:1 {sep}:1"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair,
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    return tok, vocab


def make_folder(path: Path, family: str = "bert", *, layers: int = 2, width: int = 32, max_pos: int = 64,
                seed: int = 0) -> Path:
    """A base model (BertModel / RobertaModel / DistilBertModel / DebertaV2Model) folder with its
    tokenizer.json. DeBERTa's is v3's configuration (relative positions only, shared keys, LayerNorm'd table,
    no token types) with 8 position buckets, so that the tests' sentences reach the log-bucketed distances."""
    import transformers

    tok, vocab = tokenizer_json(family)
    torch.manual_seed(seed)
    if family == "roberta":
        cfg = transformers.RobertaConfig(vocab_size=len(vocab), hidden_size=width, num_hidden_layers=layers,
                                         num_attention_heads=4, intermediate_size=2 * width,
                                         max_position_embeddings=max_pos + 2, type_vocab_size=1,
                                         pad_token_id=1, bos_token_id=0, eos_token_id=2)
        model = transformers.RobertaModel(cfg)
    elif family == "distilbert":
        cfg = transformers.DistilBertConfig(vocab_size=len(vocab), dim=width, n_layers=layers, n_heads=4,
                                            hidden_dim=2 * width, max_position_embeddings=max_pos,
                                            pad_token_id=0)
        model = transformers.DistilBertModel(cfg)
    elif family == "deberta":
        cfg = transformers.DebertaV2Config(vocab_size=len(vocab), hidden_size=width, num_hidden_layers=layers,
                                           num_attention_heads=4, intermediate_size=2 * width,
                                           max_position_embeddings=max_pos, relative_attention=True,
                                           position_buckets=8, max_relative_positions=max_pos,
                                           pos_att_type=["p2c", "c2p"], share_att_key=True,
                                           norm_rel_ebd="layer_norm",
                                           position_biased_input=False, type_vocab_size=0, pad_token_id=0)
        model = transformers.DebertaV2Model(cfg)
    else:
        cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=width, num_hidden_layers=layers,
                                      num_attention_heads=4, intermediate_size=2 * width,
                                      max_position_embeddings=max_pos, pad_token_id=0)
        model = transformers.BertModel(cfg)
    model.save_pretrained(path)
    # as a real folder has them: tokenizer.json + tokenizer_config.json + special_tokens_map.json
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **({"cls_token": "<s>", "sep_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
                                 if family == "roberta" else
                                 {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                                  "unk_token": "[UNK]"}))
    fast.save_pretrained(path)
    return path


def sentiment_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Separable synthetic task: a label-bearing word among 3-8 filler words (names as labels)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["pos", "neg"])
        words = rng.choices(WORDS, k=rng.randint(3, 8))
        words.insert(rng.randrange(len(words) + 1), rng.choice(POS if label == "pos" else NEG))
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_csv(path: Path, rows: list[dict[str, str]], sep: str = ",") -> Path:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=sep)
        w.writeheader()
        w.writerows(rows)
    return path


def conll_sentences(n: int, seed: int) -> list[list[tuple[str, str]]]:
    """Synthetic NER: filler words (O) with one- or two-word entities of three types (B-/I- tags); a second
    word comes from the type's continuation words (like "Smith" after a first name), so every tag is
    learnable."""
    rng = random.Random(seed)
    types = {"PER": ENTITY[0:2], "LOC": ENTITY[2:4], "ORG": ENTITY[4:6]}
    out = []
    for _ in range(n):
        sent = [(w, "O") for w in rng.choices(WORDS, k=rng.randint(2, 6))]
        for _ in range(rng.randint(1, 2)):
            typ = rng.choice(list(types))
            ent = [rng.choice(types[typ])] + ([rng.choice(CONTINUATION[typ])] if rng.random() < 0.5 else [])
            tagged = [(w, ("B-" if j == 0 else "I-") + typ) for j, w in enumerate(ent)]
            at = rng.choice([i for i in range(len(sent) + 1) if i == len(sent) or sent[i][1][0] != "I"])
            sent[at:at] = tagged
        out.append(sent)
    return out


def write_conll(path: Path, sentences: list[list[tuple[str, str]]]) -> Path:
    lines = ["-DOCSTART- -X- O", ""]
    for s in sentences:
        lines += [f"{w} NN {t}" for w, t in s] + [""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
