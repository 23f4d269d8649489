"""A Hugging Face folder's tokenizer files, copied as they are beside a model written from it (qkv export,
the fine-tune recipes, the vision-language exporters). A qkv run's own tokenizer is written as Hugging Face
files by qkv.tasks.tokenizer_export.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# the files of a Hugging Face folder that describe its tokenizer (tokenizers' JSON; GPT-2's BPE; BERT's
# WordPiece vocab.txt; SentencePiece models: Llama's, DeBERTa-v3's, XLM-R's, T5's, Marian's source/target) and
# its chat template: copied to OUT unchanged. A file missing from this list is a tokenizer lost on export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spm.model", "sentencepiece.bpe.model", "spiece.model", "source.spm",
                   "target.spm")
GENERATION_FILES = ("generation_config.json",)  # a generative model's decoding defaults


def copy_tokenizer_files(source: Path, out: Path, *, generation: bool = True,
                         also: tuple[str, ...] = ()) -> list[str]:
    """Copy a Hugging Face folder's tokenizer files (its generation files too unless `generation` is False,
    and the names in `also`) into `out`; the names copied."""
    copied = []
    for name in TOKENIZER_FILES + (GENERATION_FILES if generation else ()) + also:
        # never a file onto itself (OUT = the source is refused; this guards any other alias of it)
        if (source / name).is_file() and not ((out / name).exists() and (out / name).samefile(source / name)):
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return copied


__all__ = ["GENERATION_FILES", "TOKENIZER_FILES", "copy_tokenizer_files"]
