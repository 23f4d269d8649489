"""Suite 13 (configs/ablations/13_mla.yaml): its variants differ only in the attention's key/value layout,
their caches hold what the file's header says, and its quick size trains an MLA run end to end."""

from __future__ import annotations

import json

from qkv.experiments import run_suite
from qkv.experiments.suite import expand, load_suite
from qkv.models.registry import build
from qkv.nn.mla import cache_bytes_per_token

WIDTH = ("d_model", "n_heads", "n_layers", "d_ff", "ffn", "norm", "position", "context_length", "vocab_size")


def _models() -> dict:
    suite = load_suite("13_mla")
    return {spec.variant: build(dict(spec.model)) for spec in expand(suite) if spec.seed == 0}


def test_variants_share_the_width_and_cache_what_the_header_says():
    models = _models()
    assert list(models) == ["mha", "gqa", "mqa", "mla", "mla-64", "mla-rope16"]
    widths = {name: tuple(getattr(m.config, f) for f in WIDTH) for name, m in models.items()}
    assert len(set(widths.values())) == 1, widths
    assert [m.config.mla.enabled for m in models.values()] == [False, False, False, True, True, True]
    # fp32 bytes per cached token over the 4 layers: 2 x kv heads x 16 per layer, MLA latent 32 (64) + rope 8
    got = {name: cache_bytes_per_token(m.make_cache(1, 1)) for name, m in models.items()}
    per_layer = {"mha": 2 * 8 * 16, "gqa": 2 * 2 * 16, "mqa": 2 * 16, "mla": 32 + 8, "mla-64": 64 + 8,
                 "mla-rope16": 32 + 16}
    assert got == {name: 4 * 4 * n for name, n in per_layer.items()}
    assert got["mqa"] < got["mla"] < got["mla-rope16"] < got["gqa"] < got["mla-64"] < got["mha"]


def test_quick_size_trains_the_mla_variant(tmp_path):
    run_suite("13_mla", tmp_path, quick=True, only="mla", threads=1, log=None)
    res = json.loads((tmp_path / "runs" / "mla__seed0" / "result.json").read_text())
    assert res["error"] is None and res["steps"] == 15 and not res["diverged"]
    assert 0.0 < res["metric"] < 5.0  # below ln(vocab) of an untrained model is not asked of 15 steps
