"""Tasks: batch sources with a tokenizer, model overrides, evaluation and samples (see base.py).

    task = build_task("reverse", family="encdec", min_len=10, max_len=20)
    model = task.build_model("transformer-tiny")
    batch = task.batch(index, batch_size)         # dict of model keyword arguments
    task.evaluate(model, n=500)                   # {"exact_match": ..., "token_accuracy": ..., ...}

Importing this package registers every task.
"""

# importing the task modules registers the tasks (captions, digits, images, dtmf, speech: image and audio)
from qkv.tasks import captions, digits, dtmf, images, listops, lm, numbers_zh, seq2seq, speech, tsv  # noqa: F401
from qkv.tasks import detection as _detection  # noqa: F401  (object detection on Fashion-MNIST canvases)
from qkv.tasks import mlm as _mlm  # noqa: F401  (masked-LM pretraining)
from qkv.tasks import vqa as _vqa  # noqa: F401  (images and text)
from qkv.tasks.base import (
    TASK_FILE,
    Task,
    build_options,
    build_task,
    load_task,
    register_task,
    task_from_dict,
    task_names,
    task_spec,
)
from qkv.tasks.tokenizers import (
    SPECIALS,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    TokenizerError,
    WordTokenizer,
    load_tokenizer,
    save_tokenizer,
)

__all__ = [
    "SPECIALS", "TASK_FILE", "BPETokenizer", "CharTokenizer", "Task", "Tokenizer", "TokenizerError",
    "WordTokenizer",
    "build_options", "build_task", "load_task", "load_tokenizer", "register_task", "save_tokenizer",
    "task_from_dict", "task_names", "task_spec",
]
