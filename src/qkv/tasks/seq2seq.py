"""Sequence-to-sequence tasks: copy, reverse, sort and multi-digit addition, plus the shared machinery
(encoding per model kind, greedy evaluation, BLEU) that the translation tasks reuse.

Examples are (source, target) strings of single-character symbols, e.g. reverse: "31415" -> "51413",
addition: "123+989" -> "1112".

Encoding, by model kind (ids from one character tokenizer, specials from tokenizers.SPECIALS):
- seq2seq (EncoderDecoder): input_ids = source (B, S) right-padded with <pad>, attention_mask (B, S)
  1 = real token, labels = target + <eos> (B, T), -100 on padding. The model builds decoder inputs
  [<bos>, target] itself.
- decoder (GPT, the LSTM, any decoder-only family): one sequence [source, <sep>, target, <eos>] (B, L)
  right-padded, with attention_mask, and labels = the same ids where the target and <eos> are, -100 on the
  prompt (source, <sep>) and on padding. Labels are aligned with input_ids: the model shifts them (the logit
  at <sep> is scored against the first target token).

Held-out split: an example is in `val` iff a hash of its source string falls in the first `val_fraction`
of the hash range (base.in_val_split). Train batches reject val sources and vice versa, so the splits are
disjoint over the whole example space, however small, and are the same for every seed.

Evaluation: greedy decoding with qkv.generate (seq2seq: from the source; decoder: from the prompt
[source, <sep>], prompts grouped by length so no padding is needed), scored by exact-sequence match
(the decoded string equals the target exactly, <eos> included in the sense that nothing extra is
generated before it), with per-position token accuracy as an extra.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.generate.config import GenerationConfig
from qkv.tasks.base import Task, check_split, in_val_split, model_device, pad_rows, register_task, rng_for
from qkv.tasks.options import check_option, check_options
from qkv.tasks.tokenizers import EOS, PAD, SEP, CharTokenizer, Tokenizer

SYMBOL_ALIASES = {"digits": "0123456789", "letters": "abcdefghijklmnopqrstuvwxyz"}
MAX_TRIES = 100_000  # rejection sampling of a split; more means the split is (nearly) empty


def _cut_at_eos(row: list[int]) -> list[int]:
    return row[:row.index(EOS)] if EOS in row else row


class PairTask(Task):
    """A task whose examples are (source, target) strings. Subclasses set `self.tokenizer`,
    `self.max_src_tokens`, `self.max_tgt_tokens` and implement `pairs(index, batch_size, split)` and
    `eval_pairs(n)`."""

    kinds = ("seq2seq", "decoder")
    bleu_tokenize: str | None = None  # sacrebleu tokenizer; None = no BLEU (synthetic tasks)
    metrics = {"exact_match": "max", "token_accuracy": "max", "bleu": "max"}
    max_src_tokens: int
    max_tgt_tokens: int

    def pairs(self, index: int, batch_size: int, split: str) -> list[tuple[str, str]]:
        raise NotImplementedError

    def eval_pairs(self, n: int) -> list[tuple[str, str]]:
        raise NotImplementedError

    # -- encoding ---------------------------------------------------------------------------------------
    def encode_pair(self, src: str, tgt: str) -> tuple[list[int], list[int]]:
        return self.tokenizer.encode(src), self.tokenizer.encode(tgt)

    def collate(self, pairs: list[tuple[str, str]]) -> dict[str, Tensor]:
        enc = [self.encode_pair(s, t) for s, t in pairs]
        if self.kind == "seq2seq":
            src = [s for s, _ in enc]
            tgt = [t + [EOS] for _, t in enc]
            input_ids = pad_rows(src, PAD)
            mask = pad_rows([[1] * len(s) for s in src], 0)
            labels = pad_rows(tgt, -100)
            return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
        seqs = [s + [SEP] + t + [EOS] for s, t in enc]
        input_ids = pad_rows(seqs, PAD)
        mask = pad_rows([[1] * len(q) for q in seqs], 0)
        labels = pad_rows([[-100] * (len(s) + 1) + t + [EOS] for s, t in enc], -100,
                          length=input_ids.shape[1])
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        check_split(split)
        return self.collate(self.pairs(index, batch_size, split))

    @property
    def context_length(self) -> int:
        if self.kind == "seq2seq":
            # decoder positions: [bos, target, eos] (generate counts the final token's position too)
            return max(self.max_src_tokens, self.max_tgt_tokens + 2)
        return self.max_src_tokens + self.max_tgt_tokens + 2  # [source, sep, target, eos]

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        tok = self.tokenizer
        needs = {"vocab_size": tok.vocab_size, "context_length": self.context_length}
        if self.kind == "seq2seq":  # one shared vocabulary; the decoder starts from bos
            needs.update(pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
        return needs

    # -- decoding and evaluation ------------------------------------------------------------------------
    def decoding(self, generation_config: GenerationConfig | None = None, **options: Any) -> GenerationConfig:
        """The settings of a prediction: greedy by default (a translation is a decision, not a sample, so
        do_sample is off), max_new_tokens = the longest target + eos unless set, stop at <eos>."""
        cfg = generation_config if generation_config is not None else GenerationConfig()
        cfg = cfg.replace(**{k: v for k, v in options.items() if v is not None}, do_sample=False,
                          eos_token_id=EOS)
        if cfg.max_new_tokens is None and cfg.max_length is None:
            cfg = cfg.replace(max_new_tokens=self.max_tgt_tokens + 1)
        return cfg

    @torch.no_grad()
    def predict_ids(self, model: torch.nn.Module, sources: list[list[int]], batch_size: int = 128,
                    generation_config: GenerationConfig | None = None) -> list[list[int]]:
        """Target ids (without <eos>) for each tokenised source, via model.generate (the shared qkv.generate
        for every kind of model); greedy with at most max_tgt_tokens + 1 tokens unless the config says
        otherwise."""
        dev = model_device(model)
        cfg = self.decoding(generation_config)
        # HF-style keywords: generate(x, max_new_tokens, eos_token_id=..., ...), the settings that differ from
        # the defaults
        max_new, kw = cfg.new_tokens(1), {k: v for k, v in cfg.explicit().items() if k != "max_new_tokens"}
        out: list[list[int] | None] = [None] * len(sources)
        if self.kind == "seq2seq":
            for start in range(0, len(sources), batch_size):
                chunk = sources[start:start + batch_size]
                x = pad_rows(chunk, PAD).to(dev)
                mask = pad_rows([[1] * len(s) for s in chunk], 0).to(dev)
                ids = model.generate(x, max_new, attention_mask=mask, **kw)
                for i, row in enumerate(ids.tolist()):
                    out[start + i] = _cut_at_eos(row)
            return out  # type: ignore[return-value]
        # decoder-only: group prompts by length (no padding inside a generate call)
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(sources):
            by_len.setdefault(len(s), []).append(i)
        for _, idx in sorted(by_len.items()):
            for start in range(0, len(idx), batch_size):
                chunk = idx[start:start + batch_size]
                x = torch.tensor([sources[i] + [SEP] for i in chunk], dtype=torch.long, device=dev)
                ids = model.generate(x, max_new, **kw)[:, x.shape[1]:]
                for i, row in zip(chunk, ids.tolist()):
                    out[i] = _cut_at_eos(row)
        return out  # type: ignore[return-value]

    def predict(self, model: torch.nn.Module, sources: list[str], batch_size: int = 128) -> list[str]:
        """Greedy translations of source strings."""
        ids = self.predict_ids(model, [self.tokenizer.encode(s) for s in sources], batch_size)
        return [self.tokenizer.decode(r) for r in ids]

    def evaluate(self, model: torch.nn.Module, n: int = 500, batch_size: int = 128) -> dict[str, float]:
        """Held-out metrics on the first `n` evaluation pairs: exact_match (whole target right),
        token_accuracy (per target position, <eos> included), and bleu where the task defines it."""
        pairs = self.eval_pairs(n)
        enc = [self.encode_pair(s, t) for s, t in pairs]
        pred_ids = self.predict_ids(model, [s for s, _ in enc], batch_size)
        hyps = [self.tokenizer.decode(p) for p in pred_ids]
        refs = [t for _, t in pairs]
        n_special = len(self.tokenizer.specials)
        # right = the same ids, or (BPE) the same text from specials-free ids tokenised differently
        exact = sum(p == t or (h == r and min(p, default=n_special) >= n_special)
                    for p, (_, t), h, r in zip(pred_ids, enc, hyps, refs))
        right = total = 0
        for p, (_, t) in zip(pred_ids, enc):
            t = t + [EOS]
            p = p + [EOS]
            right += sum(a == b for a, b in zip(p, t))
            total += len(t)
        metrics = {"exact_match": exact / max(1, len(pairs)), "token_accuracy": right / max(1, total),
                   "n": float(len(pairs))}
        if self.bleu_tokenize is not None:
            import sacrebleu  # noqa: PLC0415  (sacrebleu: an optional extra, only for BLEU)

            metrics["bleu"] = float(sacrebleu.corpus_bleu(hyps, [refs], tokenize=self.bleu_tokenize).score)
        return metrics

    def generate_text(self, model: torch.nn.Module, prompt: str,
                      generation_config: GenerationConfig | None = None, **options: Any) -> str:
        """The translation of one source string: greedy, or beam search with num_beams > 1, at most
        max_new_tokens tokens (default: the longest target + eos). do_sample is ignored (a translation is a
        decision, not a sample); the other settings apply (no_repeat_ngram_size, repetition_penalty, ...)."""
        src = self.tokenizer.encode(prompt)
        cfg = self.decoding(generation_config, **options)
        # a decoder with absolute positions cannot go past its table: stop there, and say so
        prompt_len = 1 if self.kind == "seq2seq" else len(src) + 1
        limit = model.context_limit
        if limit is not None and prompt_len + cfg.new_tokens(prompt_len) > limit:
            room = max(0, limit - prompt_len)
            warnings.warn(f"max_new_tokens={cfg.new_tokens(prompt_len)} goes past this model's {limit} "
                          f"decoder positions; generating at most {room} tokens", stacklevel=2)
            cfg = cfg.replace(max_new_tokens=room, max_length=None)
        if cfg.num_beams <= 1:
            return self.tokenizer.decode(self.predict_ids(model, [src], generation_config=cfg)[0])
        x = torch.tensor([src if self.kind == "seq2seq" else src + [SEP]], device=model_device(model))
        ids = model.generate(x, cfg)
        row = ids[0].tolist() if self.kind == "seq2seq" else ids[0, x.shape[1]:].tolist()
        return self.tokenizer.decode(_cut_at_eos(row))

    def samples(self, model: torch.nn.Module, n: int = 5) -> list[str]:
        """'source -> prediction' lines for n held-out examples, marked right/wrong."""
        pairs = self.eval_pairs(n)
        hyps = self.predict(model, [s for s, _ in pairs])
        return [f"{s} -> {h}" + ("  (ok)" if h == t else f"  (expected {t})")
                    for (s, t), h in zip(pairs, hyps)]


# -- synthetic tasks ---------------------------------------------------------------------------------------
@dataclass
class SequenceOptions:
    min_len: int = setting(10, "shortest source sequence, in symbols", ge=1)
    max_len: int = setting(20, "longest source sequence, in symbols")
    symbols: str = setting("digits", "the alphabet, one character per symbol; aliases: digits, letters")
    seed: int = setting(0, "seeds the train/val batch streams and the evaluation set")
    val_fraction: float = setting(0.1, "share of the example space (by source hash) held out", gt=0, lt=1)

    def validate(self) -> None:
        check_options(self, ("min_len", "max_len"))
        alphabet = self.alphabet
        check_option(alphabet != "" and len(set(alphabet)) == len(alphabet), "symbols",
                     f"must be distinct characters (or digits/letters), got {self.symbols!r}")
        check_option(not any(c.isspace() for c in alphabet), "symbols", "cannot contain whitespace")

    @property
    def alphabet(self) -> str:
        return SYMBOL_ALIASES.get(self.symbols, self.symbols)


class SyntheticTask(PairTask):
    """Examples drawn from a generator; the split is the hash split of the source string."""

    def __init__(self, options: Any, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options = options
        self.family = family
        self.tokenizer = tokenizer or CharTokenizer(self.token_symbols())
        self.max_src_tokens, self.max_tgt_tokens = self.max_lengths()

    def token_symbols(self) -> str:
        return self.options.alphabet

    def max_lengths(self) -> tuple[int, int]:
        return self.options.max_len, self.options.max_len

    def example(self, rng: Any) -> tuple[str, str]:
        raise NotImplementedError

    def draw(self, rng: Any, split: str) -> tuple[str, str]:
        want_val = split == "val"
        for _ in range(MAX_TRIES):
            src, tgt = self.example(rng)
            if in_val_split(src, self.options.val_fraction) == want_val:
                return src, tgt
        raise ConfigError(f"task {self.name!r}: the {split} split of this example space is (nearly) empty; "
                          "enlarge the space (lengths, symbols) or change val_fraction")

    def pairs(self, index: int, batch_size: int, split: str) -> list[tuple[str, str]]:
        rng = rng_for(self.options.seed, split, index, self.name)
        return [self.draw(rng, split) for _ in range(batch_size)]

    def eval_pairs(self, n: int) -> list[tuple[str, str]]:
        rng = rng_for(self.options.seed, "val", 0, self.name + "/eval")
        return [self.draw(rng, "val") for _ in range(n)]

    def random_source(self, rng: Any) -> str:
        o = self.options
        return "".join(rng.choices(o.alphabet, k=rng.randint(o.min_len, o.max_len)))


class CopyTask(SyntheticTask):
    """target = source (the Annotated Transformer's copy task)."""

    def example(self, rng: Any) -> tuple[str, str]:
        s = self.random_source(rng)
        return s, s


class ReverseTask(SyntheticTask):
    """target = source reversed."""

    def example(self, rng: Any) -> tuple[str, str]:
        s = self.random_source(rng)
        return s, s[::-1]


class SortTask(SyntheticTask):
    """target = source symbols sorted by their position in the alphabet (minGPT's sort demo:
    symbols='012', min_len=max_len=6)."""

    def example(self, rng: Any) -> tuple[str, str]:
        s = self.random_source(rng)
        order = {c: i for i, c in enumerate(self.options.alphabet)}
        return s, "".join(sorted(s, key=order.__getitem__))


@dataclass
class AdditionOptions:
    digits: int = setting(3, "most digits of each operand")
    min_digits: int = setting(1, "fewest digits of each operand", ge=1)
    reverse_answer: bool = setting(False, "sum written least-significant digit first (easier left-to-right)")
    seed: int = setting(0, "seeds the train/val batch streams and the evaluation set")
    val_fraction: float = setting(0.1, "share of the example space (by source hash) held out", gt=0, lt=1)

    def validate(self) -> None:
        check_options(self, ("min_digits", "digits"))


class AdditionTask(SyntheticTask):
    """'a+b' -> decimal a+b, operands with min_digits..digits digits (digit count uniform, then the number
    uniform among numbers of that many digits; no leading zeros)."""

    def token_symbols(self) -> str:
        return "0123456789+"

    def max_lengths(self) -> tuple[int, int]:
        d = self.options.digits
        return 2 * d + 1, d + 1

    def operand(self, rng: Any) -> int:
        k = rng.randint(self.options.min_digits, self.options.digits)
        return rng.randint(0 if k == 1 else 10 ** (k - 1), 10**k - 1)

    def example(self, rng: Any) -> tuple[str, str]:
        a, b = self.operand(rng), self.operand(rng)
        ans = str(a + b)
        return f"{a}+{b}", ans[::-1] if self.options.reverse_answer else ans


def _factory(cls: type) -> Any:
    def make(options: Any, family: str, tokenizer: Tokenizer | None = None) -> Task:
        return cls(options, family, tokenizer)

    return make


KINDS = ("seq2seq", "decoder")  # an encoder-decoder, or a decoder-only model on [source, <sep>, target]
register_task("copy", SequenceOptions, _factory(CopyTask), KINDS, "copy the source sequence",
              default_family="encdec")
register_task("reverse", SequenceOptions, _factory(ReverseTask), KINDS, "reverse the source sequence",
              default_family="encdec")
register_task("sort", SequenceOptions, _factory(SortTask), KINDS, "sort the source symbols",
              default_family="encdec")
register_task("addition", AdditionOptions, _factory(AdditionTask), KINDS, "multi-digit addition 'a+b' -> sum",
              default_family="encdec")
