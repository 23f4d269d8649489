"""GenerationConfig: every generation setting in one validated dataclass, with Hugging Face's field names.

    cfg = GenerationConfig(max_new_tokens=64, do_sample=True, top_p=0.9)
    cfg = GenerationConfig.from_dict({"max_new_tokens": 64, ...})     # strict: unknown keys are errors
    cfg = GenerationConfig.from_model_folder("path/to/hf-model")      # its generation_config.json
    generate(model, ids, cfg) / stream(...) / beam_search(...) / Engine(model, cfg) / add_request(..., cfg)

A setting that changes the next-token distribution is a logits processor (processors.py): a new option is
one field here plus one processor class there. Token-id fields left at None take the model's defaults
(model.generation_defaults(): its eos / pad / bos ids, a loaded folder's generation_config.json).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from qkv.config import ConfigError, check_bounds, from_dict, load_yaml, replace, setting, suggest, to_dict

EARLY_STOPPING = (True, False, "never")
CONTEXT_OVERFLOW = ("error", "slide")
DEFAULT_MAX_NEW_TOKENS = 32
# Temperatures below this decode greedily: logits divided by less overflow fp32 (a temperature of 1e-40
# turns every score into +-inf and the sampler's probabilities into NaN). vLLM draws the line at the same
# place.
MIN_TEMPERATURE = 1e-5
# OpenAI's bound on top_logprobs: the most likely tokens listed beside each token (vLLM's max_logprobs too)
MAX_TOP_LOGPROBS = 20
# a user's request's one rule beyond the library's (the CLI and the server read it): asking for no new tokens
# is a mistake there, while the library takes 0 (an engine request that only reads its prompt)
REQUEST_AT_LEAST = {"max_new_tokens": 1}

# generation_config.json keys that say nothing about which tokens are produced: bookkeeping, and what to
# return or which cache class to use
_HF_METADATA = {"_from_model_config", "transformers_version", "_commit_hash", "generation_kwargs",
                "output_attentions", "output_hidden_states", "output_scores", "output_logits",
                "return_dict_in_generate", "cache_implementation", "cache_config"}


def _remember_given_fields(cls: type) -> type:
    """Wrap a dataclass's __init__ to record which fields the caller named (`_given`): a field set *to* its
    default (do_sample=False, temperature=1.0) must still win over a model folder's generation_config.json,
    as it does in transformers, and a value alone cannot tell "set to the default" from "left unset"."""
    init, names = cls.__init__, [f.name for f in fields(cls)]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = frozenset(names[:len(args)]) | frozenset(kwargs)
        # every field named: a copy (dataclasses.replace, a whole to_dict), not a caller's choice of each; the
        # fields that differ from their defaults then stand for what was set (explicit())
        self._given = given if len(given) < len(names) else frozenset()
        init(self, *args, **kwargs)

    __init__.__doc__, __init__.__signature__ = init.__doc__, inspect.signature(init)
    cls.__init__ = __init__
    return cls


@_remember_given_fields
@dataclass
class GenerationConfig:
    # -- length -------------------------------------------------------------------------------------------
    max_new_tokens: int | None = setting(None, "tokens to generate", ge=0)  # None: max_length's, else 32
    max_length: int | None = setting(
        None, "prompt + new tokens (decoder-only) or decoder tokens incl. the start, as in HF", ge=0)
    min_new_tokens: int | None = setting(None, "no eos before this many new tokens", ge=0)
    min_length: int | None = setting(None, "the same, counted like max_length", ge=0)
    # -- strategy -----------------------------------------------------------------------------------------
    do_sample: bool = setting(False, "sample from the processed distribution (else greedy / beam search)")
    num_beams: int = setting(1, "> 1: beam search", ge=1)
    num_return_sequences: int = setting(1, "sequences returned per input (samples, or the best beams)", ge=1)
    length_penalty: float = setting(1.0, "beam score = sum log p / length ** length_penalty")
    early_stopping: bool | str = setting(
        "never", "beam search: stop at num_beams finished (true), HF's heuristic (false), exact (never)",
        choices=EARLY_STOPPING)
    # -- logits processors (processors.py) ----------------------------------------------------------------
    temperature: float = setting(1.0, "divide the logits when sampling", ge=0,
                                  note=f"0, or below {MIN_TEMPERATURE}, = greedy")
    top_k: int | None = setting(None, "keep the k most likely tokens when sampling", ge=0,
                                 note="0 = no top-k")
    top_p: float | None = setting(
        None, "nucleus sampling: the smallest set of tokens with probability >= top_p", gt=0, le=1)
    min_p: float | None = setting(
        None, "drop tokens below min_p x the top token's probability when sampling", ge=0, le=1)
    repetition_penalty: float = setting(
        1.0, "CTRL: divide positive / multiply negative logits of seen tokens", gt=0)
    no_repeat_ngram_size: int = setting(0, "no n-gram of this size occurs twice", ge=0)
    bad_words_ids: list[list[int]] | None = setting(
        None, "token sequences never produced (OPUS-MT bans its pad token)")
    presence_penalty: float = setting(
        0.0, "OpenAI's: subtract it from the logit of every token already generated", ge=-2, le=2)
    frequency_penalty: float = setting(
        0.0, "OpenAI's: subtract it times the count of each token already generated", ge=-2, le=2)
    logit_bias: dict[int, float] | None = setting(
        None, "token id -> bias in [-100, 100] added to its logit (OpenAI's logit_bias)")
    grammar: str | None = setting(
        None, "only output this grammar allows: llguidance's Lark text or JSON grammar (generate/grammar.py: "
        "json_schema_grammar); needs a Hugging Face tokenizer and an eos token")
    # -- special tokens -----------------------------------------------------------------------------------
    eos_token_id: int | list[int] | None = setting(None, "stop tokens (None: the model's)")
    pad_token_id: int | None = setting(None, "fills finished rows (None: the model's, else the first eos, "
                                              "else 0)")
    bos_token_id: int | None = setting(
        None, "the model's begin-of-sequence id (seq2seq start when no decoder_start)")
    decoder_start_token_id: int | None = setting(None, "first decoder token of an encoder-decoder")
    forced_bos_token_id: int | None = setting(None, "forced as the first generated token")
    forced_eos_token_id: int | list[int] | None = setting(
        None, "forced as the last token when max_length is reached")
    stop_strings: list[str] | None = setting(
        None, "stop a row once its decoded continuation contains one (needs a tokenizer)")
    # -- run ----------------------------------------------------------------------------------------------
    seed: int | None = setting(None, "seeds sampling (a fresh generator per call)")
    use_cache: bool = setting(True, "KV cache (False: recompute the whole prefix every step)")
    # graph-captured decoding steps (generate/graphed.py): a string names another torch.compile backend
    compile: bool | str = setting(
        False, "True: torch.compile of the decoding step (CUDA graphs on a GPU; on a CPU one-row products as "
        "reductions, C++ wrapper); a string: a backend; False: eager")
    context_overflow: str = setting(
        "error", "prompt + new tokens longer than an absolute-position model's context: refuse (error), or "
        "go on over the last context-many tokens (slide)", choices=CONTEXT_OVERFLOW)
    # -- speculative decoding (speculative.py): drafts checked k at a time by one forward -------------------
    prompt_lookup_num_tokens: int | None = setting(
        None, "speculative decoding by prompt lookup: draft this many tokens that followed the last n-gram's "
        "first occurrence in the text so far", ge=1)
    max_matching_ngram_size: int | None = setting(
        None, "prompt lookup: the longest n-gram searched (None: 2, as transformers)", ge=1)
    num_assistant_tokens: int = setting(
        5, "speculative decoding with an assistant_model: tokens it drafts per verifying forward", ge=1)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ConfigError(f"GenerationConfig.{message}")

        check_bounds(self)
        need(self.bad_words_ids is None or (len(self.bad_words_ids) > 0 and all(
             len(w) > 0 and all(isinstance(i, int) and i >= 0 for i in w) for w in self.bad_words_ids)),
             "bad_words_ids must be a non-empty list of non-empty lists of token ids, got "
             f"{self.bad_words_ids}")
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        need(not (self.do_sample and self.num_beams > 1),
             "do_sample: beam search is deterministic: use do_sample=True or num_beams > 1, not both")
        need(self.num_beams > 1 or self.do_sample or self.num_return_sequences == 1,
             "num_return_sequences > 1 needs do_sample=True or num_beams >= num_return_sequences")
        need(self.num_beams == 1 or self.num_return_sequences <= self.num_beams,
             f"num_return_sequences ({self.num_return_sequences}) must be between 1 and num_beams "
             f"({self.num_beams})")
        need(self.compile is not None and (isinstance(self.compile, bool) or bool(self.compile)),
             f"compile must be true, false or a torch.compile backend name, got {self.compile!r}")
        need(not self.compile or self.use_cache, "compile: graph-captured decoding runs over the KV cache: "
             "use_cache must be true")
        need(not self.compile or self.num_beams == 1, "compile: graph-captured decoding is not implemented "
                                                      "for "
             "beam search (it reorders the cache every step)")
        need(not (self.prompt_lookup_num_tokens and (self.num_beams > 1 or self.compile)),
             "prompt_lookup_num_tokens: speculative decoding runs greedy or sampled decoding, eagerly: not "
             "with beam search or compile")
        need(self.grammar is None or self.num_beams == 1, "grammar: a grammar follows one sequence per row; "
             "beam search reorders its rows every step: use num_beams=1")
        need(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
             f"grammar must be a non-empty string, got {self.grammar!r}")
        if isinstance(self.stop_strings, str):
            self.stop_strings = [self.stop_strings]

    # -- building one ---------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationConfig:
        """Strict: an unknown key is an error naming the closest field; values are type-checked."""
        return from_dict(cls, dict(data), "GenerationConfig")

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], source: str = "generation_config.json") -> GenerationConfig:
        """A Hugging Face generation_config.json dict. Its bookkeeping keys are dropped; a decoding option
        qkv does not implement is named in a warning (never applied silently), the rest is strict."""
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        ignored = sorted(k for k in data if k not in names and k not in _HF_METADATA)
        if ignored:
            warnings.warn(f"{source}: ignoring options qkv does not implement: {ignored}", stacklevel=2)
        try:
            return from_dict(cls, known, source)
        except ConfigError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_model_folder(cls, folder: str | os.PathLike) -> GenerationConfig:
        """The folder's generation_config.json (Hugging Face or qkv), or the defaults when it has none."""
        path = Path(folder) / "generation_config.json"
        if not path.is_file():
            return cls()
        return cls.from_hf_dict(_json_mapping(path), str(path))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> GenerationConfig:
        """A JSON (e.g. a generation_config.json) or YAML file of settings; Hugging Face's file layout is
        read as from_hf_dict, anything else strictly."""
        p = Path(path)
        if p.suffix in (".yaml", ".yml"):
            data = load_yaml(p)
        else:
            if not p.is_file():
                raise ConfigError(f"generation config not found: {p}")
            data = _json_mapping(p)
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping")
        if "transformers_version" in data or "_from_model_config" in data:
            return cls.from_hf_dict(data, str(p))
        return from_dict(cls, data, str(p))

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def replace(self, **overrides: Any) -> GenerationConfig:
        """A copy with `overrides` (field names, checked like from_dict)."""
        names = [f.name for f in fields(self)]
        for key in overrides:
            if key not in names:
                raise ConfigError(f"unknown generation option {key!r}{suggest(key, names)}")
        new = replace(self, **overrides)
        new._given = self.given() | frozenset(overrides)
        return new

    def given(self) -> frozenset[str]:
        """The fields named when this config was built or replaced (set, even if to their default)."""
        return getattr(self, "_given", frozenset())

    def explicit(self) -> dict[str, Any]:
        """What a merge carries over: the fields given a value (even their default's: do_sample=False over a
        folder's do_sample=true), and any other field that differs from its default. A field left at None
        stays unset: token ids then come from the model, as the module docstring says."""
        default, given = GenerationConfig(), self.given()
        return {f.name: v for f in fields(self)
                if ((v := getattr(self, f.name)) is not None and f.name in given)
                or v != getattr(default, f.name)}

    # -- derived values -----------------------------------------------------------------------------------
    def new_tokens(self, prompt_len: int) -> int:
        """max_new_tokens, or max_length minus the `prompt_len` decoder tokens already there, or 32."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is not None:
            if self.max_length <= prompt_len:  # as transformers refuses it, rather than generating nothing
                raise ValueError(f"max_length={self.max_length} counts the prompt, which has {prompt_len} "
                                 "tokens: "
                                 "nothing would be generated; set max_new_tokens instead (or a larger "
                                 "max_length)")
            return self.max_length - prompt_len
        return DEFAULT_MAX_NEW_TOKENS

    def min_tokens(self, prompt_len: int) -> int:
        """min_new_tokens, or min_length minus the prompt's decoder tokens, or 0."""
        if self.min_new_tokens is not None:
            return self.min_new_tokens
        if self.min_length is not None:
            return max(0, self.min_length - prompt_len)
        return 0

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([int(e)] if isinstance(e, int) else [int(i) for i in e])

    @property
    def sampling(self) -> bool:
        return self.do_sample and self.temperature >= MIN_TEMPERATURE


