"""The command line of each `qkv` command that takes its settings as plain arguments (files, folders,
switches), declared once as a dataclass: qkv.cli.flags makes the positional arguments and flags of it, reads
them back as an instance, and writes the command's table in docs/cli.md (a test compares). The commands
whose settings are a library's (GenerationConfig, ServeConfig, EngineConfig, the fine-tuning recipes, the
Whisper decoding) take those classes' flags beside these. Only the standard library and qkv.config are
imported, so that a command's --help answers at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qkv.config import setting

OVERRIDES = "dotted key=value overrides, e.g. train.lr=1e-3 model.n_heads=8"
SPECULATIVE = ("speculative decoding (one sequence): 'prompt-lookup' drafts the tokens that followed the "
               "words where they occur earlier in the text (fast when the answer copies the prompt: "
               "editing), or a small model folder of the same tokenizer drafts; the model checks the drafts "
               "in one forward. The same tokens as without it (greedy), the same distribution (sampling)")


@dataclass
class TrainArgs:
    """`qkv train`: a run YAML, its overrides, and flags that are shortcuts for keys (TRAIN_SHORTCUTS)."""

    config: str | None = setting(None, "run YAML (see configs/); optional", positional=True)
    overrides: list[str] = setting([], OVERRIDES, positional=True)
    task: str | None = setting(None, "task name (shortcut for task.name=...)")
    model: str | None = setting(None, "model preset (shortcut for model.preset=...)")
    out: str | None = setting(None, "output folder", none="runs/<task>-<preset>")
    max_steps: int | None = setting(None, "training steps (train.max_steps)", ge=1)
    seed: int | None = setting(None, "random seed (train.seed and task.seed)")
    resume: bool = setting(False, "continue from OUT's last checkpoint (train.resume)")
    progress: bool = setting(True, "a progress bar (train.progress)")


# the flags of `qkv train` that stand for keys: (field, key); a value given both ways must agree
TRAIN_SHORTCUTS = (("task", "task.name"), ("model", "model.preset"), ("max_steps", "train.max_steps"),
                   ("seed", "train.seed"), ("seed", "task.seed"), ("out", "train.out_dir"),
                   ("resume", "train.resume"), ("progress", "train.progress"))


@dataclass
class FinetuneArgs:
    """`qkv finetune`'s arguments beside the recipes' settings (qkv.finetune.settings)."""

    overrides: list[str] = setting([], "Trainer settings as train.key=value (e.g. train.lr=2e-5)",
                                   positional=True)
    task: str | None = setting(None, "the recipe; the flags of another recipe's group below are refused",
                               none="from the model's kind")


@dataclass
class EvalArgs:
    checkpoint: str = setting(help="a run folder (from qkv train) or a checkpoint folder inside it",
                              positional=True)
    n: int = setting(500, "held-out examples to evaluate", ge=1, flag="-n")


@dataclass
class PresetsArgs:
    count: bool = setting(False, "also build each preset and count its parameters")


@dataclass
class DemoArgs:
    out: str = setting("runs/demo", "where checkpoints, metrics and plots go")
    quick: bool = setting(False, "a much shorter run (for tests)")


@dataclass
class AblateArgs:
    suite: str = setting(help="a suite YAML (configs/ablations/*.yaml) or its name", positional=True)
    out: str | None = setting(None, "output folder", none="runs/ablations/<suite>")
    quick: bool = setting(False, "the suite's quick size (under a minute)")
    scale: Literal["cpu", "gpu"] = setting("cpu", "size profile: cpu (the file as written) or gpu (its "
                                                  "`scales: gpu` section)")
    only: str | None = setting(None, "run only the variants with every comma-separated item of FILTER: whole "
                                     "key=value items of their names (n_heads=1 is not n_heads=16) or "
                                     "names, e.g. 'name=reverse,position=rope'; the report still covers "
                                     "every finished run in --out", metavar="FILTER")
    force: bool = setting(False, "redo runs that already finished (those --only selects)")
    threads: int | None = setting(None, "torch threads per run (1 is best on a busy CPU)", ge=1)
    jobs: int | None = setting(None, "runs trained at once, each in its own process on the same device; "
                                     "each gets --threads threads or its share of the cores", ge=1,
                               none="the suite's `jobs`, 1")


@dataclass
class AttentionArgs:
    checkpoint: str = setting(help="a run folder, checkpoint folder or Hugging Face folder", positional=True)
    input: str = setting(help="text to run through the model (a ViT: N, the first N held-out images in "
                              "order, 1..32)")
    target: str | None = setting(None, "encoder-decoders: the target sentence; the decoder reads [decoder "
                                       "start] + its tokens less the final eos, as teacher forcing",
                                 none="[decoder start] + the greedy output, as qkv generate --greedy")
    out: str = setting("attention.png", "PNG to write (one per attention kind; .png is added to a name "
                                        "without an extension); the per-head statistics go to "
                                        "<name>_entropy.json beside it")
    image: str | None = setting(None, "a llava folder: the image the question (--input) is about; draws "
                                      "where the answer's tokens look on it")
    layer: int | None = setting(None, "with --image: one layer of the language model (negative from the end)",
                                none="the mean over all")
    token: int | None = setting(None, "with --image: one answer token, 0-based", ge=0,
                                none="the mean over the answer")


@dataclass
class ExploreArgs:
    model: str = setting(help="a run folder, checkpoint folder, Hugging Face folder (gpt2, bert, vit, "
                              "whisper) or GGUF file", positional=True)
    host: str = setting("127.0.0.1", "address to listen on (default: loopback only)")
    port: int = setting(8000, "port to listen on (it must be free)", ge=1, le=65535)
    input: str | None = setting(None, "with --export: the input to show (text; image index for a ViT)")
    target: str | None = setting(None, "with --export: decoder input of an encoder-decoder")
    wav: str | None = setting(None, "with --export: a WAV file for an audio model")
    export: str | None = setting(None, "write one self-contained page and exit", metavar="PAGE.html")


@dataclass
class PredictArgs:
    model: str = setting(help="an image classifier: a Hugging Face folder (vit, resnet) or a qkv image run; "
                              "or a CLIP folder with --labels (zero-shot)", positional=True)
    images: list[str] = setting([], "image files (PNG, JPEG, ...)", positional=True, metavar="IMAGE")
    image: list[str] = setting([], "image files (as IMAGE...)", metavar="IMAGE")
    top_k: int = setting(5, "classes shown per image", ge=1)
    labels: str | None = setting(None, 'a CLIP folder\'s classes, comma-separated: "a cat,a dog" (zero-shot)')
    template: str = setting("{}", 'the text each label is put in, e.g. "a photo of {}"')
    text: list[str] | None = setting(None, "a masked-LM folder: texts whose [MASK] tokens to fill, e.g. "
                                           "'Paris is the [MASK] of France'", metavar="TEXT")
    out: str | None = setting(None, "a detector (DETR): draw the boxes found on the image into this file",
                              metavar="FILE.png")
    threshold: float = setting(0.5, "a detector: the least class probability a box is shown with", ge=0, le=1)


@dataclass
class ServeArgs:
    """`qkv serve`'s model; every other flag is a field of ServeConfig or EngineConfig."""

    model: str = setting(help="a qkv run folder, a qkv checkpoint folder, a Hugging Face folder or a GGUF "
                              "file", positional=True)


