"""The ablation lab: suites of training runs that test the articles' claims, attention maps, diagnostics.

    run_suite("configs/ablations/01_sqrt_dk.yaml", "runs/ablations/sqrt_dk", quick=True)  -> summary.md path
    attention_maps(model, tokenizer_or_ids, text, "maps.png")                               -> AttentionMaps
    attention_from_checkpoint("runs/x/final", "31415", "maps.png")                         -> AttentionMaps
    diagnose(model, input_ids)                                                              -> Diagnosis
    softmax_saturation((16, 64, 256))                                                    -> the sqrt(d_k) fact
"""

from qkv.experiments.attention import (
    AttentionMaps,
    attention_from_checkpoint,
    attention_maps,
    collect_attentions,
)
from qkv.experiments.diagnostics import Diagnosis, diagnose, flag_heads, head_stats
from qkv.experiments.numeric import saturation_table, softmax_saturation
from qkv.experiments.runner import run_suite
from qkv.experiments.suite import Suite, expand, load_suite

__all__ = [
    "AttentionMaps", "Diagnosis", "Suite", "attention_from_checkpoint", "attention_maps",
    "collect_attentions",
    "diagnose", "expand", "flag_heads", "head_stats", "load_suite", "run_suite", "saturation_table",
    "softmax_saturation",
]
