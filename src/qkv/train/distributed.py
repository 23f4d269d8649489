"""Data parallelism with PyTorch's own engines: DDP and FSDP2 (`fully_shard`), launched by torchrun.

    torchrun --standalone --nproc_per_node=2 -m qkv.cli.main train ...       # one machine
    torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --nproc_per_node=8 ...

NCCL on CUDA, gloo on CPU. Sampling needs no sampler object: rank r of W takes global micro-batch
index (step * grad_accum + micro) * W + r from the batch source, so every rank sees different data,
the union over ranks is the single-process global batch, and resuming needs only the step.
Only rank 0 logs and writes files; state dicts are gathered to full (unsharded) tensors first, so a
checkpoint written under FSDP loads in a single process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

from qkv.config import ConfigError
from qkv.nn.params import tied_names


@dataclass
class DistInfo:
    mode: str  # none | ddp | fsdp
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # whether setup started the process group: who starts it ends it, so that a caller that runs several
    # trainings in one launch (qkv speedrun) keeps one group; a group started again in the same torchrun
    # launch would meet the first one's addresses in torchrun's store
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size() -> int:
    """The processes of this launch (torchrun's WORLD_SIZE; 1 without torchrun), known before the process
    group starts: what a recipe divides an epoch by, since every rank reads its own share of each batch."""
    return int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1


def setup(mode: str, device: torch.device) -> tuple[DistInfo, torch.device]:
    """Initialise the process group when launched by torchrun; returns the info and this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if mode == "auto":
        mode = "ddp" if world > 1 else "none"
    if mode == "none":
        if world > 1:
            raise ConfigError("launched with several processes but distributed=none; use ddp or fsdp")
        return DistInfo("none"), device
    if not launched_by_torchrun():
        raise ConfigError(f"distributed={mode} needs a torchrun launch (RANK/WORLD_SIZE unset), e.g. "
                          "`torchrun --standalone --nproc_per_node=2 ...`; use distributed=none for one "
                          "process")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(mode, rank, dist.get_world_size(), local_rank, owns), device


def start_group() -> None:
    """Start the process group of a torchrun launch for a caller that runs several trainings in it (each
    training's setup then finds it, and its teardown leaves it): gloo for CPU tensors, NCCL beside it for
    CUDA ones where there is a GPU."""
    if not launched_by_torchrun() or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))


def end_group() -> None:
    """End the group start_group started."""
    if launched_by_torchrun() and dist.is_initialized():
        dist.destroy_process_group()


def teardown(info: DistInfo) -> None:
    if info.enabled and info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_parameters(model: nn.Module) -> None:
    """Make every rank start from rank 0's weights (DDP does this itself; fully_shard does not)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def wrap(model: nn.Module, info: DistInfo, *, block_types: tuple[type, ...],
         find_unused: bool = False) -> nn.Module:
    """DDP: returns the wrapper. FSDP2: shards each block, then the root, in place (returns `model`)."""
    if info.mode == "ddp":
        ids = [model_device(model).index] if model_device(model).type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused)
    if info.mode == "fsdp":
        broadcast_parameters(model)
        for m in model.modules():
            if isinstance(m, block_types):
                fully_shard(m)  # one all-gather unit per block: peak memory ~ one block's full weights
        fully_shard(model)  # the rest (embeddings, final norm, heads; tied weights stay together)
        return model
    return model


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def sync_context(engine: nn.Module, info: DistInfo, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Skip the gradient all-reduce on all but the last micro-step of an accumulation."""
    if info.mode == "ddp" and not sync:
        return engine.no_sync()
    if info.mode == "fsdp":
        engine.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """Full (unsharded, CPU) model and optimizer state dicts keyed by parameter names, without wrapper
    prefixes. Collective under DDP/FSDP: every rank must call it (rank 0 receives the tensors)."""

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        model_state, optim_state = get_model_state_dict(model, options=opts), {}
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=opts)
    # a tied weight once, under its first name, as in every other checkpoint: FSDP's gathered copies do not
    # share storage (so storage.clean_state_dict's dedup by pointer cannot see them), and a second copy of a
    # 49k-word embedding is ~100 MB per checkpoint
    for name in tied_names(model):
        model_state.pop(name, None)
    return model_state, optim_state


@contextlib.contextmanager
def unsharded(model: nn.Module, info: DistInfo) -> Iterator[None]:
    """Under FSDP2, the model's parameters gathered whole for the duration (then sharded again). Evaluation
    may call into the model other than through its root forward, whose hook does the gathering: generate()
    runs the encoder, the decoding steps and the head directly, and found the root's embedding still a DTensor
    shard. Collective: every rank must enter it. Elsewhere it does nothing."""
    if info.mode != "fsdp":
        yield
        return

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # and kept whole: a block's own forward (an encoder pass, a prefill) would reshard it after
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        # wrap()'s settings again: blocks reshard after their forward, the root (FSDP's rule) not
        for m in units:
            m.set_reshard_after_forward(m is not model, recurse=False)
            m.reshard()


def model_class_name(model: nn.Module) -> str:
    """The model's own class name: fully_shard swaps in a class FSDP<name>(FSDPModule, <the class>)."""
    own = next((c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed")),
               type(model))
    return own.__name__


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict,
                    optim_state: dict | None) -> None:
    """Inverse of full_state: every rank passes the full dicts; FSDP keeps its own shard of each."""
    opts = StateDictOptions(full_state_dict=True, strict=False)
    if optimizer is None or optim_state is None:
        set_model_state_dict(model, model_state, options=opts)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_state,
                       optim_state_dict=optim_state, options=opts)