@dataclass
class EmbedArgs:
    model: str = setting(help="a BERT / RoBERTa / XLM-R / DistilBERT / DeBERTa folder (Hugging Face format), "
                              "or a CLIP folder", positional=True)
    input: str | None = setting(None, "text file, one text per line")
    text: list[str] | None = setting(None, "texts to embed (instead of --input)", metavar="TEXT")
    image: list[str] | None = setting(None, "image files to embed (a CLIP folder)", metavar="IMAGE")
    out: str | None = setting(None, "write the embeddings here (.npy, one row per line)")
    query: str | None = setting(None, "print the input lines nearest to this text")
    top_k: int = setting(5, "rows shown for --query", ge=1)
    pooling: Literal["mean", "cls"] | None = setting(None, "mean over tokens or the first token",
                                                     none="the folder's 1_Pooling, else mean")
    normalize: bool = setting(True, "unit-length vectors (--no-normalize: the raw pooled vectors)")
    batch_size: int = setting(32, "texts or images per forward", ge=1)
    device: str = setting("auto", "cpu, cuda, ... (auto: a GPU where there is one)")
    progress: bool = setting(True, "a progress bar")


@dataclass
class TranscribeArgs:
    """`qkv transcribe`'s files and output; the decoding flags are qkv.whisper_decode.DecodeSettings'."""

    model: str = setting(help="a Whisper folder (Hugging Face format)", positional=True)
    audio: list[str] = setting(help="audio files (WAV, FLAC, OGG: what soundfile reads)", positional=True,
                               metavar="AUDIO")
    language: str | None = setting(None, "the spoken language (en, de, ...)", none="detected")
    task: Literal["transcribe", "translate"] | None = setting(
        None, "transcribe, or translate into English", none="none given, as transformers")
    timestamps: bool = setting(False, "segments with start and end times")
    format: Literal["text", "json", "srt"] = setting(
        "text", "plain text, JSON (text, language, segments) or SRT subtitles (implies --timestamps)")
    max_new_tokens: int | None = setting(None, "tokens per 30-s window at most", ge=1, none="the decoder's "
                                                                                           "context")
    temperature: str = setting("0", "temperatures tried in turn, comma-separated (0 = greedy / beams), e.g. "
                                    "0,0.2,0.4,0.6,0.8,1")
    device: str = setting("auto", "cpu, cuda, ... (auto: a GPU where there is one)")


