"""Run by test_distributed.py under `torchrun --nproc_per_node=2`; main() is also called in-process for the
single-process reference. usage: dist_train.py MODE OUT_DIR [DEVICE] (MODE: none | ddp | fsdp; DEVICE: cpu |
cuda)."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _toy import ToyLM, tiny_gpt  # noqa: E402

from qkv.train import LambdaCallback, TrainConfig, Trainer  # noqa: E402


def main(mode: str, out: Path, device: str = "cpu") -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1")) if mode != "none" else 1
    # same global batch either way: 2 ranks x 2 micro-batches of 4 == 1 process x 4 micro-batches of 4
    cfg = TrainConfig(max_steps=4, batch_size=4, grad_accum=4 // world, lr=3e-3, warmup=1, schedule="cosine",
                      distributed=mode, device=device, out_dir=str(out), progress=False, tensorboard=False,
                      plot=False,
                      log_every=1, clip_grad=0.5, save_every=2, max_eval_batches=3, eval_every=2)  # 3: uneven
    losses = {}
    cb = LambdaCallback(on_step_end=lambda tr, step, rec: losses.__setitem__(str(step),
                                                                             [rec["loss"], rec["grad_norm"]]))
    trainer = Trainer(tiny_gpt(seed=0, n_layers=3), cfg, ToyLM(), callbacks=[cb])
    calls = [0]
    if mode == "ddp":  # count gradient all-reduces: with no_sync there is one per update, not per micro-batch
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(state, bucket):
            calls[0] += 1
            return allreduce_hook(state, bucket)

        trainer.engine.register_comm_hook(None, counting_hook)
    summary = trainer.fit()
    result = {"losses": losses, "eval": summary["eval"], "world": trainer.dist.world_size,
              "allreduce_calls": calls[0]}
    trainer.close()
    # close() lets go of the DDP wrapper before the process group goes: one freed later deadlocked gloo at
    # exit
    import gc

    # type(o), not isinstance(o, ...): a dead weakproxy among the objects raises ReferenceError on isinstance
    result["ddp_alive_after_close"] = sum(issubclass(type(o), torch.nn.parallel.DistributedDataParallel)
                                          for o in gc.get_objects())
    if trainer.dist.is_main:
        (out / "losses.json").write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "cpu")
