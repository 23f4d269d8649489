"""Model families: one file each (config dataclass + presets + model). Importing registers them: the named
ones below, and any other module in this folder (a new family is its file alone)."""

import importlib
import pkgutil

from qkv.models.base import ModelOutput, QKVModel
from qkv.models.bert import BERT, BERTConfig
from qkv.models.clip import CLIP, CLIPConfig
from qkv.models.encdec import EncoderDecoder, EncoderDecoderConfig
from qkv.models.gpt import GPT, GPTConfig
from qkv.models.lstm import LSTM, LSTMConfig
from qkv.models.registry import build, families, family, preset, presets
from qkv.models.swin import Swin, SwinConfig
from qkv.models.vit import ViT, ViTConfig
from qkv.models.whisper import Whisper, WhisperConfig

__all__ = [
    "BERT", "BERTConfig", "CLIP", "CLIPConfig", "EncoderDecoder", "EncoderDecoderConfig", "GPT", "GPTConfig",
    "LSTM", "LSTMConfig",
    "ModelOutput", "QKVModel", "Swin", "SwinConfig", "ViT", "ViTConfig", "Whisper", "WhisperConfig",
    "build", "families", "family", "preset", "presets",
]

for _module in pkgutil.iter_modules(__path__):  # a family file added to this folder registers itself
    importlib.import_module(f"{__name__}.{_module.name}")
