"""Each task's options (the run config's `task:` section) accept and refuse what their rules say, at the
boundaries: an exclusive bound stays exclusive, an inclusive one inclusive, a rule over two keys holds at
equality. The cases are the tasks' rules written out by hand (not read from the declarations), and a
refusal is one ConfigError naming the key as the user writes it (`task.val_fraction ...`)."""

from __future__ import annotations

import dataclasses

import pytest

from qkv.config import ConfigError
from qkv.tasks import build_options, task_names, task_spec
from qkv.tasks.numbers_zh import MAX_NUMBER

MLM, TSV, FOLDER = {"path": "corpus.txt"}, {"path": "pairs.tsv"}, {"path": "images"}

# (task, options, the key a refusal names; None = accepted)
CASES = [
    ("reverse", {"val_fraction": 0.0}, "val_fraction"),
    ("reverse", {"val_fraction": 1.0}, "val_fraction"),
    ("reverse", {"val_fraction": 0.999}, None),
    ("reverse", {"min_len": 0, "max_len": 3}, "min_len"),
    ("reverse", {"min_len": 1, "max_len": 1}, None),
    ("reverse", {"min_len": 5, "max_len": 4}, "max_len"),
    ("copy", {"symbols": "aab"}, "symbols"),
    ("copy", {"symbols": "a b"}, "symbols"),
    ("copy", {"symbols": "letters"}, None),
    ("addition", {"min_digits": 0}, "min_digits"),
    ("addition", {"min_digits": 3, "digits": 3}, None),
    ("addition", {"min_digits": 4, "digits": 3}, "digits"),
    ("numbers_zh", {"max_value": 0}, None),
    ("numbers_zh", {"max_value": MAX_NUMBER}, None),
    ("numbers_zh", {"max_value": MAX_NUMBER + 1}, "max_value"),
    ("numbers_zh", {"max_value": -1}, "max_value"),
    ("numbers_zh", {"date_fraction": 0.0}, None),
    ("numbers_zh", {"date_fraction": 1.0}, None),
    ("numbers_zh", {"date_fraction": 1.01}, "date_fraction"),
    ("numbers_zh", {"year_min": 1, "year_max": 9999}, None),
    ("numbers_zh", {"year_min": 0}, "year_min"),
    ("numbers_zh", {"year_max": 10000}, "year_max"),
    ("numbers_zh", {"year_min": 2000, "year_max": 1999}, "year_max"),
    ("listops", {"max_len": 8192}, None),
    ("listops", {"max_len": 8193}, "max_len"),
    ("listops", {"max_depth": 0}, "max_depth"),
    ("listops", {"max_args": 1}, "max_args"),
    ("listops", {"max_args": 2, "leaf_prob": 0.0}, None),
    ("listops", {"leaf_prob": 1.0}, "leaf_prob"),
    ("dtmf", {"min_tone_ms": 0.0}, "min_tone_ms"),
    ("dtmf", {"min_gap_ms": 0.0, "min_snr_db": 30.0}, None),
    ("dtmf", {"min_snr_db": 31.0}, "max_snr_db"),
    ("dtmf", {"min_gap_ms": 101.0}, "max_gap_ms"),
    ("dtmf", {"max_digits": 20}, "clip_seconds"),
    ("speech", {"speed_perturb": 0.0, "max_pitch": 99, "time_mask_seconds": 0.0}, None),
    ("speech", {"speed_perturb": 1.0}, "speed_perturb"),
    ("speech", {"min_pitch": -1}, "min_pitch"),
    ("speech", {"max_pitch": 100}, "max_pitch"),
    ("speech", {"min_pitch": 80}, "max_pitch"),
    ("speech", {"min_speed": 0}, "min_speed"),
    ("speech", {"pool_size": 0}, "pool_size"),
    ("speech", {"train_voices": []}, "train_voices"),
    ("speech", {"freq_mask_hz": -1.0}, "freq_mask_hz"),
    ("digits", {"test_fraction": 1.0}, "test_fraction"),
    ("digits", {"max_scale": 1.0}, "max_scale"),
    ("digits", {"max_scale": 0.5, "max_shift": 0, "max_rotate": 0.0}, None),
    ("digits", {"max_rotate": -1.0}, "max_rotate"),
    ("detection", {"min_items": 0}, "min_items"),
    ("detection", {"min_items": 2, "max_items": 1}, "max_items"),
    ("detection", {"max_size": 64, "max_iou": 0.0}, None),
    ("detection", {"max_size": 65}, "canvas_size"),
    ("detection", {"min_size": 0}, "min_size"),
    ("detection", {"max_iou": 1.0}, "max_iou"),
    ("detection", {"val_canvases": 0}, "val_canvases"),
    ("captions", {"dataset": "cifar"}, "dataset"),
    ("captions", {"max_shift": 0}, None),
    ("captions", {"max_shift": -1}, "max_shift"),
    ("captions", {"test_fraction": 0.0}, "test_fraction"),
    ("fashion_mnist", {"pad": 0}, None),
    ("fashion_mnist", {"pad": -1}, "pad"),
    ("image_folder", {}, "path"),
    ("image_folder", {**FOLDER, "channels": 2}, "channels"),
    ("image_folder", {**FOLDER, "channels": 1}, None),
    ("image_folder", {**FOLDER, "dev_fraction": 1.0}, "dev_fraction"),
    ("image_folder", {**FOLDER, "image_size": 0}, "image_size"),
    ("mlm", {}, "path"),
    ("mlm", {**MLM, "mask_rate": 0.0}, "mask_rate"),
    ("mlm", {**MLM, "mask_rate": 1.0}, "mask_rate"),
    ("mlm", {**MLM, "mask_share": 0.9, "random_share": 0.1, "context": 4}, None),
    ("mlm", {**MLM, "mask_share": 0.95, "random_share": 0.1}, "random_share"),
    ("mlm", {**MLM, "random_share": -0.1}, "random_share"),
    ("mlm", {**MLM, "context": 3}, "context"),
    ("mlm", {**MLM, "tokenizer": "wordpiece"}, "tokenizer"),
    ("tsv", {}, "path"),
    ("tsv", {**TSV, "max_len": 0}, "max_len"),
    ("tsv", {**TSV, "bleu_tokenize": "zh", "tokenizer": "bpe"}, None),
    ("tsv", {**TSV, "bleu_tokenize": "klingon"}, "bleu_tokenize"),
    ("charlm", {"corpus": "stdlib", "path": "book.txt"}, "corpus"),
    ("charlm", {"corpus": "wikipedia"}, "corpus"),
    ("charlm", {"val_path": "held_out.txt"}, "val_path"),
    ("charlm", {"tokenizer_file": "tokenizer.json"}, "tokenizer_file"),
    ("bpelm", {"tokenizer_file": "tokenizer.json", "context": 2, "sample_tokens": 0}, None),
    ("charlm", {"context": 1}, "context"),
    ("charlm", {"sample_tokens": -1}, "sample_tokens"),
    ("charlm", {"temperature": 0.0, "top_k": 0}, None),
    ("charlm", {"temperature": -0.1}, "temperature"),
    ("charlm", {"top_k": -1}, "top_k"),
    ("vqa", {"questions": []}, "questions"),
    ("vqa", {"questions": ["colour"]}, "questions"),
    ("vqa", {"questions": ["what"], "pad": 0}, None),
    ("vqa", {"patch_size": 0}, "patch_size"),
    ("vqa", {"pad": -1}, "pad"),
]


@pytest.mark.parametrize("task, options, refused", CASES)
def test_options_accept_and_refuse_at_their_boundaries(task, options, refused):
    if refused is None:
        built = build_options(task, options)
        assert all(getattr(built, key) == value for key, value in options.items())
        return
    with pytest.raises(ConfigError) as caught:
        build_options(task, options)
    assert str(caught.value).startswith(f"task.{refused}")
    assert (caught.value.field, caught.value.where) == (refused, "task")


def test_every_option_is_declared_with_its_help():
    """A task's key is declared with qkv.config.setting (its help is the docs table's text)."""
    for name in task_names():
        for f in dataclasses.fields(task_spec(name).options_class):
            assert f.metadata.get("help"), f"task {name!r}: option {f.name} has no help"
