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
from dataclasses import dataclass, fields
from pathlib import Path

from qkv.cli.args import (
    TRAIN_SHORTCUTS,
    AblateArgs,
    AttentionArgs,
    DemoArgs,
    EmbedArgs,
    EvalArgs,
    ExploreArgs,
    ExportArgs,
    InfoArgs,
    PredictArgs,
    PresetsArgs,
    ServeArgs,
    SpeedrunArgs,
    TrainArgs,
    TranscribeArgs,
)
from qkv.cli.finetune import add_finetune, cmd_finetune
from qkv.cli.flags import (
    QUANTIZE,
    FlagSet,
    flag_of,
    read_flags,
    read_settings,
)
from qkv.cli.generate import CHAT, GENERATE, cmd_chat, cmd_generate
from qkv.cli.info import cmd_info
from qkv.config import ConfigError, check_flag_keys
from qkv.generate.engine_config import EngineConfig
from qkv.serve.config import ServeConfig

FIELDS = {f.name: f for f in fields(TrainArgs)}
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


def cmd_train(a: argparse.Namespace) -> int:
    from qkv.run import command_line_config, train_run

    given = read_flags(a, TrainArgs)  # the flags given: the shortcuts below name only these
    s = TrainArgs(**given)
    over, config = list(s.overrides), s.config
    if config and "=" in config:  # `qkv train key=value ...` without a YAML file
        over.insert(0, config)
        config = None
    pairs = [(flag_of(FIELDS[name]) if given.get(name) is not False else f"--no-{name}", given.get(name), key)
             for name, key in TRAIN_SHORTCUTS]
    check_flag_keys(pairs, over)  # over the YAML the command line wins, either form
    for name, key in TRAIN_SHORTCUTS:
        if name not in ("out", "resume") and given.get(name) is not None:
            value = given[name]
            over.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    cfg, out, resume = command_line_config(config, over, s.out, s.resume)  # resume: or train.resume: true
    summary = train_run(cfg, out=out, resume=resume)
    if summary["report"]:  # empty on ranks other than 0 under torchrun
        print(summary["report"])
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from qkv.run import evaluate_run

    s = read_settings(a, EvalArgs)
    metrics = evaluate_run(s.checkpoint, n=s.n)
    for k, v in metrics.items():
        count = k == "n" or k.startswith("n_")  # examples and tokens: "n: 10", not "n: 10.0000"
        print(f"{k}: {int(v)}" if count and float(v).is_integer() else f"{k}: {v:.4f}" if isinstance(v, float)
              else f"{k}: {v}")
    return 0


def cmd_presets(a: argparse.Namespace) -> int:
    from qkv.models.registry import build, preset, presets

    count = read_settings(a, PresetsArgs).count
    for name in presets():
        fam, cfg, desc = preset(name)
        params = f"{build(name).num_parameters():>14,}  " if count else ""
        print(f"{name:<20} {fam.name:<8} {params}{desc}")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from qkv.demo import run_demo

    s = read_settings(a, DemoArgs)
    run_demo(Path(s.out), quick=s.quick)
    return 0


def cmd_ablate(a: argparse.Namespace) -> int:
    from qkv.experiments import run_suite

    s = read_settings(a, AblateArgs)
    report = run_suite(s.suite, out_dir=s.out, quick=s.quick, scale=s.scale, only=s.only, force=s.force,
                       threads=s.threads, jobs=s.jobs)
    print(f"report: {report}")
    return 0


def cmd_attention(a: argparse.Namespace) -> int:
    from qkv.experiments.attention import image_path
    from qkv.experiments.attention_report import attention_report

    s = read_settings(a, AttentionArgs)
    for line in attention_report(s.checkpoint, s.input, image_path(s.out), target=s.target, image=s.image,
                                 layer=s.layer, token=s.token):
        print(line)
    return 0


def cmd_explore(a: argparse.Namespace) -> int:
    from qkv.explore.cli import explore

    s = read_settings(a, ExploreArgs)
    return explore(s.model, host=s.host, port=s.port, text=s.input, target=s.target, export=s.export,
                   wav=s.wav, quantize=QUANTIZE.read(a).get("quantize"))


def cmd_predict(a: argparse.Namespace) -> int:
    from qkv.detect import is_detector
    from qkv.image_text import is_clip_folder, zero_shot
    from qkv.predict import fill_mask, format_fills, format_predictions, predict_images

    s = read_settings(a, PredictArgs)
    images = s.images + s.image
    if s.text is not None:
        if images or s.labels is not None:
            raise ConfigError("--text fills masks in texts; give it without images or --labels")
        for line in format_fills(fill_mask(s.model, s.text, s.top_k)):
            print(line)
        return 0
    if not images:
        raise ConfigError("give the image files to classify (IMAGE... or --image IMAGE...)")
    if is_detector(s.model):
        return predict_boxes(s.model, images, s.out, s.threshold)
    if s.out is not None:
        raise ConfigError(f"--out draws a detector's boxes; {s.model} is not a detector (a DETR)")
    if is_clip_folder(s.model):
        rows = zero_shot(s.model, images, s.labels, template=s.template, top_k=s.top_k)
    elif s.labels is not None:
        raise ConfigError(f"--labels needs a CLIP folder (zero-shot); {s.model} is an image classifier with "
                          "its own classes")
    else:
        rows = predict_images(s.model, images, s.top_k)
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


def cmd_serve(a: argparse.Namespace) -> int:
    from qkv.serve import serve

    given = {**read_flags(a, ServeConfig), **read_flags(a, EngineConfig)}
    return serve(read_settings(a, ServeArgs).model, **given)


