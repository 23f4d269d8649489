"""precision=auto (the default): the fastest precision of the device (fp32 on a CPU, bf16 on a GPU that has
it); an explicit bf16 on a CPU without native bf16 runs with one warning saying so, and nowhere else."""

from __future__ import annotations

import warnings

import pytest
import torch

from qkv.train import precision as P
from qkv.train.trainer import Trainer


def test_auto_is_fp32_on_a_cpu_and_the_default(make_gpt, toy_data, cfg_factory):
    assert P.auto_precision(torch.device("cpu")) == "fp32"
    cfg = cfg_factory()
    assert cfg.precision == "auto"
    tr = Trainer(make_gpt(), cfg, toy_data)
    assert tr.precision.name == "fp32" and tr.precision.dtype == torch.float32
    ref = Trainer(make_gpt(), cfg_factory(precision="fp32"), toy_data)
    torch.manual_seed(0)
    got = tr.compute_gradients(step=1)[0]
    torch.manual_seed(0)
    assert got == ref.compute_gradients(step=1)[0]  # the same computation as fp32


@pytest.mark.parametrize("native", [False, True])
def test_explicit_bf16_on_a_cpu_warns_only_without_native_bf16(monkeypatch, native):
    monkeypatch.setattr(P, "native_bf16_cpu", lambda: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prec = P.Precision("bf16", torch.device("cpu"))
        P.Precision("auto", torch.device("cpu"))
        P.Precision("fp32", torch.device("cpu"))
    assert prec.name == "bf16"
    notes = [str(w.message) for w in caught if "native bf16" in str(w.message)]
    assert notes == ([] if native else [P.SLOW_BF16_NOTE])


def test_native_bf16_probe_answers():
    assert isinstance(P.native_bf16_cpu(), bool)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_is_bf16_on_a_gpu_that_has_it():
    want = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    assert P.Precision("auto", torch.device("cuda")).name == want
