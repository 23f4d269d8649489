"""A tiny random-weight Hugging Face llava folder (transformers' LlavaForConditionalGeneration: CLIP vision 2
layers, 32 px images of 8 px patches, Llama text 2 layers 64 wide), with a word-level tokenizer holding the
<image> token, LLaVA 1.5's chat template and a CLIPImageProcessor config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

IMAGE_TOKEN_ID = 99
VOCAB = 100
WORDS = ["<unk>", "<s>", "</s>", "USER:", "ASSISTANT:", "what", "is", "in", "the", "picture?", "describe",
         "it", "a", "cat"]
# LLaVA 1.5's template (llava-hf/llava-1.5-7b-hf, chat_template.json)
TEMPLATE = ("{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + "
            "': '}}{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') "
            "%}{{ '<image>\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
            "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
            "{{ content['text'] + ' '}}{% endfor %}{% else %}"
            "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
            "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def hf_llava(select: str = "default", feature_layer: int = -2, seed: int = 0):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                         vision_feature_layer=feature_layer, vision_feature_select_strategy=select,
                         projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF's init leaves some weights at 0/1 (norms, biases): make every one matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "embedding" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), IMAGE_TOKEN_ID)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_tokens(["<image>"], special_tokens=True)
    assert fast.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)


def save_processor(folder: Path) -> None:
    from transformers import CLIPImageProcessor

    CLIPImageProcessor(size={"shortest_edge": 32},
                       crop_size={"height": 32, "width": 32}).save_pretrained(folder)


def llava_folder(folder: Path, **kwargs) -> Path:
    """The folder with weights, tokenizer, chat template and preprocessor config; returns it."""
    model = hf_llava(**kwargs)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    save_processor(folder)
    return folder


def png(path: Path, size: tuple[int, int] = (45, 70), seed: int = 0) -> Path:
    """A random RGB PNG (height, width)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return path


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
