"""Language modelling on a text file: character-level or byte-level BPE.

Corpus: `path` (any UTF-8 text file) or one that is always on the machine (qkv.tasks.corpora), so the task
needs no download: `corpus: pydoc` (the default: Python's bundled documentation text, `pydoc_data.topics`,
~465k characters) or `corpus: stdlib` (the standard library's own .py sources, ~12 MB; task `stdlib_lm`).

Split: for a text (a file, pydoc) the first (1 - val_fraction) of the characters are train, the rest val
(nanoGPT's convention), cut at a character boundary before tokenising; for `stdlib` whole files, chosen by a
stable hash of their path (no file in both splits, see qkv.tasks.corpora); with `val_path` the held-out text
is that file and `path` is all train (`qkv speedrun` splits modules itself). Tokenizer: `char` = the distinct
characters of the whole text (val included, so val has no unknown characters, as in nanoGPT); `bpe` =
byte-level BPE trained on the train split only, `bpe_vocab_size` tokens, or read from `tokenizer_file` (a
tokenizer.json trained beforehand).

Batches: `batch_size` random windows of `context` tokens from the split, window starts drawn from a
stream seeded by (seed, split, index). input_ids = labels = the window (B, context): the model shifts the
labels, so a window gives context - 1 next-token targets, and the model's context_length is `context`.

Evaluation: mean next-token cross-entropy over windows that tile the val split (stride context - 1, so
each val token after the first is predicted at most once, with 1 to context - 1 tokens of context; the split's
last tokens after the last whole window, fewer than context - 1, are not scored; n < all takes n evenly spaced
windows), reported as val_loss (nats/token), perplexity = exp(val_loss) and bits per
character bpc = val_loss / ln 2 * (val tokens / val characters) (1 token = 1 character for `char`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from qkv.config import ConfigError, setting
from qkv.generate.config import GenerationConfig, merge
from qkv.tasks.base import (
    Task,
    check_split,
    model_device,
    read_text_file,
    register_task,
    rng_for,
    text_sha256,
)
from qkv.tasks.corpora import CORPORA, pydoc_text, stdlib_texts
from qkv.tasks.options import check_option, check_options
from qkv.tasks.tokenizers import BPETokenizer, CharTokenizer, Tokenizer


def default_corpus() -> str:
    """Python's bundled documentation text: pydoc_data.topics values in sorted-key order."""
    return pydoc_text()


@dataclass
class LMOptions:
    path: str | None = setting(None, "UTF-8 text file", none="the built-in corpus")
    val_path: str | None = setting(None, "a held-out text file (path is then all train)", none="split path")
    tokenizer_file: str | None = setting(None, "a tokenizer.json to use (tokenizer=bpe)", none="train one")
    corpus: str = setting("pydoc", "built-in text: bundled docs, or stdlib .py files", choices=tuple(CORPORA))
    tokenizer: Literal["char", "bpe"] = setting("char", "char, or bpe (byte-level BPE of the train split)")
    bpe_vocab_size: int = setting(1024, "BPE vocabulary, specials and the 256 bytes included")
    context: int = setting(64, "tokens per training window = the model's context_length", ge=2)
    val_fraction: float = setting(0.1, "last share of the text held out", gt=0, lt=1)
    seed: int = setting(0, "seeds the batch stream and the samples")
    sample_prompt: str = setting("\n", "where samples() starts generating")
    sample_tokens: int = setting(200, "tokens generated per sample", ge=0)
    # samples()' sampling holds to GenerationConfig's rule, as `qkv generate`, `qkv chat` and the server do
    temperature: float = setting(0.8, "samples()' temperature (GenerationConfig's rule: 0 = greedy)")
    top_k: int | None = setting(None, "samples() draw among the top k tokens (0 = no top-k)", none="no top-k")

    def validate(self) -> None:
        check_options(self)
        check_option(self.path is None or self.corpus == "pydoc", "corpus",
                     f": give either path or corpus={self.corpus!r}, not both")
        check_option(self.val_path is None or self.path is not None, "val_path", "needs path (train text)")
        check_option(self.tokenizer_file is None or self.tokenizer == "bpe", "tokenizer_file",
                     "is a byte-level BPE's tokenizer.json: set tokenizer=bpe")
        try:
            GenerationConfig(temperature=self.temperature, top_k=self.top_k)
        except ConfigError as e:
            raise ConfigError(e.problem, e.field, "task") from None


