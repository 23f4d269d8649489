"""The chat template a model qkv pretrained itself is fine-tuned with; its tokenizer as Hugging Face files.

A `qkv train` run keeps its tokenizer in qkv's own form beside task.json; the chat recipe, `qkv chat`, `qkv
serve` and transformers read a folder's tokenizer.json + tokenizer_config.json + chat_template.jinja. So
before a chat fine-tune of such a run (`run_tokenizer` finds it), `write_chat_tokenizer` writes its BPE as
those files into OUT (qkv.tasks.tokenizer_export) with QKV_CHAT_TEMPLATE beside it, and the recipe reads them
from there: OUT then carries the template every later command renders conversations with.

The template: every turn is a role marker line, the content and <eos>:

    <|system|>\\nYou are ...<eos>\\n<|user|>\\nWhat does ...?<eos>\\n<|assistant|>\\nIt ...<eos>\\n

The end of a turn is the tokenizer's own eos token, which every qkv tokenizer has at the same id, so a model
fine-tuned on it stops where generation stops anyway; the assistant's content and its <eos> are inside a
`{% generation %}` block (the tokens the loss covers, as transformers marks them). CHAT_ROLE_TOKENS are the
role markers as special tokens: a tokenizer trained with them reserved (`qkv speedrun`) reads each marker as
one token; any other reads it as its bytes, and the template still renders the same text.
"""

from __future__ import annotations

from pathlib import Path

from qkv.config import ConfigError
from qkv.run import run_folder_of
from qkv.storage import atomic_write_text
from qkv.tasks.tokenizer_export import write_qkv_tokenizer
from qkv.tasks.tokenizers import BPETokenizer, saved_tokenizer

CHAT_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE_FILE = "chat_template.jinja"

QKV_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def run_tokenizer(model_path: Path, source: Path) -> BPETokenizer | None:
    """The qkv tokenizer a source folder without tokenizer.json was trained with (saved beside it or in its
    run folder); None for any other folder (a Hugging Face folder is read as it is). A qkv tokenizer that is
    not a byte-level BPE is refused: a character or word vocabulary cannot spell the template's role
    markers."""
    if (source / "tokenizer.json").is_file():
        return None
    run = run_folder_of(model_path)
    tok = saved_tokenizer([source, *([run] if run else [])])
    if tok is None:
        return None
    if not isinstance(tok, BPETokenizer):
        raise ConfigError(f"{model_path}: a chat fine-tune needs a byte-level BPE tokenizer (task.tokenizer="
                          f"bpe); this run's is {tok.kind!r}, which cannot spell the chat template's role "
                          "markers")
    return tok


def write_chat_tokenizer(tok: BPETokenizer, out: Path, context_length: int | None) -> None:
    """`tok` written into `out` as Hugging Face files with QKV_CHAT_TEMPLATE beside it."""
    out.mkdir(parents=True, exist_ok=True)
    write_qkv_tokenizer(tok, out, context_length)
    atomic_write_text(QKV_CHAT_TEMPLATE, out / CHAT_TEMPLATE_FILE)


__all__ = ["CHAT_ROLE_TOKENS", "CHAT_TEMPLATE_FILE", "QKV_CHAT_TEMPLATE", "run_tokenizer",
           "write_chat_tokenizer"]
