"""`qkv generate` from any folder: a run folder (its task decides what a prompt means), a Hugging Face folder
(its tokenizer.json), an encoder-decoder folder; streamed through generate.text.stream_pieces when asked."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

import torch

import qkv.generate
from qkv.config import ConfigError
from qkv.generate.config import GenerationConfig, resolve
from qkv.generate.text import StreamDecoder, decode_continuation, stream_pieces
from qkv.interop.gguf_model import is_gguf
from qkv.interop.gguf_tokenizer import load_gguf_tokenizer
from qkv.interop.tokenizer import HFTokenizer, load_hf_tokenizer
from qkv.run.folders import load_model_any, load_run_task, model_folder, run_folder_of
from qkv.tasks.tokenizers import Tokenizer, find_tokenizer


def generate_text(path: str | Path, prompt: str, generation_config: GenerationConfig | None = None, *,
                  greedy: bool = False, seed: int | None = 0, stream: bool = False, strict: bool = False,
                  quantize: str | None = None, assistant: str | Path | None = None, **options: Any) -> str:
    """Decode with whatever the library has: the run's task decides what a prompt means (a source
    sentence for seq2seq, a text prefix for an LM); a Hugging Face folder needs its tokenizer.json.
    Settings: `generation_config` (e.g. read from a file) then `options` (GenerationConfig fields, None =
    unset). Without a config, language models sample unless greedy=True or num_beams > 1; a given config
    decides do_sample itself (greedy=True still wins);
    max_new_tokens defaults to the task's natural length (an LM's sample_tokens, a seq2seq task's longest
    target), 200 for a bare model folder. seed seeds the sampling; None: a new seed each call, said on stderr
    when the decoding samples (the way to repeat the run).
    Prompt characters outside the vocabulary are named in a warning on stderr (strict=True: an error).
    quantize: "int8" / "int4" weight-only quantized weights (qkv.nn.quant). assistant: a model folder of the
    same tokenizer that drafts for speculative decoding (qkv.generate.speculative; Hugging Face folders)."""
    fresh = seed is None
    seed = secrets.randbelow(2**31) if seed is None else seed  # unseeded: differs between runs
    torch.manual_seed(seed)
    model = load_model_any(path, quantize)
    model.eval()
    run = run_folder_of(path)
    cfg = _settings(model, run, generation_config, options, greedy, seed, fresh)
    if run is not None:
        if assistant is not None:
            raise ConfigError("--speculative MODEL: a draft model needs a Hugging Face model folder; for a "
                              "run use --speculative prompt-lookup")
        task = load_run_task(run)
        _check_prompt_vocabulary(task.tokenizer, prompt, strict)
        if stream and task.kind == "decoder" and hasattr(task, "chars_per_token"):
            return _stream_lm(model, task.tokenizer, prompt, task.decoding(cfg))
        text = task.generate_text(model, prompt, cfg)
        if stream:
            print(text)
        return text
    return _generate_folder(model, Path(path), prompt, cfg, stream, strict, assistant, quantize)


def _settings(model: torch.nn.Module, run: Path | None, generation_config: GenerationConfig | None,
              options: dict[str, Any], greedy: bool, seed: int, fresh: bool) -> GenerationConfig:
    """generate_text's decoding settings: the config, the options over it, greedy and the seed applied."""
    cfg = generation_config if generation_config is not None else GenerationConfig()
    cfg = cfg.replace(**{k: v for k, v in options.items() if v is not None})
    # a pretrained encoder-decoder folder decodes as its generation_config.json says (greedy or beams), as in
    # HF
    folder_seq2seq = run is None and getattr(model, "is_seq2seq", False)
    if generation_config is None and "do_sample" not in options and not folder_seq2seq:
        cfg = cfg.replace(do_sample=cfg.num_beams == 1)  # a given config decides for itself
    # one sequence, the argmax each step: not a folder's beams either (OPUS-MT's and BART-CNN's are 4+)
    if greedy:
        cfg = cfg.replace(
            do_sample=False,
            **({} if "num_beams" in options and options["num_beams"] is not None else {"num_beams": 1}),
        )
    if cfg.num_return_sequences > 1:  # only the first would be printed
        raise ConfigError(
            f"num_return_sequences={cfg.num_return_sequences}: qkv generate prints one sequence; "
            "for several, call qkv.generate.generate from Python"
        )
    if cfg.seed is None:
        cfg = cfg.replace(seed=seed)
        defaults = model.generation_defaults() if hasattr(model, "generation_defaults") else {}
        if fresh and resolve(defaults, cfg, {}).sampling:
            print(f"qkv: sampling with seed {seed} (--seed {seed} repeats it)", file=sys.stderr)
    if run is not None and generation_config is not None and "do_sample" not in cfg.given():
        # the config's own (default: greedy), not the task's sampling
        cfg = cfg.replace(do_sample=cfg.do_sample)
    return cfg