@dataclass
class ExportArgs:
    source: str = setting(help="a run folder (from qkv train), a checkpoint folder inside one, a qkv model "
                               "folder or a Hugging Face folder", positional=True)
    out: str = setting(help="the new Hugging Face folder to write (it must not exist, or be empty)",
                       positional=True)
    model_type: str | None = setting(None, "the Hugging Face model_type to write (gpt2, llama, qwen2, qwen3, "
                                           "mistral, mixtral, qwen2_moe, qwen3_moe, deepseek_v3, bert, "
                                           "xlm-roberta, distilbert, deberta-v2, vit, resnet, swin; a "
                                           "Hugging Face folder keeps its own)",
                                     none="from the model's family and config")
    dtype: Literal["float32", "bfloat16", "float16"] | None = setting(None, "the weights' type in OUT",
                                                                      none="the model's own")
    force: bool = setting(False, "replace OUT when it exists and is not empty")


@dataclass
class SpeedrunArgs:
    overrides: list[str] = setting([], "profile settings as section.key=value (e.g. "
                                       "pretrain.train.max_steps=200)", positional=True)
    profile: str | None = setting(None, "quick (minutes: what the tests run), cpu (about half an hour on 2 "
                                        "cores), gpu, or a profile YAML of your own (copy one from "
                                        "qkv/configs/speedrun/)", none="cpu")
    out: str = setting("runs/speedrun", "the run folder; rerunning continues it")
    progress: bool = setting(True, "progress bars")


@dataclass
class InfoArgs:
    target: str = setting(help="a preset name, a run or checkpoint folder, a Hugging Face folder or a GGUF "
                               "file", positional=True)
    depth: int = setting(3, "module path depth of the table (parts per row)", ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] | None = setting(
        None, "the KV cache's dtype", none="the model's, as decoding allocates it")
    train: bool = setting(False, "also estimate a training step's memory (fp32, AdamW; GPT-family models)")
    batch: int = setting(1, "sequences per batch (the KV cache and --train)", ge=1)
    seq: int | None = setting(None, "--train: tokens per sequence", ge=1, none="the context")


@dataclass
class GenerateArgs:
    """`qkv generate`'s own flags; its sampling flags are GenerationConfig's."""

    checkpoint: str = setting(help="a run folder, a checkpoint folder, a Hugging Face folder or a GGUF file",
                              positional=True)
    prompt: str = setting("", "text prompt (source sentence for seq2seq models)",
                          flag=("--prompt", "--input"))
    early_stopping: Literal["true", "false", "never"] | None = setting(
        None, "beam search: stop at num_beams finished (true), HF's heuristic (false), exact (never)")
    greedy: bool = setting(False, "greedy decoding: the argmax each step, one beam (default: sample for LMs; "
                                  "a model folder's generation_config.json decides for itself)")
    sample: bool = setting(False, "sample (with --temperature / --top-k / --top-p), also where a model "
                                  "folder's generation_config.json decodes greedily or with beams")
    seed: int | None = setting(None, "seed of the sampling", none="a new one each run, printed on stderr to "
                                                                  "repeat it")
    logit_bias: list[str] | None = setting(None, "add BIAS (in [-100, 100]) to token ID's logit, for each "
                                                 "ID=BIAS", metavar="ID=BIAS")
    stream: bool = setting(False, "print tokens as they are produced")
    generation_config: str | None = setting(
        None, "a JSON or YAML file of generation settings (qkv.generate.GenerationConfig fields, Hugging "
              "Face names, e.g. a model's generation_config.json); the flags override it", metavar="FILE")
    json_schema: str | None = setting(
        None, "structured output: only JSON valid against this JSON schema file (a Hugging Face folder's "
              "tokenizer; ends at the model's eos; qkv.generate.grammar)", metavar="FILE")
    strict: bool = setting(False, "refuse a prompt with characters outside the model's vocabulary (default: "
                                  "warn, read them as <unk>)")
    compile: bool = setting(False, "compile the decoding step with torch.compile (the first run compiles for "
                                   "a minute or more, later runs reuse ~/.cache/qkv/inductor; one sequence, "
                                   "no beams)")
    speculative: str | None = setting(None, SPECULATIVE, metavar="prompt-lookup|MODEL")


@dataclass
class ChatArgs:
    """`qkv chat`'s own flags; its sampling flags are GenerationConfig's."""

    model: str = setting(help="a Hugging Face model folder with tokenizer.json (and a chat template), or a "
                              "GGUF file", positional=True)
    message: list[str] | None = setting(None, "answer these messages in turn and exit (one per --message); "
                                              "without it: interactive")
    system: str | None = setting(None, "system prompt")
    image: str | None = setting(None, "an image file for the first message (a vision-language folder: "
                                      "llava); in the interactive chat, /image PATH sets another")
    greedy: bool = setting(False, "greedy decoding. Default: what the folder's generation_config.json says "
                                  "(do_sample); greedy when it says nothing; --temperature / --top-k / "
                                  "--top-p sample")
    seed: int | None = setting(None, "seed of the sampling", none="a new one each run, printed on stderr to "
                                                                  "repeat it")
    compile: bool = setting(False, "compile the decoding step with torch.compile (the first answer waits for "
                                   "the compile; later runs reuse ~/.cache/qkv/inductor)")
    speculative: str | None = setting(None, SPECULATIVE, metavar="prompt-lookup|MODEL")
