"""Optional dependencies: what each extra of `pip install qkv[...]` brings, and one clear error when a
feature needs a package that is not installed.

    core      torch, numpy, safetensors, tokenizers, pyyaml, tqdm, matplotlib: every command, the text
              tasks, the demo, curves.png, attention maps and ablation plots
    vision    scikit-learn: its bundled digits images (vit_digits, swin_digits, clip_captions)
    audio     scipy + soundfile: resampling espeak-ng speech (whisper_speech; the DTMF task needs nothing),
              reading and resampling audio files (qkv transcribe)
    text      sacrebleu + rouge-score: BLEU of the translation tasks (numbers_zh, tsv), ROUGE of seq2seq
    seq2seq   sentencepiece + sacrebleu: Marian / T5 folders without tokenizer.json,
              qkv finetune --task seq2seq
    detection scipy + pycocotools: DETR's Hungarian matching, the detection task's COCO mAP
    lab       all of them: every shipped config and ablation suite
"""

from __future__ import annotations

import importlib
from types import ModuleType

from qkv.config import ConfigError

# import name -> (pip name, extra)
PACKAGES = {"sklearn": ("scikit-learn", "vision"), "scipy": ("scipy", "audio"),
            "soundfile": ("soundfile", "audio"), "rouge_score": ("rouge-score", "text"),
            "sacrebleu": ("sacrebleu", "text"), "sentencepiece": ("sentencepiece", "seq2seq"),
            "pycocotools": ("pycocotools", "detection")}


def require(module: str, what: str) -> ModuleType:
    """Import `module` (e.g. "sklearn.datasets"), or raise a ConfigError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".", 1)[0]
        pip_name, extra = PACKAGES.get(top, (top, "lab"))
        raise ConfigError(f"{what} needs {pip_name}, which is not installed: pip install 'qkv[{extra}]' "
                          f"(or 'qkv[lab]' for every task)") from None