class LMTask(Task):
    kinds = ("decoder",)
    metrics = {"val_loss": "min", "perplexity": "min", "bpc": "min"}

    def __init__(self, options: LMOptions, family: str, tokenizer: Tokenizer | None = None) -> None:
        self.options = o = options
        self.family = family
        self.missing = None
        for name in ("path", "val_path", "tokenizer_file"):  # absolute in task.json: `qkv eval` and --resume
            if getattr(o, name):  # from another folder read the same file
                setattr(o, name, str(Path(getattr(o, name)).expanduser().resolve()))
        try:
            if o.corpus == "stdlib":
                split = stdlib_texts(o.val_fraction)
                train_text, val_text = split["train"], split["val"]
            else:
                text = read_text_file(o.path) if o.path else default_corpus()
                if o.path:
                    self.data_sha256 = text_sha256(text)
                if o.val_path:  # held out by the caller (whole files: qkv speedrun's modules)
                    train_text, val_text = text, read_text_file(o.val_path)
                else:
                    cut = int(len(text) * (1 - o.val_fraction))
                    train_text, val_text = text[:cut], text[cut:]
        except ConfigError as e:
            if tokenizer is None:
                raise
            # rebuilt from a run folder whose text file is gone: the saved tokenizer still serves
            # generate_text()/samples(); batches and evaluation say what is missing
            self.tokenizer, self.missing, self.data, self.n_chars = tokenizer, str(e), {}, {}
            return
        if tokenizer is None:
            if o.tokenizer == "char":
                tokenizer = CharTokenizer.from_text(train_text + val_text)
            elif o.tokenizer_file:
                tokenizer = BPETokenizer.from_file(o.tokenizer_file)
            else:
                tokenizer = BPETokenizer.train(text_chunks(train_text), vocab_size=o.bpe_vocab_size)
        elif unknown := tokenizer.unknown_symbols(train_text + val_text):
            # the run's saved vocabulary on a text that changed since: training and evaluation would read
            # <unk>, so they say so (as for a text that is gone); the tokenizer still serves
            # generate_text()/samples()
            shown = ", ".join(repr(u) for u in unknown[:10]) + (" ..." if len(unknown) > 10 else "")
            self.missing = (f"{o.path or o.corpus}: {len(unknown)} character(s) the run's saved vocabulary "
                            f"does not have ({shown}): the text changed since the run was trained; train a "
                            "new run on it (another --out)")
            self.tokenizer, self.data, self.n_chars = tokenizer, {}, {}
            return
        self.tokenizer = tokenizer
        self.data = {"train": self._encode(train_text), "val": self._encode(val_text)}
        self.n_chars = {"train": len(train_text), "val": len(val_text)}
        for split, ids in self.data.items():
            if len(ids) < o.context:
                raise ConfigError(f"the {split} split has {len(ids)} tokens, fewer than one window of "
                                  f"context={o.context}; use a longer text or a smaller context")

    def _encode(self, text: str) -> Tensor:
        tok = self.tokenizer
        if isinstance(tok, BPETokenizer):
            ids = [i for part in tok.encode_batch(text_chunks(text)) for i in part]
        else:
            ids = tok.encode(text)
        return torch.tensor(ids, dtype=torch.long)

    @property
    def chars_per_token(self) -> float:
        return self.n_chars["val"] / len(self.data["val"])

    def _need_data(self) -> None:
        if self.missing:
            raise ConfigError(self.missing)

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        check_split(split)
        self._need_data()
        data, T = self.data[split], self.options.context
        rng = rng_for(self.options.seed, split, index, "lm")
        starts = torch.tensor([rng.randrange(len(data) - T + 1) for _ in range(batch_size)])
        x = data[starts[:, None] + torch.arange(T)]  # (B, T)
        return {"input_ids": x, "labels": x.clone()}

    def model_overrides(self, family: str | None = None) -> dict[str, Any]:
        self._check_family(family)
        return {"vocab_size": self.tokenizer.vocab_size, "context_length": self.options.context}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, n: int | None = None,
                 batch_size: int = 64) -> dict[str, float]:
        """Validation loss over windows tiling the val split (all of them, or n evenly spaced)."""
        self._need_data()
        data, T = self.data["val"], self.options.context
        starts = list(range(0, len(data) - T + 1, T - 1))
        if n is not None and n < len(starts):
            starts = [starts[round(i * (len(starts) - 1) / max(1, n - 1))] for i in range(n)]
        dev = model_device(model)
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        try:
            for b in range(0, len(starts), batch_size):
                s = torch.tensor(starts[b:b + batch_size])
                x = data[s[:, None] + torch.arange(T)].to(dev)
                out = model(input_ids=x, labels=x)
                total += float(out.loss) * int(out.n_targets)
                count += int(out.n_targets)
        finally:
            model.train(was_training)
        loss = total / max(1, count)
        return {"val_loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                "bpc": loss / math.log(2) / self.chars_per_token, "n_tokens": float(count)}

    def decoding(self, generation_config: GenerationConfig | None = None, *, greedy: bool = False,
                 **options: Any) -> GenerationConfig:
        """The settings of samples(): this task's sampling options (sample_tokens, temperature, top_k, seed),
        then the config's explicit fields, then keywords (None = unset). greedy=True (or do_sample=False, or
        num_beams > 1) decodes deterministically."""
        o = self.options
        base = GenerationConfig(max_new_tokens=o.sample_tokens, do_sample=True, temperature=o.temperature,
                                top_k=o.top_k, seed=o.seed)
        chosen = dict(generation_config.explicit()) if generation_config is not None else {}
        chosen.update({k: v for k, v in options.items() if v is not None})
        if greedy:
            chosen["do_sample"] = False
        cfg = merge(base, chosen)
        if cfg.max_new_tokens is None:
            cfg = cfg.replace(max_new_tokens=cfg.new_tokens(0) if cfg.max_length is not None
                                  else o.sample_tokens)
        return cfg

    def samples(self, model: torch.nn.Module, n: int = 1, prompt: str | None = None,
                generation_config: GenerationConfig | None = None, *, greedy: bool = False,
                **options: Any) -> list[str]:
        """`n` texts generated from `prompt` (default options.sample_prompt), prompt included, each
        max_new_tokens long (default options.sample_tokens), however long the context: generation runs in
        chunks that fit it, each restarting from the last context // 2 tokens (a sliding window). Settings
        as decoding(): sampled with the task's temperature / top_k by default, seeded by its seed (one
        random stream for all n samples)."""
        o = self.options
        cfg = self.decoding(generation_config, greedy=greedy, **options)
        prompt = o.sample_prompt if prompt is None else prompt
        ids = self.tokenizer.encode(prompt) or [self.tokenizer.eos_id]
        ctx = o.context
        new = cfg.max_new_tokens
        dev = model_device(model)
        gen = torch.Generator(device=dev).manual_seed(cfg.seed if cfg.seed is not None else o.seed)
        cfg = cfg.replace(seed=None, max_new_tokens=None, max_length=None)  # one stream over all calls (gen)
        kw = cfg.explicit()
        out = []
        for _ in range(n):
            seq = torch.tensor([ids[-(ctx - 1):]], dtype=torch.long, device=dev)
            produced: list[int] = []
            while len(produced) < new:
                step = min(ctx - seq.shape[1], new - len(produced))
                res = model.generate(seq, step, generator=gen, tokenizer=self.tokenizer, **kw)
                produced += res[0, seq.shape[1]:].tolist()
                if res.shape[1] - seq.shape[1] < step:  # it ended early: an eos id or one of stop_strings
                    break
                seq = res[:, -(ctx // 2):]
            out.append(prompt + self.tokenizer.decode(produced))
        return out

    def generate_text(self, model: torch.nn.Module, prompt: str,
                      generation_config: GenerationConfig | None = None, **options: Any) -> str:
        """One continuation of `prompt`, prompt included (settings as in samples())."""
        return self.samples(model, 1, prompt, generation_config, **options)[0]


def text_chunks(text: str, size: int = 4096) -> list[str]:
    """Cut text into pieces (at newlines where possible) so BPE works on bounded strings; the cut points
    never fall inside a word more than once per `size` characters."""
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        out.append(text[start:end])
        start = end
    return out


def _factory(options: LMOptions, family: str, tokenizer: Tokenizer | None = None) -> Task:
    return LMTask(options, family, tokenizer)


register_task("lm", LMOptions, _factory, ("decoder",), "language modelling on a text file (char or BPE)",
              default_family="gpt")
register_task("charlm", LMOptions, _factory, ("decoder",),
              "character-level LM (default text: Python's bundled docs)", default_family="gpt",
              tokenizer="char")
register_task("bpelm", LMOptions, _factory, ("decoder",),
              "byte-level BPE LM (default text: Python's bundled docs)", default_family="gpt",
              tokenizer="bpe")
register_task("stdlib_lm", LMOptions, _factory, ("decoder",),
              "byte-level BPE LM on the Python standard library's sources (~12 MB, file-level split)",
              default_family="gpt", tokenizer="bpe", corpus="stdlib", bpe_vocab_size=4096)
