"""Building a model without allocating its weights, the one way every loader of this package does it.

`build_skeleton(build)` runs a model constructor with each parameter moved to the meta device as it is
registered, while buffers stay where __init__ computed them (accelerate's `init_empty_weights` without
`include_buffers`); `materialise(model, dtype)` then gives every parameter uninitialised CPU storage in the
dtype it will keep, and the loader fills it from the file. Why not `with torch.device("meta")` and
`to_empty`: every tensor made in __init__ would land on meta, so the buffers computed there (RoPE's
inv_freq and tables, Marian's sinusoids, Whisper's mel filters) would be left uninitialised, and
`to_empty` makes new parameters, untying tied ones (a tied parameter here is one object, materialised once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from qkv.storage import CheckpointError

M = TypeVar("M", bound=nn.Module)


# the in-place fills that initialisers (torch.nn.init, reset_parameters, init_weights) run on a parameter
_INIT_OPS = frozenset({"normal_", "uniform_", "zero_", "fill_", "copy_", "mul_", "add_", "sub_", "div_",
                       "clamp_", "erfinv_", "exponential_", "log_normal_", "bernoulli_", "random_", "cauchy_",
                       "geometric_"})


class SkipInitOnMeta(TorchFunctionMode):
    """Initialising a meta tensor computes nothing, but torch routes some fills on meta (normal_) through its
    reference implementations, whose first use imports torch._dynamo: ~75 MB of resident memory for nothing.
    The
    skeleton's initialisers are skipped instead (their results would be overwritten by the file anyway)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INIT_OPS:
            # Tensor.normal_(t, ...) passes the tensor first; torch.nn.init.normal_ passes it as tensor=
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, Tensor) and target.device.type == "meta":
                return target
        return func(*args, **kwargs)


_building = threading.local()  # .depth: how many build_skeleton calls this thread is inside
_hook = threading.Lock()
_hook_users = 0  # threads inside build_skeleton: the hook is installed while there is one
_register_parameter = nn.Module.register_parameter  # what the hook calls (set when it is installed)


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if getattr(_building, "depth", 0) and param is not None and param.device.type != "meta":
        param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
    _register_parameter(module, name, param)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While active, every parameter a module registers in this thread is moved to the meta device at once
    (nn.Linear's torch.empty is never touched; its reset_parameters and our init_weights then skip the meta
    tensors). Buffers stay where __init__ computed them: positional tables, masks, mel filters are real.
    Modules
    that other threads build meanwhile are passed through untouched (the switch is per thread), and
    nn.Module.register_parameter is torch's own again once no thread is building."""
    global _hook_users, _register_parameter
    with _hook:
        if _hook_users == 0:
            _register_parameter = nn.Module.register_parameter
            nn.Module.register_parameter = _register_on_meta  # type: ignore[method-assign]
        _hook_users += 1
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        with SkipInitOnMeta():
            yield
    finally:
        _building.depth -= 1
        with _hook:
            _hook_users -= 1
            if _hook_users == 0:
                nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign]


def build_skeleton(build: Callable[[], M]) -> M:
    """`build()` (a model constructor) with its parameters on the meta device and its buffers real (the
    module docstring says why not torch.device("meta")): `materialise` then gives the parameters storage in
    the dtype they will keep, and the loader fills every one of them."""
    with _parameters_on_meta():
        return build()


def materialise(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Give every meta parameter uninitialised CPU storage (in `dtype` when it is floating and one is given),
    keeping tied parameters tied; then cast the whole model to `dtype` (buffers and real parameters; what
    is already in it is not copied)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in made:
                want = dtype if dtype is not None and p.is_floating_point() else p.dtype
                made[id(p)] = type(p)(torch.empty(p.shape, dtype=want), requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    left = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if left:  # a constructor that derived a buffer from a parameter: build_skeleton cannot be used for it
        raise CheckpointError(f"{type(model).__name__}: buffer(s) {left[:3]} were left on the meta device "
                              "(a loader bug)")
    if dtype is not None:
        model.to(dtype=dtype)