def cmd_embed(a: argparse.Namespace) -> int:
    from qkv.embed import run

    s = read_settings(a, EmbedArgs)
    for line in run(s.model, s.input, texts=s.text, images=s.image, out=s.out, query=s.query, top_k=s.top_k,
                    pooling=s.pooling, normalize=s.normalize, batch_size=s.batch_size, device=s.device,
                    progress=s.progress):
        print(line)
    return 0


def cmd_transcribe(a: argparse.Namespace) -> int:
    # the decoding settings' module imports torch: read here, so that `qkv --help` stays light
    from qkv.transcribe import transcribe
    from qkv.whisper_decode import DecodeSettings, parse_temperatures

    s = read_settings(a, TranscribeArgs)
    settings = DecodeSettings(**read_flags(a, DecodeSettings), temperatures=parse_temperatures(s.temperature))
    print(transcribe(s.model, s.audio, language=s.language, task=s.task, timestamps=s.timestamps,
                     fmt=s.format, max_new_tokens=s.max_new_tokens, device=s.device, settings=settings))
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from qkv.export import export_model

    s = read_settings(a, ExportArgs)
    done = export_model(s.source, s.out, model_type=s.model_type, dtype=s.dtype, force=s.force)
    tokenizer = {"copied": "the source's tokenizer files", None: "no tokenizer"}.get(
        done.tokenizer, f"its {done.tokenizer} tokenizer as tokenizer.json")
    print(f"wrote a Hugging Face {done.model_type} folder ({done.dtype}, {tokenizer}): {done.out}")
    print(f"files: {', '.join(done.files)}")
    return 0


def cmd_speedrun(a: argparse.Namespace) -> int:
    from qkv.speedrun import speedrun

    s = read_settings(a, SpeedrunArgs)
    done = speedrun(s.out, s.profile, s.overrides, quiet=not s.progress)
    print(f"report card: {done['report']}")
    print(f"chat model: {done['out'] / 'chat'}; try: qkv chat {done['out'] / 'chat'}")
    return 0


def transcribe_flags() -> FlagSet:
    """Whisper's decoding flags (the settings' module imports torch: only `qkv transcribe` reads it)."""
    from qkv.whisper_decode import DecodeSettings

    return FlagSet(DecodeSettings)


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, what it runs, and the settings its flags come from (flag sets, or
    a function of the flag sets where building them imports the library)."""

    help: str
    run: Callable[[argparse.Namespace], int]
    flags: tuple[FlagSet, ...] | Callable[[], tuple[FlagSet, ...]] = ()
    setup: Callable[[argparse.ArgumentParser], None] | None = None  # flags that are not flag sets

    def flag_sets(self) -> tuple[FlagSet, ...]:
        return self.flags() if callable(self.flags) else self.flags


SUBCOMMANDS: dict[str, Command] = {
    "train": Command("train a model on a task", cmd_train, (FlagSet(TrainArgs),)),
    "eval": Command("evaluate a trained run on its held-out split", cmd_eval, (FlagSet(EvalArgs),)),
    "generate": Command("generate text from a trained model", cmd_generate, GENERATE),
    "info": Command("parameters, KV-cache bytes per token and (--train) training memory of a model", cmd_info,
                    (FlagSet(InfoArgs),)),
    "presets": Command("list the named model presets", cmd_presets, (FlagSet(PresetsArgs),)),
    "demo": Command("the main job: train two small models and show them working", cmd_demo,
                    (FlagSet(DemoArgs),)),
    "ablate": Command("run an ablation suite and write its table and plots", cmd_ablate,
                      (FlagSet(AblateArgs),)),
    "attention": Command("attention maps (every layer x head) for an input", cmd_attention,
                         (FlagSet(AttentionArgs),)),
    "explore": Command("a web page that shows what attention does (or --export one HTML file)", cmd_explore,
                       (FlagSet(ExploreArgs), QUANTIZE)),
    "predict": Command("top classes of image files, a DETR's boxes (CLIP: --labels; masked LM: --text)",
                       cmd_predict, (FlagSet(PredictArgs),)),
    "finetune": Command("fine-tune a pretrained model folder on your data", cmd_finetune, setup=add_finetune),
    "serve": Command("an OpenAI-compatible HTTP server for a language model", cmd_serve,
                     (FlagSet(ServeArgs), FlagSet(ServeConfig), FlagSet(EngineConfig))),
    "chat": Command("chat with a model folder (its chat template), interactively or --message", cmd_chat,
                    CHAT),
    "embed": Command("embeddings of texts (CLIP: images too), or the rows nearest to --query", cmd_embed,
                     (FlagSet(EmbedArgs),)),
    "transcribe": Command("speech to text (or SRT subtitles) with a Whisper folder", cmd_transcribe,
                          lambda: (FlagSet(TranscribeArgs), transcribe_flags())),
    "export": Command("write a run or model folder as a Hugging Face folder (transformers loads it)",
                      cmd_export, (FlagSet(ExportArgs),)),
    "speedrun": Command("a chat model from nothing: tokenizer, pretrain, SFT, eval, report card",
                        cmd_speedrun, (FlagSet(SpeedrunArgs),)),
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
    for name, command in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help,
                           epilog=SERVE_EPILOG if name == "serve"
                           else TRAIN_EPILOG if name in TRAINING else EPILOG)
        if chosen is None or name == chosen:
            for flag_set in command.flag_sets():
                flag_set.add(p)
            if command.setup is not None:
                command.setup(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
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
