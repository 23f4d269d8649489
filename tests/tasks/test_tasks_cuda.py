"""Tasks evaluate models that live on a GPU (batches are built on the CPU and moved to the model's device)."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.tasks import build_task

pytestmark = pytest.mark.cuda
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("name,family,preset", [
    ("reverse", "encdec", "transformer-tiny"), ("addition", "gpt", "gpt-nano"), ("copy", "lstm", "lstm-tiny"),
    ("numbers_zh", "encdec", "transformer-tiny"),
])
def test_seq2seq_evaluate_on_cuda(name, family, preset):
    task = build_task(name, family=family)
    model = task.build_model(preset).cuda()
    res = task.evaluate(model, n=16)
    assert 0.0 <= res["exact_match"] <= 1.0 and res["n"] == 16
    assert len(task.samples(model, 2)) == 2


@cuda
@pytest.mark.parametrize("family,preset", [("gpt", "gpt-tiny"), ("lstm", "lstm-tiny")])
def test_lm_evaluate_and_sample_on_cuda(family, preset):
    task = build_task("charlm", family=family, sample_tokens=20)
    model = task.build_model(preset).cuda()
    cpu = task.evaluate(model.cpu(), n=8)
    gpu = task.evaluate(model.cuda(), n=8)
    assert math.isclose(cpu["val_loss"], gpu["val_loss"], rel_tol=1e-3)
    assert len(task.samples(model, 1)[0]) > 1


@cuda
@pytest.mark.parametrize("family,preset", [("bert", "bert-tiny"), ("lstm", "bilstm-classify")])
def test_listops_evaluate_on_cuda(family, preset):
    task = build_task("listops", family=family, max_len=128)
    model = task.build_model(preset).cuda()
    assert 0.0 <= task.evaluate(model, n=16)["accuracy"] <= 1.0
