"""`qkv generate` and `qkv chat`: their command lines and what they run. The sampling flags are generated from
GenerationConfig's fields (qkv.cli.flags), so their bounds and help are GenerationConfig's: temperature 0 is
greedy here as in the API and the server."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qkv.cli.flags import add_flags, add_quantize, check_flags, read_flags
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


def add_speculative(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, metavar="prompt-lookup|MODEL",
                   help="speculative decoding (one sequence): 'prompt-lookup' drafts the tokens that "
                        "followed the last words where they occur earlier in the text (fast when the answer "
                        f"copies the prompt: rewriting, editing; {PROMPT_LOOKUP_TOKENS} per step), or a "
                        "small model folder of the same tokenizer drafts; the model checks the drafts in one "
                        "forward. The same tokens as without it (greedy), the same distribution (sampling)")


def speculative_flags(spec: str | None) -> tuple[dict[str, Any], str | None]:
    """--speculative as (GenerationConfig fields, the draft model's path or None)."""
    if spec is None:
        return {}, None
    if spec == "prompt-lookup":
        return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}, None
    return {}, spec


def add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a run folder, a checkpoint folder, a Hugging Face folder or a GGUF "
                                      "file")
    p.add_argument("--prompt", "--input", default="", help="text prompt (source sentence for seq2seq models)")
    add_flags(p, GenerationConfig, only=GENERATE_FLAGS, defaults=GENERATE_DEFAULTS, rules=REQUEST_RULES)
    p.add_argument("--early-stopping", choices=["true", "false", "never"], default=None,
                   help="beam search: stop at num_beams finished (true), HF's heuristic (false), exact "
                        "(never)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--greedy", action="store_true",
                     help="greedy decoding: the argmax each step, one beam (default: sample for LMs; a model "
                          "folder's generation_config.json decides for itself)")
    how.add_argument("--sample", action="store_true",
                     help="sample (with --temperature / --top-k / --top-p), also where a model folder's "
                          "generation_config.json decodes greedily or with beams")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling (default: a new one each run, printed on stderr to repeat it)")
    p.add_argument("--logit-bias", action="append", default=None, metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit; repeat the flag for more tokens")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--generation-config", default=None, metavar="FILE",
                   help="a JSON or YAML file of generation settings (qkv.generate.GenerationConfig fields, "
                        "Hugging Face names, e.g. a model's generation_config.json); the flags above "
                        "override it")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="structured output: only JSON valid against this JSON schema file (a Hugging Face "
                        "folder's tokenizer; ends at the model's eos; qkv.generate.grammar)")
    p.add_argument("--strict", action="store_true",
                   help="refuse a prompt with characters outside the model's vocabulary (default: warn, read "
                        "them as <unk>)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decoding step with torch.compile (the first run compiles for a minute "
                        "or more, later runs reuse ~/.cache/qkv/inductor; one sequence, no beams)")
    add_speculative(p)
    add_quantize(p)


