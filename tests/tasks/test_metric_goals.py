"""Every task declares its metrics with a direction, the first being the primary one (best checkpoint,
ablation default), and its evaluation reports them."""

import pytest

from qkv.tasks import build_task, task_names


def test_every_task_declares_a_primary_metric_and_direction():
    for name in task_names():
        task_cls = _task_class(name)
        goals = task_cls.metrics
        assert goals, name
        assert all(g in ("min", "max") for g in goals.values()), name
        assert task_cls.primary_metric() == next(iter(goals)), name


def _task_class(name):
    from qkv.tasks import (
        captions,
        detection,
        digits,
        dtmf,
        images,
        listops,
        lm,
        mlm,
        numbers_zh,
        seq2seq,
        speech,
        tsv,
        vqa,
    )

    return {"copy": seq2seq.CopyTask, "reverse": seq2seq.ReverseTask, "sort": seq2seq.SortTask,
            "addition": seq2seq.AdditionTask, "numbers_zh": numbers_zh.NumbersZhTask, "tsv": tsv.TSVTask,
            "lm": lm.LMTask, "charlm": lm.LMTask, "bpelm": lm.LMTask, "stdlib_lm": lm.LMTask,
            "listops": listops.ListOpsTask,
            "digits": digits.DigitsTask, "captions": captions.CaptionsTask, "dtmf": dtmf.DTMFTask,
            "speech": speech.SpeechTask, "fashion_mnist": images.ImageClassificationTask,
            "image_folder": images.ImageClassificationTask, "vqa": vqa.VQATask,
            "mlm": mlm.MLMTask, "detection": detection.DetectionTask}[name]


@pytest.mark.parametrize("name, family, model, opts", [
    ("reverse", "encdec", "transformer-tiny", {"min_len": 2, "max_len": 3}),
    ("charlm", "gpt", "gpt-nano", {"context": 16}),
    ("listops", "bert", "bert-tiny", {"min_len": 8, "max_len": 24}),
    ("digits", "vit", "vit-digits", {}),
])
def test_evaluation_reports_the_declared_metrics(name, family, model, opts):
    task = build_task(name, family=family, **opts)
    m = task.build_model(model)
    got = task.evaluate(m, n=4)
    goals = type(task).metrics
    assert type(task).primary_metric() in got
    counts = {"n", "n_tokens"}  # how much was measured, not a score
    assert set(got) - counts <= set(goals), (sorted(got), goals)  # every score has a direction