def _generate_folder(model: torch.nn.Module, path: Path, prompt: str, cfg: GenerationConfig, stream: bool,
                     strict: bool, assistant: str | Path | None = None, quantize: str | None = None) -> str:
    """generate_text for a model folder outside a run: an encoder-decoder, a Hugging Face or a qkv folder."""
    folder_seq2seq = getattr(model, "is_seq2seq", False)
    folder = model_folder(path)
    _warn_unused_sampling(resolve(model.generation_defaults(), cfg, {}), cfg)
    if folder_seq2seq:  # the prompt is the source; the output is the target alone
        tok = folder_tokenizer(folder)
        _check_prompt_vocabulary(tok, prompt, strict)
        folder_defaults = model.generation_defaults()
        if not {"max_new_tokens", "max_length"} & (set(cfg.explicit()) | set(folder_defaults)):
            # 200, or what the decoder's positions hold after its start token (BART's 1024, a small model's
            # less)
            ctx = model.context_limit
            cfg = cfg.replace(max_new_tokens=200 if ctx is None else max(1, min(200, ctx - 1)))
        source = torch.tensor([tok.encode(prompt)])
        if stream:
            return _stream_seq2seq(model, tok, source, cfg)
        out = model.generate(source, cfg)
        return tok.decode(out[0].tolist())
    if not {"max_new_tokens", "max_length"} & (set(cfg.explicit()) | set(model.generation_defaults())):
        cfg = cfg.replace(max_new_tokens=200)  # the folder's own generation_config.json length, else 200
    hf = hf_folder_tokenizer(folder)
    if assistant is not None and (hf is None or folder_seq2seq):
        raise ConfigError("--speculative MODEL: a draft model needs a decoder-only Hugging Face folder with "
                          "a tokenizer.json; --speculative prompt-lookup works for every decoder")
    if hf is not None:
        _check_prompt_vocabulary(hf, prompt, strict)
        draft = None if assistant is None else load_assistant(assistant, hf, quantize)
        return _generate_hf(model, hf, prompt, cfg, stream, draft)
    tok = folder_tokenizer(folder)
    _check_prompt_vocabulary(tok, prompt, strict)
    ids = torch.tensor([tok.encode(prompt) or [0]])
    out = model.generate(ids, cfg)
    text = tok.decode(out[0, ids.shape[1]:].tolist())
    if stream:
        print(prompt + text)
    return prompt + text


def hf_folder_tokenizer(folder: str | Path) -> Any:
    """The HFTokenizer (special tokens, chat template) of a Hugging Face model folder (config.json with a
    model_type and a tokenizer.json), of a qkv model folder carrying Hugging Face tokenizer files (the chat
    recipe's output from a model qkv pretrained) or of a GGUF file; None for folders without tokenizer.json
    and for qkv folders whose tokenizer is qkv's own."""
    folder = Path(folder)
    if is_gguf(folder):
        return load_gguf_tokenizer(folder)
    if not (folder / "tokenizer.json").is_file() or (folder / "task.json").is_file():
        return None
    try:
        meta = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(meta, dict) or ("model_type" not in meta and "qkv_family" not in meta):
        return None
    if "qkv_family" in meta and not hugging_face_tokenizer_files(folder):
        return None  # qkv's own tokenizer files: the caller reads them (find_tokenizer)

    return load_hf_tokenizer(folder)


def hugging_face_tokenizer_files(folder: Path) -> bool:
    """tokenizer_config.json is a Hugging Face one (qkv's own names only its "kind")."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "kind" not in config


def load_assistant(path: str | Path, tokenizer: Any, quantize: str | None = None) -> torch.nn.Module:
    """The draft model of speculative decoding (a folder or GGUF file), refused unless its tokenizer has
    the target's vocabulary: the same ids must mean the same text."""
    draft_tok = hf_folder_tokenizer(model_folder(Path(path)))
    if draft_tok is None or draft_tok.tokenizer.get_vocab() != tokenizer.tokenizer.get_vocab():
        raise ConfigError(f"--speculative {path}: the draft model must have the same tokenizer (vocabulary) "
                          "as the model")
    return load_model_any(path, quantize).eval()


def _generate_hf(model: torch.nn.Module, tok: Any, prompt: str, cfg: GenerationConfig, stream: bool,
                 assistant: torch.nn.Module | None = None) -> str:
    """A Hugging Face folder: its tokenizer adds what its post-processor adds (Llama's bos); the
    continuation is decoded without special tokens, streamed piece by piece when asked.
    The continuation is what decoding prompt + new ids together adds to the decoded prompt (as transformers'
    decode of the whole output): decoded on its own, a SentencePiece-style (Metaspace) decoder would drop the
    leading space of its first token ("Hellocon" for "Hello con"). Streaming, the incremental decoder is
    given the prompt ids first, so that its pieces add up to the same suffix."""
    ids = tok.encode(prompt, add_special_tokens=True)
    if not ids:
        if tok.bos_token_id is None:
            raise ConfigError("an empty prompt needs a bos token, and this tokenizer has none: give --prompt")
        ids = [tok.bos_token_id]
    x = torch.tensor([ids])

    def text_of(t: list[int]) -> str:  # the text stop_strings are matched in
        return tok.decode(t, skip_special_tokens=True)

    # a grammar reads the tokenizer's vocabulary (stop strings are then matched with special tokens written)
    tokenizer = tok if cfg.grammar is not None else text_of
    if not stream:
        out = model.generate(x, cfg, tokenizer=tokenizer, assistant_model=assistant)
        return prompt + decode_continuation(lambda t: tok.decode(t, skip_special_tokens=True), ids,
                                            out[0, len(ids):].tolist())
    print(prompt, end="", flush=True)
    decoder = StreamDecoder(text_of, context=ids)  # the prompt's text is already printed: context only
    tokens = (int(new[0]) for new in qkv.generate.stream(model, x, cfg, tokenizer=tokenizer,
                                                         assistant_model=assistant))
    return prompt + stream_pieces(tokens, decoder, _write)


