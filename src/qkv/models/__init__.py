"""Model families: one file each (config dataclass + presets + model). Importing registers them."""

from qkv.models.base import ModelOutput, QKVModel
from qkv.models.bert import BERT, BERTConfig
from qkv.models.encdec import EncoderDecoder, EncoderDecoderConfig
from qkv.models.gpt import GPT, GPTConfig
from qkv.models.registry import build, families, family, preset, presets

__all__ = [
    "BERT", "BERTConfig", "EncoderDecoder", "EncoderDecoderConfig", "GPT", "GPTConfig", "ModelOutput",
    "QKVModel", "build", "families", "family", "preset", "presets",
]
