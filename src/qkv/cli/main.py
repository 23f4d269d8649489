"""`qkv` subcommands. Each is a small function over the library; SUBCOMMANDS maps name -> (setup, run).

Exit status (the same for every subcommand):
  0    done
  2    a user error (unknown preset, misspelt key, bad value, missing file, wrong checkpoint, a flag out of
       range): one line `qkv: error: ...`; `--debug` shows the traceback instead
  3    training stopped by the NaN guard (train.nan_policy): its report is printed above the one-line
       error and kept in OUT/train.log, with the offending batch and the last good checkpoint
  130  interrupted by SIGINT (Ctrl-C), 143 by SIGTERM: training finishes the current step and checkpoints it
       first (continue with --resume)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.cli.finetune import add_finetune, cmd_finetune
from qkv.cli.flags import (  # noqa: F401  (QUANTIZE_MODES: part of this module's API)
    QUANTIZE_MODES,
    add_flags,
    add_quantize,
    read_flags,
)
from qkv.cli.generate import add_chat, add_generate, cmd_chat, cmd_generate
from qkv.cli.info import add_info, cmd_info
from qkv.config import ConfigError
from qkv.generate.engine_config import EngineConfig
from qkv.serve.config import ServeConfig

EXIT_USER_ERROR = 2
EXIT_NAN_GUARD = 3
TRAIN_EPILOG = ("exit status: 0 done, 2 user error (one line 'qkv: error: ...'), 3 training stopped by the "
                "NaN guard, 130/143 interrupted by SIGINT/SIGTERM (the current step is checkpointed first; "
                "continue with --resume), 141 the reader of stdout went away (qkv presets | head)")
# the subcommands that train: the NaN guard and --resume
TRAINING = ("train", "demo", "ablate", "finetune", "speedrun")
EPILOG = ("exit status: 0 done, 2 user error (one line 'qkv: error: ...'), 130/143 interrupted by "
          "SIGINT/SIGTERM, "
          "141 the reader of stdout went away (qkv presets | head)")
# serve stops on SIGINT / SIGTERM by design (a graceful shutdown): that is its normal end, status 0
SERVE_EPILOG = ("exit status: 0 stopped by SIGINT/SIGTERM after a graceful shutdown, 1 the engine failed "
                "(so that a supervisor restarts it), 2 user error (one line 'qkv: error: ...', e.g. an "
                "address it cannot listen on)")


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="run YAML (see configs/); optional")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=1e-3 "
                                                "model.n_heads=8")
    p.add_argument("--task", help="task name (shortcut for task.name=...)")
    p.add_argument("--model", help="model preset (shortcut for model.preset=...)")
    p.add_argument("--out", help="output folder (default runs/<task>-<preset>)")
    p.add_argument("--max-steps", type=int, help="training steps (train.max_steps)")
    p.add_argument("--seed", type=int, help="random seed (train.seed and task.seed)")
    p.add_argument("--resume", action="store_true", help="continue from OUT's last checkpoint (train.resume)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (train.progress=false)")


def _train_flag_keys(a: argparse.Namespace) -> list[tuple[str, Any, str]]:
    """(flag, value given or None, the key=value it is a shortcut for) of `qkv train`."""
    return [("--task", a.task, "task.name"), ("--model", a.model, "model.preset"),
            ("--max-steps", a.max_steps, "train.max_steps"), ("--seed", a.seed, "train.seed"),
            ("--seed", a.seed, "task.seed"), ("--out", a.out, "train.out_dir"),
            ("--resume", True if a.resume else None, "train.resume"),
            ("--no-progress", False if a.no_progress else None, "train.progress")]


def cmd_train(a: argparse.Namespace) -> int:
    from qkv.config import check_flag_keys
    from qkv.run import command_line_config, train_run

    over = list(a.overrides)
    if a.config and "=" in a.config:  # `qkv train key=value ...` without a YAML file
        over.insert(0, a.config)
        a.config = None
    check_flag_keys(_train_flag_keys(a), over)  # over the YAML the command line wins, either form
    if a.task:
        over.append(f"task.name={a.task}")
    if a.model:
        over.append(f"model.preset={a.model}")
    if a.max_steps is not None:
        over.append(f"train.max_steps={a.max_steps}")
    if a.seed is not None:
        over += [f"train.seed={a.seed}", f"task.seed={a.seed}"]
    if a.no_progress:
        over.append("train.progress=false")
    cfg, out, resume = command_line_config(a.config, over, a.out, a.resume)  # resume: or train.resume: true
    summary = train_run(cfg, out=out, resume=resume)
    if summary["report"]:  # empty on ranks other than 0 under torchrun
        print(summary["report"])
    return 0


def _add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a run folder (from qkv train) or a checkpoint folder inside it")
    p.add_argument("-n", type=int, default=500, help="held-out examples to evaluate")


def cmd_eval(a: argparse.Namespace) -> int:
    from qkv.run import evaluate_run

    if a.n < 1:
        raise ConfigError(f"-n must be at least 1 (held-out examples to evaluate), got {a.n}")

    metrics = evaluate_run(a.checkpoint, n=a.n)
    for k, v in metrics.items():
        count = k == "n" or k.startswith("n_")  # examples and tokens: "n: 10", not "n: 10.0000"
        print(f"{k}: {int(v)}" if count and float(v).is_integer() else f"{k}: {v:.4f}" if isinstance(v, float)
              else f"{k}: {v}")
    return 0


def _add_presets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", action="store_true", help="also build each preset and count its parameters")


def cmd_presets(a: argparse.Namespace) -> int:
    from qkv.models.registry import preset, presets

    for name in presets():
        fam, cfg, desc = preset(name)
        count = ""
        if a.count:
            from qkv.models.registry import build

            count = f"{build(name).num_parameters():>14,}  "
        print(f"{name:<20} {fam.name:<8} {count}{desc}")
    return 0


def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="where checkpoints, metrics and plots go")
    p.add_argument("--quick", action="store_true", help="a much shorter run (for tests)")


def cmd_demo(a: argparse.Namespace) -> int:
    from qkv.demo import run_demo

    run_demo(Path(a.out), quick=a.quick)
    return 0


def _add_ablate(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", help="a suite YAML (configs/ablations/*.yaml) or its name")
    p.add_argument("--out", default=None, help="output folder (default runs/ablations/<suite>)")
    p.add_argument("--quick", action="store_true", help="the suite's quick size (under a minute)")
    p.add_argument("--scale", choices=("cpu", "gpu"), default="cpu",
                   help="size profile: cpu (the file as written) or gpu (its `scales: gpu` section)")
    p.add_argument("--only", default=None, metavar="FILTER",
                   help="run only the variants with every comma-separated item of FILTER: whole key=value "
                        "items of their names (n_heads=1 is not n_heads=16) or variant names, e.g. "
                        "'name=reverse,position=rope'; the report still covers every finished run in --out")
    p.add_argument("--force", action="store_true", help="redo runs that already finished (those --only "
                                                        "selects)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (1 is best on a busy "
                                                             "CPU)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs trained at once, each in its own process on the same device (default: the "
                        "suite's `jobs`, 1); each gets --threads threads or its share of the cores")


def cmd_ablate(a: argparse.Namespace) -> int:
    from qkv.experiments import run_suite

    report = run_suite(a.suite, out_dir=a.out, quick=a.quick, scale=a.scale, only=a.only, force=a.force,
                       threads=a.threads, jobs=a.jobs)
    print(f"report: {report}")
    return 0


def _add_attention(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a run folder, checkpoint folder or Hugging Face folder")
    p.add_argument("--input", required=True,
                   help="text to run through the model (a ViT: N, the first N held-out images in order, "
                        "1..32)")
    p.add_argument("--target", default=None,
                   help="encoder-decoders: the target sentence; the decoder reads [decoder start] + its "
                        "tokens less "
                        "the final eos, as teacher forcing (default: [decoder start] + the greedy output, as "
                        "qkv generate --greedy)")
    p.add_argument("--out", default="attention.png",
                   help="PNG to write (one per attention kind; .png is added to a name without an "
                        "extension); the per-head statistics go to <name>_entropy.json beside it")
    from qkv.experiments.vlm_attention import add_image_arguments

    add_image_arguments(p)  # --image, --layer, --token: a vision-language model's answer over the image


def cmd_attention(a: argparse.Namespace) -> int:
    from qkv.experiments.attention import image_path
    from qkv.experiments.attention_report import attention_report

    for line in attention_report(a.checkpoint, a.input, image_path(a.out), target=a.target, image=a.image,
                                 layer=a.layer, token=a.token):
        print(line)
    return 0


def _add_explore(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a run folder, checkpoint folder, Hugging Face folder (gpt2, bert, vit, "
                                 "whisper) or GGUF file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on, 1..65535 (default 8000; it "
                                                          "must be free)")
    p.add_argument("--input", default=None, help="with --export: the input to show (text; image index for a "
                                                 "ViT)")
    p.add_argument("--target", default=None, help="with --export: decoder input of an encoder-decoder")
    p.add_argument("--wav", default=None, help="with --export: a WAV file for an audio model")
    p.add_argument("--export", default=None, metavar="PAGE.html", help="write one self-contained page and "
                                                                       "exit")
    add_quantize(p)


def cmd_explore(a: argparse.Namespace) -> int:
    from qkv.explore.cli import explore

    return explore(a.model, host=a.host, port=a.port, text=a.input, target=a.target, export=a.export,
                   wav=a.wav, quantize=a.quantize)


def _add_predict(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an image classifier: a Hugging Face folder (vit, resnet) or a qkv image "
                                 "run; or a CLIP folder with --labels (zero-shot)")
    p.add_argument("images", nargs="*", metavar="IMAGE", help="image files (PNG, JPEG, ...)")
    p.add_argument("--image", nargs="+", default=[], metavar="IMAGE", help="image files (as IMAGE...)")
    p.add_argument("--top-k", type=int, default=5, help="classes shown per image (default 5)")
    p.add_argument("--labels", default=None,
                   help='a CLIP folder\'s classes, comma-separated: "a cat,a dog" (zero-shot)')
    p.add_argument("--template", default="{}", help='the text each label is put in, e.g. "a photo of {}"')
    p.add_argument("--text", nargs="+", default=None, metavar="TEXT",
                   help='a masked-LM folder: texts whose [MASK] tokens to fill, e.g. "Paris is the [MASK] of '
                        'France"')
    p.add_argument("--out", default=None, metavar="FILE.png",
                   help="a detector (DETR): draw the boxes found on the image into this file")
    p.add_argument("--threshold", type=float, default=0.5,
                   help="a detector: the least class probability a box is shown with (default 0.5)")


def cmd_predict(a: argparse.Namespace) -> int:
    from qkv.detect import is_detector
    from qkv.image_text import is_clip_folder, zero_shot
    from qkv.predict import fill_mask, format_fills, format_predictions, predict_images

    images = list(a.images) + list(a.image)
    if a.text is not None:
        if images or a.labels is not None:
            raise ConfigError("--text fills masks in texts; give it without images or --labels")
        for line in format_fills(fill_mask(a.model, a.text, a.top_k)):
            print(line)
        return 0
    if not images:
        raise ConfigError("give the image files to classify (IMAGE... or --image IMAGE...)")
    if is_detector(a.model):
        return predict_boxes(a.model, images, a.out, a.threshold)
    if a.out is not None:
        raise ConfigError(f"--out draws a detector's boxes; {a.model} is not a detector (a DETR)")
    if is_clip_folder(a.model):
        rows = zero_shot(a.model, images, a.labels, template=a.template, top_k=a.top_k)
    elif a.labels is not None:
        raise ConfigError(f"--labels needs a CLIP folder (zero-shot); {a.model} is an image classifier with "
                          "its own classes")
    else:
        rows = predict_images(a.model, images, a.top_k)
    for line in format_predictions(rows):
        print(line)
    return 0


def predict_boxes(model: str, images: list[str], out: str | None, threshold: float) -> int:
    from qkv.detect import detect, draw, drawing_format, format_detections, save_drawing

    if out is not None and len(images) != 1:
        raise ConfigError(f"--out draws one image's boxes; {len(images)} images given")
    if out is not None:
        drawing_format(out)
    for f, (image, found) in zip(images, detect(model, images, threshold)):
        for line in format_detections(f, found, threshold):
            print(line)
        if out is not None:
            print(f"drawn: {save_drawing(draw(image, found), out)}")
    return 0


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a qkv run folder, a qkv checkpoint folder, a Hugging Face folder or a GGUF "
                                 "file")
    # every other flag: a field of ServeConfig or EngineConfig, with its help, bounds and default
    add_flags(p, ServeConfig)
    add_flags(p, EngineConfig)


def cmd_serve(a: argparse.Namespace) -> int:
    from qkv.serve import serve

    given = {**read_flags(a, ServeConfig), **read_flags(a, EngineConfig)}
    return serve(a.model, **given)


def _add_embed(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a BERT / RoBERTa / XLM-R / DistilBERT / DeBERTa folder (Hugging Face "
                                 "format), or a CLIP folder")
    p.add_argument("--input", default=None, help="text file, one text per line")
    p.add_argument("--text", nargs="+", default=None, metavar="TEXT",
                   help="texts to embed (instead of --input)")
    p.add_argument("--image", nargs="+", default=None, metavar="IMAGE",
                   help="image files to embed (a CLIP folder)")
    p.add_argument("--out", default=None, help="write the embeddings here (.npy, one row per line)")
    p.add_argument("--query", default=None, help="print the input lines nearest to this text")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--pooling", choices=("mean", "cls"), default=None,
                   help="mean over tokens or the first token (default: the folder's 1_Pooling, else mean)")
    p.add_argument("--no-normalize", action="store_true", help="keep the raw pooled vectors")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-progress", action="store_true")


def cmd_embed(a: argparse.Namespace) -> int:
    from qkv.embed import run

    for line in run(a.model, a.input, texts=a.text, images=a.image, out=a.out, query=a.query, top_k=a.top_k,
                    pooling=a.pooling,
                    normalize=not a.no_normalize, batch_size=a.batch_size, device=a.device,
                    progress=not a.no_progress):
        print(line)
    return 0


def _add_transcribe(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Whisper folder (Hugging Face format)")
    p.add_argument("audio", nargs="+", metavar="AUDIO",
                   help="audio files (WAV, FLAC, OGG: what soundfile reads)")
    p.add_argument("--language", default=None, help="the spoken language (en, de, ...; default: detected)")
    p.add_argument("--task", choices=("transcribe", "translate"), default=None,
                   help="transcribe, or translate into English (default: none given, as transformers)")
    p.add_argument("--timestamps", action="store_true", help="segments with start and end times")
    p.add_argument("--format", choices=("text", "json", "srt"), default="text",
                   help="plain text, JSON (text, language, segments) or SRT subtitles (implies --timestamps)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per 30-s window at most (default: the decoder's context)")
    p.add_argument("--num-beams", type=int, default=1, help="beam search at temperature 0 (default: greedy)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam score = sum log p / length ** this")
    p.add_argument("--temperature", default="0",
                   help="temperatures tried in turn, comma-separated (0 = greedy / beams), e.g. "
                        "0,0.2,0.4,0.6,0.8,1")
    p.add_argument("--compression-ratio-threshold", type=float, default=None,
                   help="fall back to the next temperature above this zlib ratio of a window's tokens "
                        "(e.g. 2.4)")
    p.add_argument("--logprob-threshold", type=float, default=None,
                   help="fall back below this average token log-probability (e.g. -1.0)")
    p.add_argument("--no-speech-threshold", type=float, default=None,
                   help="a window is silence (no text) above this <|nocaptions|> probability when also "
                        "below --logprob-threshold (e.g. 0.6)")
    p.add_argument("--seed", type=int, default=None, help="the seed of the fallback's sampling")
    p.add_argument("--device", default="auto")


def cmd_transcribe(a: argparse.Namespace) -> int:
    from qkv.transcribe import DecodeSettings, parse_temperatures, transcribe

    settings = DecodeSettings(parse_temperatures(a.temperature), a.num_beams, a.length_penalty,
                              a.compression_ratio_threshold, a.logprob_threshold, a.no_speech_threshold,
                              a.seed)
    print(transcribe(a.model, a.audio, language=a.language, task=a.task, timestamps=a.timestamps,
                     fmt=a.format, max_new_tokens=a.max_new_tokens, device=a.device, settings=settings))
    return 0


def _add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a run folder (from qkv train), a checkpoint folder inside one, a qkv "
                                  "model folder or a Hugging Face folder")
    p.add_argument("out", help="the new Hugging Face folder to write (it must not exist, or be empty)")
    p.add_argument("--model-type", default=None,
                   help="the Hugging Face model_type to write (default: from the model's family and config: "
                        "gpt2, llama, qwen2, qwen3, mistral, mixtral, qwen2_moe, qwen3_moe, deepseek_v3, "
                        "bert, roberta, xlm-roberta, distilbert, deberta-v2, vit, resnet, swin; a Hugging "
                        "Face folder keeps its own)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the weights' type in OUT (default: the model's own)")
    p.add_argument("--force", action="store_true", help="replace OUT when it exists and is not empty")


def cmd_export(a: argparse.Namespace) -> int:
    from qkv.export import export_model

    done = export_model(a.source, a.out, model_type=a.model_type, dtype=a.dtype, force=a.force)
    tokenizer = {"copied": "the source's tokenizer files", None: "no tokenizer"}.get(
        done.tokenizer, f"its {done.tokenizer} tokenizer as tokenizer.json")
    print(f"wrote a Hugging Face {done.model_type} folder ({done.dtype}, {tokenizer}): {done.out}")
    print(f"files: {', '.join(done.files)}")
    return 0


def _add_speedrun(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="profile settings as section.key=value (e.g. "
                                                "pretrain.train.max_steps=200)")
    p.add_argument("--profile", default=None,
                   help="quick (minutes: what the tests run), cpu (the default: about an hour on 2 "
                        "cores), gpu, or a profile YAML of your own (copy one from qkv/configs/speedrun/)")
    p.add_argument("--out", default="runs/speedrun",
                   help="the run folder (default runs/speedrun); rerunning continues it")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def cmd_speedrun(a: argparse.Namespace) -> int:
    from qkv.speedrun import speedrun

    done = speedrun(a.out, a.profile, a.overrides, quiet=a.no_progress)
    print(f"report card: {done['report']}")
    print(f"chat model: {done['out'] / 'chat'}; try: qkv chat {done['out'] / 'chat'}")
    return 0


SUBCOMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "train": ("train a model on a task", _add_train, cmd_train),
    "eval": ("evaluate a trained run on its held-out split", _add_eval, cmd_eval),
    "generate": ("generate text from a trained model", add_generate, cmd_generate),
    "info": ("parameters, KV-cache bytes per token and (--train) training memory of a model", add_info,
             cmd_info),
    "presets": ("list the named model presets", _add_presets, cmd_presets),
    "demo": ("the main job: train two small models and show them working", _add_demo, cmd_demo),
    "ablate": ("run an ablation suite and write its table and plots", _add_ablate, cmd_ablate),
    "attention": ("attention maps (every layer x head) for an input", _add_attention, cmd_attention),
    "explore": ("a web page that shows what attention does (or --export one HTML file)", _add_explore,
                cmd_explore),
    "predict": ("top classes of image files, a DETR's boxes (CLIP: --labels; masked LM: --text)",
                _add_predict, cmd_predict),
    "finetune": ("fine-tune a pretrained model folder on your data", add_finetune, cmd_finetune),
    "serve": ("an OpenAI-compatible HTTP server for a language model", _add_serve, cmd_serve),
    "chat": ("chat with a model folder (its chat template), interactively or --message", add_chat, cmd_chat),
    "embed": ("embeddings of texts (CLIP: images too), or the rows nearest to --query", _add_embed,
              cmd_embed),
    "transcribe": ("speech to text (or SRT subtitles) with a Whisper folder", _add_transcribe,
                   cmd_transcribe),
    "export": ("write a run or model folder as a Hugging Face folder (transformers loads it)", _add_export,
               cmd_export),
    "speedrun": ("a chat model from nothing: tokenizer, pretrain, SFT, eval, report card", _add_speedrun,
                 cmd_speedrun),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given `argv`, only the subcommand it names gets its flags (finetune's come from
    its recipes, which import torch: `qkv --help` needs none of them and answers at once)."""
    parser = argparse.ArgumentParser(prog="qkv", description="A Transformer you can read, train, take apart "
                                                             "and scale.",
                                     epilog=TRAIN_EPILOG)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = None if argv is None else next((x for x in argv if x in SUBCOMMANDS), "")
    for name, (help_text, setup, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           epilog=SERVE_EPILOG if name == "serve"
                           else TRAIN_EPILOG if name in TRAINING else EPILOG)
        if chosen is None or name == chosen:
            setup(p)
        p.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    # before torch is imported (it reads this once): idle OpenMP threads sleep rather than spin between
    # ops, which otherwise keeps every core busy while a chat waits for input or a server for requests; the
    # user's setting wins
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser(sys.argv[1:] if argv is None else argv)
    a, extra = parser.parse_known_args(argv)
    # dotted key=value overrides may come after options (`qkv train cfg.yaml --out x train.lr=1e-3`)
    if extra and hasattr(a, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        a.overrides = list(a.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(a, "func", None):
        parser.print_help()
        return 0
    import warnings

    with warnings.catch_warnings():  # the process's own warning display comes back when the command returns
        # a warning is said as the CLI says things: one line on stderr (not Python's two, with a source line)
        warnings.showwarning = lambda message, *_, **__: print(f"qkv: warning: {message}", file=sys.stderr)
        return _run_command(a)


def _run_command(a: argparse.Namespace) -> int:
    """The chosen command, its errors said in one line (--debug: with the traceback)."""
    try:
        return a.func(a)
    except KeyboardInterrupt as e:
        if a.debug:
            raise
        from qkv.train import TrainingInterrupted

        if isinstance(e, TrainingInterrupted):
            hint = f"; continue with --resume --out {e.checkpoint.parent.parent}" if e.checkpoint else ""
            print(f"qkv: {e}{hint}", file=sys.stderr)
            return 128 + e.signum
        print("qkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of stdout went away (qkv presets | head -3): stop quietly, as a Unix tool; stdout goes to
        # devnull so that the interpreter's own flush at exit does not raise again
        if a.debug:
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except Exception as e:  # one clear line for user errors; --debug for the traceback
        from qkv.checkpoint import CheckpointError
        from qkv.train import NonFiniteError

        if a.debug:
            raise
        if isinstance(e, NonFiniteError):  # the full report was logged above (and to train.log)
            where = f"; report in {e.batch_path.parent / 'train.log'}" if e.batch_path else ""
            first = str(e).splitlines()[0]
            print(f"qkv: error: training stopped by the NaN guard: {first}{where}", file=sys.stderr)
            return EXIT_NAN_GUARD
        # bugs keep their traceback
        user_errors = (ConfigError, CheckpointError, FileNotFoundError, ValueError)
        if not isinstance(e, user_errors):
            raise
        print(f"qkv: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