def _warn_unused_sampling(final: GenerationConfig, cfg: GenerationConfig) -> None:
    """Sampling settings given (a flag, a --generation-config file) where the decoding, once a model folder's
    own generation_config.json is merged, does not sample: said on stderr, as transformers warns, not dropped
    silently."""
    given = [k for k in ("temperature", "top_k", "top_p", "min_p") if k in cfg.explicit()]
    if given and not final.do_sample:
        how = f"beam search ({final.num_beams} beams)" if final.num_beams > 1 else "greedy decoding"
        print(
            f"qkv: warning: {', '.join(given)} only apply when sampling, and this decodes with {how} "
            "(the model folder's generation_config.json, or --greedy); add --sample to sample",
            file=sys.stderr,
        )


def _unknown_pieces(tok: Any, prompt: str) -> list[str]:
    """The parts of `prompt` a tokenizer reads as its unknown token: a qkv char/word tokenizer's symbols, or
    the text under each unk id of a Hugging Face `tokenizers` tokenizer (WordLevel / WordPiece / Unigram
    vocabularies have one; byte-level BPE never needs it)."""
    if tok is None:
        return []

    if isinstance(tok, Tokenizer):
        return tok.unknown_symbols(prompt)
    if not isinstance(tok, HFTokenizer):
        return []
    inner = tok.tokenizer
    unk = getattr(inner.model, "unk_token", None)
    unk_id = inner.token_to_id(unk) if isinstance(unk, str) else getattr(inner.model, "unk_id", None)
    if unk_id is None:
        return []
    enc = inner.encode(prompt, add_special_tokens=False)
    return list(dict.fromkeys(prompt[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk_id))


def _stream_seq2seq(model: torch.nn.Module, tok: Any, source: torch.Tensor, cfg: GenerationConfig) -> str:
    """An encoder-decoder folder, streamed: the target's tokens are printed as the decoder produces them
    (qkv.generate.stream, greedy or sampling: the same tokens model.generate returns). Each piece is what the
    new token adds to the decoded target so far (StreamDecoder over the folder tokenizer's decode, special
    tokens skipped), so the pieces add up to the non-streamed text. The decoder start token is not yielded;
    every tokenizer here skips it (a special token) when decoding the whole output."""
    tokens = (int(new[0]) for new in qkv.generate.stream(model, source, cfg))
    return stream_pieces(tokens, StreamDecoder(tok.decode), _write)


def _check_prompt_vocabulary(tok: Any, prompt: str, strict: bool) -> None:
    """A model reads symbols its vocabulary lacks as <unk>: say which (or refuse, strict=True)."""
    unknown = _unknown_pieces(tok, prompt)
    if not unknown:
        return
    shown = ", ".join(repr(u) for u in unknown[:10]) + (
        f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else ""
    )
    if strict:
        raise ConfigError(f"the prompt has {len(unknown)} symbol(s) outside the model's vocabulary: {shown}")
    print(
        f"qkv: warning: {len(unknown)} prompt symbol(s) outside the model's vocabulary, read as <unk>: "
        f"{shown}",
        file=sys.stderr,
    )


def _stream_lm(model: torch.nn.Module, tok: Any, prompt: str, cfg: GenerationConfig) -> str:
    """Print a language model's continuation token by token as it is produced (qkv.generate.stream)."""
    ids = tok.encode(prompt) or [tok.eos_id if tok.eos_id is not None else 0]
    print(prompt, end="", flush=True)
    # a byte-level BPE character can span tokens: decoded one by one it would print U+FFFD for each part
    tokens = (int(new[0]) for new in qkv.generate.stream(model, torch.tensor([ids]),
                                                   cfg.replace(context_overflow="slide"), tokenizer=tok))
    return prompt + stream_pieces(tokens, StreamDecoder(tok.decode), _write)


def _write(piece: str) -> None:
    print(piece, end="", flush=True)


def folder_tokenizer(folder: Path):

    tok = find_tokenizer(folder)
    if tok is None:
        raise ConfigError(f"{folder} has no task.json and no tokenizer: cannot turn text into tokens")
    return tok
