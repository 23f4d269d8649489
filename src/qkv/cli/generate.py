"""`qkv generate` and `qkv chat`: their command lines and what they run. The sampling flags are generated from
GenerationConfig's fields (qkv.cli.flags), so their bounds and help are GenerationConfig's: temperature 0 is
greedy here as in the API and the server."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qkv.cli.args import ChatArgs, GenerateArgs
from qkv.cli.flags import QUANTIZE, FlagSet, check_flags, read_flags, read_settings
from qkv.config import ConfigError
from qkv.generate.config import REQUEST_AT_LEAST, GenerationConfig

# the sampling flags, generated from GenerationConfig's fields (qkv.cli.flags): its bounds and help text
GENERATE_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "num_beams", "length_penalty",
                  "no_repeat_ngram_size", "repetition_penalty", "min_new_tokens", "presence_penalty",
                  "frequency_penalty", "context_overflow")
CHAT_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p")
# a command's rule beyond the library's: asking for no new tokens is a mistake here
REQUEST_RULES = {name: {"ge": at_least} for name, at_least in REQUEST_AT_LEAST.items()}
GENERATE_DEFAULTS = {"max_new_tokens": "an LM's sample length, 200; a seq2seq task's longest target",
                     "temperature": "the task's or the folder's, else 1.0", "num_beams": "1",
                     "context_overflow": "error for a model folder, slide for an LM run"}
CHAT_DEFAULTS = {"max_new_tokens": "512, capped by what the context leaves",
                 "temperature": "the folder's generation_config.json"}
# --speculative prompt-lookup: the drafted tokens per verifying forward (transformers' documented example's)
PROMPT_LOOKUP_TOKENS = 10
# the flags of each command: its own, the sampling settings, --quantize
GENERATE = (FlagSet(GenerateArgs), FlagSet(GenerationConfig, GENERATE_FLAGS, GENERATE_DEFAULTS,
                                           REQUEST_RULES), QUANTIZE)
CHAT = (FlagSet(ChatArgs), FlagSet(GenerationConfig, CHAT_FLAGS, CHAT_DEFAULTS, REQUEST_RULES), QUANTIZE)


def speculative_flags(spec: str | None) -> tuple[dict[str, Any], str | None]:
    """--speculative as (GenerationConfig fields, the draft model's path or None)."""
    if spec is None:
        return {}, None
    if spec == "prompt-lookup":
        return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}, None
    return {}, spec


def _check_generate_flags(a: argparse.Namespace, stream: bool, names: tuple[str, ...]) -> dict[str, Any]:
    """The sampling flags given, out-of-range ones a one-line error by GenerationConfig's rule (the API's
    and the server's; qkv.cli.flags)."""
    flags = read_flags(a, GenerationConfig, only=names, rules=REQUEST_RULES)
    if stream and flags.get("num_beams", 1) > 1:
        raise ConfigError("--stream prints tokens as they are sampled, but beam search (--num-beams > 1) "
                          "only knows its sequence at the end: use one or the other")
    return flags


