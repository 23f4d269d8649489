"""DDP and FSDP2 under torchrun (gloo, 2 CPU processes) against one process on the same global batch.

Tolerance: losses and grad norms within rel 1e-5 (gloo's all-reduce sums in another order than one
process's backward; everything is fp32), weights after 4 AdamW steps within 1e-5 absolute.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

import qkv

HERE = Path(__file__).parent
SCRIPT = HERE / "dist_train.py"
pytestmark = pytest.mark.distributed


def launch(run, mode, out, device="cpu"):
    run([SCRIPT, mode, out, device], timeout=300)
    return json.loads((out / "losses.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, torchrun):
    """Each run once per module: the in-process reference and the torchrun runs (cached by mode)."""
    cache = {}

    def get(mode):
        if mode not in cache:
            out = tmp_path_factory.mktemp(mode)
            if mode == "none":
                from dist_train import main

                cache[mode] = out, main("none", out)
            else:
                cache[mode] = out, launch(torchrun, mode, out)
        return cache[mode]

    return get


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_matches_single_process(mode, runs):
    ref_dir, ref = runs("none")
    out, got = runs(mode)
    assert got["world"] == 2 and ref["world"] == 1
    assert sorted(got["losses"]) == sorted(ref["losses"]) == ["1", "2", "3", "4"]
    for step, (loss, gnorm) in ref["losses"].items():
        assert got["losses"][step][0] == pytest.approx(loss, rel=1e-5), step
        assert got["losses"][step][1] == pytest.approx(gnorm, rel=1e-5), step
    assert got["eval"]["loss"] == pytest.approx(ref["eval"]["loss"], rel=1e-5)
    # 4 updates x 2 micro-batches, one bucket (a 40k-parameter model): sync on the last only
    if mode == "ddp":
        assert got["allreduce_calls"] == 4
    assert got["ddp_alive_after_close"] == 0
    # the same tensors in the checkpoint as one process writes: a tied weight once (FSDP stored lm_head twice)
    from safetensors import safe_open

    def keys(folder):
        with safe_open(str(folder / "checkpoints" / "step_00000004" / "model.safetensors"), "pt") as f:
            return sorted(f.keys())

    assert keys(out) == keys(ref_dir) and "lm_head.weight" not in keys(out)
    # the checkpoint written by rank 0 (gathered from shards under FSDP) loads in this single process
    a = qkv.from_pretrained(out / "checkpoints" / "step_00000004")
    b = qkv.from_pretrained(ref_dir / "checkpoints" / "step_00000004")
    for k, v in b.state_dict().items():
        torch.testing.assert_close(a.state_dict()[k], v, rtol=0, atol=1e-5)
    # the optimizer state is keyed by parameter name, so it is portable between process counts
    s = torch.load(out / "checkpoints" / "step_00000004" / "train_state.pt", weights_only=True)
    assert "decoder.blocks.0.attn.qkv_proj.weight" in s["optimizer"]["state"] and len(s["rng"]) == 2


def test_fsdp_checkpoint_resumes_in_one_process(runs, tmp_path):
    # a checkpoint written by 2 FSDP ranks continues in a single process (the world size changes)
    src, _ = runs("fsdp")
    out = tmp_path / "resumed"
    shutil.copytree(src, out)
    from _toy import ToyLM, tiny_gpt

    from qkv.train import TrainConfig, Trainer

    cfg = TrainConfig(max_steps=5, batch_size=4, grad_accum=4, lr=3e-3, warmup=1, out_dir=str(out),
                      resume=True, progress=False, tensorboard=False, plot=False, schedule="cosine")
    tr = Trainer(tiny_gpt(n_layers=3), cfg, ToyLM())
    s = tr.fit()
    assert s["steps"] == 5 and tr.optimizer.state  # AdamW moments came back


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_nccl_matches_single_gpu(mode, tmp_path, torchrun):
    from dist_train import main

    ref = main("none", tmp_path / "single", device="cuda")
    got = launch(torchrun, mode, tmp_path / mode, device="cuda")
    for step, (loss, _) in ref["losses"].items():
        assert got["losses"][step][0] == pytest.approx(loss, rel=1e-4), step  # TF32/NCCL reduction order


# -- the README's commands, end to end through the CLI ----------------------------------
ROOT = HERE.parents[1]
TINY_LM = ["--max-steps", "2", "--no-progress", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
           "task.context=16", "train.batch_size=4", "eval.n=4", "eval.samples=1"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_readme_torchrun_command_trains_evaluates_and_saves(mode, tmp_path, torchrun):
    out = tmp_path / mode
    # README: torchrun --standalone --nproc_per_node=N -m qkv.cli.main train configs/charlm.yaml
    # [train.distributed=fsdp]
    r = torchrun(["-m", "qkv.cli.main", "train", "configs/charlm.yaml", "--out", out, *TINY_LM]
                 + (["train.distributed=fsdp"] if mode == "fsdp" else []), cwd=ROOT)
    assert f"distributed {mode} x2" in r.stderr and "training GPT (" in r.stderr  # not FSDP's FSDPGPT
    result = json.loads((out / "results.json").read_text())
    assert result["metrics"]["n_tokens"] > 0 and result["samples"] and result["train"]["steps"] == 2
    assert "held-out" in r.stdout
    # the final held-out evaluation equals a single-process evaluation of the saved checkpoint
    from qkv.run import evaluate_run

    assert evaluate_run(out, n=4)["val_loss"] == pytest.approx(result["metrics"]["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_fsdp_evaluation_that_generates_during_training(tmp_path, torchrun):
    """The reverse task evaluates by generating (encode_source, decoding steps, the head: not the root
    forward, whose FSDP hook gathers the root's parameters): under FSDP it died at the first evaluation
    ("mixed torch.Tensor and DTensor"), and the completed steps were lost. The evaluation now sees whole
    parameters."""
    out = tmp_path / "rev"
    r = torchrun(["-m", "qkv.cli.main", "train", "configs/reverse.yaml", "--out", out, "--max-steps", "4",
                  "--no-progress", "model.n_encoder_layers=1", "model.n_decoder_layers=1", "model.d_model=32",
                  "model.n_heads=2", "train.batch_size=4", "eval.n=8", "eval.samples=1",
                  "eval.during_training=8",
                  "train.eval_every=2", "train.warmup=1", "train.distributed=fsdp"], cwd=ROOT)
    assert "distributed fsdp x2" in r.stderr
    result = json.loads((out / "results.json").read_text())
    assert result["train"]["steps"] == 4 and "exact_match" in result["metrics"]
    # the evaluations during training agree with one process evaluating the same checkpoint
    from qkv.run import evaluate_run

    assert evaluate_run(out, n=8)["exact_match"] == pytest.approx(result["metrics"]["exact_match"])