def _check_generate_flags(a: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """The sampling flags given, out-of-range ones a one-line error by GenerationConfig's rule (the API's
    and the server's; qkv.cli.flags)."""
    from qkv.config import ConfigError

    flags = read_flags(a, GenerationConfig, only=names, rules=REQUEST_RULES)
    if getattr(a, "stream", False) and flags.get("num_beams", 1) > 1:
        raise ConfigError("--stream prints tokens as they are sampled, but beam search (--num-beams > 1) "
                          "only knows its sequence at the end: use one or the other")
    return flags


def _logit_bias(pairs: list[str] | None) -> dict[int, float] | None:
    """--logit-bias ID=BIAS flags as GenerationConfig.logit_bias (its own check of ids and bounds)."""
    from qkv.config import ConfigError

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


def _loading(model: str) -> None:
    """Say that a model is loading (seconds for a large one) to a person at a terminal; a script's stderr
    keeps only what went wrong."""
    if sys.stderr.isatty():
        print(f"loading {model}...", file=sys.stderr, flush=True)


def cmd_generate(a: argparse.Namespace) -> int:
    from qkv.run import generate_text

    # a flag left out leaves the file's (or the task's, the folder's) value alone; one given wins, even at 1.0
    flags = _check_generate_flags(a, GENERATE_FLAGS)
    cfg = GenerationConfig.from_file(a.generation_config) if a.generation_config else None
    early = {"true": True, "false": False, "never": "never"}.get(a.early_stopping)
    if early is not None:
        flags["early_stopping"] = early
    if a.sample:  # one sampled sequence: not a folder's beams
        flags.update(do_sample=True, num_beams=flags.get("num_beams", 1))
    if a.compile:
        flags["compile"] = True
    spec, assistant = speculative_flags(a.speculative)
    flags.update(spec)
    bias = _logit_bias(a.logit_bias)
    if bias:
        check_flags(GenerationConfig, {"logit_bias": bias})
        flags["logit_bias"] = bias
    if a.json_schema:
        from qkv.generate.grammar import schema_file_grammar

        flags["grammar"] = schema_file_grammar(a.json_schema)
    _loading(a.checkpoint)
    out = generate_text(a.checkpoint, a.prompt, cfg, greedy=a.greedy, seed=a.seed, stream=a.stream,
                        strict=a.strict, quantize=a.quantize, assistant=assistant, **flags)
    if not a.stream:
        print(out if out.strip() else "(empty output: the model ended the sequence at once, or generated "
                                      "only special tokens)")
    return 0


def add_chat(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Hugging Face model folder with tokenizer.json (and a chat template), or "
                                 "a GGUF file")
    p.add_argument("--message", action="append", default=None,
                   help="answer this message and exit (repeat for several turns); without it: interactive")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--image", default=None, help="an image file for the first message (a vision-language "
                   "folder: llava); in the interactive chat, /image PATH sets another")
    add_flags(p, GenerationConfig, only=CHAT_FLAGS, defaults=CHAT_DEFAULTS, rules=REQUEST_RULES)
    p.add_argument("--greedy", action="store_true",
                   help="greedy decoding. Default: what the folder's generation_config.json says "
                        "(do_sample); greedy when it says nothing; --temperature / --top-k / --top-p sample")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling (default: a new one each run, printed on stderr to repeat it)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decoding step with torch.compile (the first answer waits for the "
                        "compile; later runs reuse ~/.cache/qkv/inductor)")
    add_speculative(p)
    add_quantize(p)


def cmd_chat(a: argparse.Namespace) -> int:
    import secrets

    from qkv.chat import ChatSession, chat_loop
    from qkv.config import ConfigError
    from qkv.generate.config import resolve

    flags = _check_generate_flags(a, CHAT_FLAGS)
    if a.message is not None and not all(m.strip() for m in a.message):
        raise ConfigError("--message is empty")
    seed = a.seed if a.seed is not None else secrets.randbelow(2**31)  # unseeded: differs between runs
    cfg = GenerationConfig(**flags, seed=seed)
    if a.greedy:
        cfg = cfg.replace(do_sample=False)
    elif a.temperature or a.top_k or a.top_p:
        cfg = cfg.replace(do_sample=True)
    if a.compile:
        cfg = cfg.replace(compile=True)
    spec, assistant = speculative_flags(a.speculative)
    cfg = cfg.replace(**spec) if spec else cfg
    _loading(a.model)
    from qkv.chat_vision import VisionChatSession, is_vision_folder

    if a.image is not None or is_vision_folder(a.model):  # an image, or a model whose template wants parts
        session = VisionChatSession.from_folder(a.model, a.quantize, image=a.image, system=a.system,
                                                generation_config=cfg)
        if assistant is not None:
            raise ConfigError("--speculative MODEL: not with a vision-language chat (use prompt-lookup)")
    else:
        session = ChatSession.from_folder(a.model, a.quantize, system=a.system, generation_config=cfg)
        if assistant is not None:
            from qkv.run import load_assistant

            session.assistant_model = load_assistant(assistant, session.tokenizer, a.quantize)
    defaults = session.model.generation_defaults() if hasattr(session.model, "generation_defaults") else {}
    if a.seed is None and resolve(defaults, cfg, {}).sampling:
        print(f"qkv: sampling with seed {seed} (--seed {seed} repeats it)", file=sys.stderr)
    if a.message is None:
        chat_loop(session)
        return 0
    for message in a.message:
        print(session.reply(message))
    return 0