LOGIT_BIAS_LIMIT = 100  # OpenAI's bound on a logit_bias value: -100 bans a token, 100 forces it


def _checked_logit_bias(bias: dict | None) -> dict[int, float] | None:
    """logit_bias with int keys (a JSON file's keys are strings: "50256" -> 50256) and finite float values in
    [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]; None or {} for none."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for k, v in bias.items():
        key = int(k) if isinstance(k, str) and k.strip().isdigit() else k
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            raise ConfigError(f": keys must be token ids (integers >= 0), got {k!r}", "logit_bias",
                              "GenerationConfig")
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or abs(v) > LOGIT_BIAS_LIMIT):
            raise ConfigError(f"[{key}] must be a number in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}], got "
                              f"{v!r}", "logit_bias", "GenerationConfig")
        out[key] = float(v)
    return out


def _json_mapping(path: Path) -> dict[str, Any]:
    """A JSON file whose top level is a mapping; a ConfigError naming the file otherwise (not UTF-8
    included)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def resolve(defaults: dict[str, Any], config: GenerationConfig | None,
            overrides: dict[str, Any]) -> GenerationConfig:
    """The settings of one call, as Hugging Face merges them: the model's defaults (HF names), then the
    fields a passed config gives (config.explicit()), then keyword overrides."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise TypeError(f"generation_config must be a GenerationConfig, got {type(config).__name__}")
    chosen = dict(config.explicit()) if config is not None else {}
    chosen.update(overrides)
    if isinstance(chosen.get("stop_strings"), str):
        chosen["stop_strings"] = [chosen["stop_strings"]]
    base = GenerationConfig.from_dict(defaults) if defaults else GenerationConfig()
    return merge(base, chosen)


def merge(base: GenerationConfig, chosen: dict[str, Any]) -> GenerationConfig:
    """`base` (defaults: a model folder's, a task's) with the caller's `chosen` fields over it. Beams asked
    for without a word on sampling switch off the defaults' do_sample (an instruct model's folder samples by
    default; beam search and sampling are exclusive), rather than failing on a setting the caller never
    made."""
    if chosen.get("num_beams", 1) > 1 and "do_sample" not in chosen:
        chosen = {**chosen, "do_sample": False}
    return base.replace(**chosen) if chosen else base