def _logit_bias(pairs: list[str] | None) -> dict[int, float] | None:
    """--logit-bias ID=BIAS flags as GenerationConfig.logit_bias (its own check of ids and bounds)."""
    if not pairs:
        return None
    out: dict[int, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise ConfigError(f"--logit-bias takes ID=BIAS (a token id and a number), got {pair!r}") from None
        if not sep:
            raise ConfigError(f"--logit-bias takes ID=BIAS, got {pair!r}")
    return out


def _loading(model: str, compile: bool = False) -> None:
    """Say that a model is loading (seconds for a large one), and with --compile what the first step costs,
    to a person at a terminal; a script's stderr keeps only what went wrong."""
    if sys.stderr.isatty():
        print(f"loading {model}...", file=sys.stderr, flush=True)
        if compile:
            print("--compile: the first token waits for the decoding step to compile (about 2 minutes for a "
                  "135M model on 2 CPU cores, once per model shape; then ~10 s, its code kept under "
                  "$QKV_CACHE/inductor, default ~/.cache/qkv/inductor)", file=sys.stderr, flush=True)


def cmd_generate(a: argparse.Namespace) -> int:
    from qkv.run import generate_text

    s = read_settings(a, GenerateArgs)
    if s.greedy and s.sample:
        raise ConfigError("--greedy and --sample: give one of them")
    # a flag left out leaves the file's (or the task's, the folder's) value alone; one given wins, even at 1.0
    flags = _check_generate_flags(a, s.stream, GENERATE_FLAGS)
    cfg = GenerationConfig.from_file(s.generation_config) if s.generation_config else None
    early = {"true": True, "false": False, "never": "never"}.get(s.early_stopping or "")
    if early is not None:
        flags["early_stopping"] = early
    if s.sample:  # one sampled sequence: not a folder's beams
        flags.update(do_sample=True, num_beams=flags.get("num_beams", 1))
    if s.compile:
        flags["compile"] = True
    spec, assistant = speculative_flags(s.speculative)
    flags.update(spec)
    bias = _logit_bias(s.logit_bias)
    if bias:
        check_flags(GenerationConfig, {"logit_bias": bias})
        flags["logit_bias"] = bias
    if s.json_schema:
        from qkv.generate.grammar import schema_file_grammar

        flags["grammar"] = schema_file_grammar(s.json_schema)
    _loading(s.checkpoint, s.compile)
    out = generate_text(s.checkpoint, s.prompt, cfg, greedy=s.greedy, seed=s.seed, stream=s.stream,
                        strict=s.strict, quantize=QUANTIZE.read(a).get("quantize"), assistant=assistant,
                        **flags)
    if not s.stream:
        print(out if out.strip() else "(empty output: the model ended the sequence at once, or generated "
                                      "only special tokens)")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    import secrets

    from qkv.chat import ChatSession, chat_loop
    from qkv.generate.config import resolve

    s = read_settings(a, ChatArgs)
    flags = _check_generate_flags(a, False, CHAT_FLAGS)
    if s.message is not None and not all(m.strip() for m in s.message):
        raise ConfigError("--message is empty")
    quantize = QUANTIZE.read(a).get("quantize")
    seed = s.seed if s.seed is not None else secrets.randbelow(2**31)  # unseeded: differs between runs
    cfg = GenerationConfig(**flags, seed=seed)
    if s.greedy:
        cfg = cfg.replace(do_sample=False)
    elif any(flags.get(k) for k in ("temperature", "top_k", "top_p")):
        cfg = cfg.replace(do_sample=True)
    if s.compile:
        cfg = cfg.replace(compile=True)
    spec, assistant = speculative_flags(s.speculative)
    cfg = cfg.replace(**spec) if spec else cfg
    _loading(s.model, s.compile)
    from qkv.chat_vision import VisionChatSession, is_vision_folder

    if s.image is not None or is_vision_folder(s.model):  # an image, or a model whose template wants parts
        session = VisionChatSession.from_folder(s.model, quantize, image=s.image, system=s.system,
                                                generation_config=cfg)
        if assistant is not None:
            raise ConfigError("--speculative MODEL: not with a vision-language chat (use prompt-lookup)")
    else:
        session = ChatSession.from_folder(s.model, quantize, system=s.system, generation_config=cfg)
        if assistant is not None:
            from qkv.run import load_assistant

            session.assistant_model = load_assistant(assistant, session.tokenizer, quantize)
    defaults = session.model.generation_defaults() if hasattr(session.model, "generation_defaults") else {}
    if s.seed is None and resolve(defaults, cfg, {}).sampling:
        print(f"qkv: sampling with seed {seed} (--seed {seed} repeats it)", file=sys.stderr)
    if s.message is None:
        chat_loop(session)
        return 0
    for message in s.message:
        print(session.reply(message))
    return 0
