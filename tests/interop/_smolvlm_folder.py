"""A tiny random-weight Hugging Face Idefics3 / SmolVLM folder (SigLIP-style vision 2 layers, 32 px tiles
of 8 px patches, pixel shuffle 2 -> 4 image tokens per tile, Llama text 2 layers 64 wide), with a word-level
tokenizer holding Idefics3's special tokens (<fake_token_around_image>, <image>, <global-img>, <row_i_col_j>),
SmolVLM's chat template and an Idefics3ImageProcessor config (images resized to a longest edge of 64, split
into 32 px tiles plus a global image)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 120
IMAGE_TOKEN_ID = 110
WORDS = ["<unk>", "<|im_start|>", "<end_of_utterance>", "User:", "Assistant:", "\n", "what", "is", "in",
         "the", "picture?", "describe", "it", "a", "cat"]
SPECIALS = ["<fake_token_around_image>", "<global-img>",
            *(f"<row_{i}_col_{j}>" for i in (1, 2, 3) for j in (1, 2, 3))]
# transformers' SmolVLMProcessor DEFAULT_CHAT_TEMPLATE
TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
            "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
            "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
            "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
            "{% elif line['type'] == 'image' %}{{ '<image>' }}"
            "{% elif line['type'] == 'video' %}{{ '<video>' }}"
            "{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
            "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def hf_idefics3(kind: str = "idefics3", scale_factor: int = 2, seed: int = 0, tie: bool = False,
                image_size: int = 32, patch_size: int = 8):
    import transformers as tf

    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[kind]
    vision = getattr(tf, f"{prefix}VisionConfig")(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, image_size=image_size,
                                                  patch_size=patch_size)
    text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=tie)
    config = getattr(tf, f"{prefix}Config")(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                            scale_factor=scale_factor, image_token_id=IMAGE_TOKEN_ID,
                                            tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = getattr(tf, f"{prefix}ForConditionalGeneration")(config).eval()
    with torch.no_grad():  # HF's init leaves some weights at 0/1 (norms, biases): make every one matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "embedding" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), IMAGE_TOKEN_ID - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # words split at spaces; a newline is a token of its own (the tile rows of a prompt end with one)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                 pre_tokenizers.Split(Regex("\n"), "isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<end_of_utterance>", unk_token="<unk>")
    fast.add_tokens(SPECIALS, special_tokens=True)
    fast.add_tokens(["<image>"], special_tokens=True)
    assert fast.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID, fast.convert_tokens_to_ids("<image>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)


def image_processor(split: bool = True, longest: int = 64):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(size={"longest_edge": longest}, max_image_size={"longest_edge": 32},
                                     do_image_splitting=split)


def hf_processor(folder: Path, split: bool = True, longest: int = 64):
    from transformers import AutoTokenizer, Idefics3Processor

    return Idefics3Processor(image_processor=image_processor(split, longest),
                             tokenizer=AutoTokenizer.from_pretrained(folder), image_seq_len=4,
                             chat_template=TEMPLATE)


def smolvlm_folder(folder: Path, split: bool = True, longest: int = 64, **kwargs) -> Path:
    """The folder with weights, tokenizer, chat template and the processor's configs; returns it."""
    hf_idefics3(**kwargs).save_pretrained(folder)
    save_tokenizer(folder)
    hf_processor(folder, split, longest).save_pretrained(folder)
    return folder


def save_bpe_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer (SmolVLM's kind) trained on a few lines where "\\n\\n" merges, with the
    special tokens added after training; returns the <image> id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["User: what is in the picture?\n\nAssistant: a cat\n\n", "describe it:\n\n it is a cat\n"] * 50
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_start|>"])
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<end_of_utterance>")
    fast.add_tokens([*SPECIALS, "<image>", "<end_of_utterance>"], special_tokens=True)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return fast.convert_tokens_to_ids("<image>")
