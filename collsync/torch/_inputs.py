"""What `collsync.torch`'s public calls check at their entry: an argument of the wrong kind is refused in one line
naming the call, what it got and what it takes.

Why at the entry: past it the value reaches torch, MPI or Horovod's own code, whose errors name neither the call nor
the fix (`'list' object has no attribute 'detach'`, `'Sequential' object has no attribute 'param_groups'`), or does
something other than what was asked without a word (`broadcast_parameters(model)` would broadcast nothing). And every
check here looks at this rank's arguments only, before the call waits for any other rank: a script passing the same
wrong value on every rank gets the same error on every rank, and none of them is left waiting in a collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from collsync.torch._ops_base import _check

# Horovod's `Compression` classes are classes with static `compress` and `decompress`.
_COMPRESSORS = "collsync.torch.Compression.none or Compression.fp16"


def tensors(values: Any, what: str) -> list[torch.Tensor]:
    """A grouped operation's tensors, as a list: a list (or tuple, or other iterable) of tensors, never one tensor
    (iterating a tensor would reduce each of its rows as a tensor of its own)."""
    if isinstance(values, torch.Tensor) or not isinstance(values, Iterable) or isinstance(values, str | bytes | dict):
        one = what.replace("grouped_", "")
        raise TypeError(
            f"{what}: expected a list of torch.Tensor, got {type(values).__name__}; pass [tensor, ...] "
            f"({one} takes one tensor)"
        )
    listed = list(values)
    for i, t in enumerate(listed):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: expected a list of torch.Tensor, got {type(t).__name__} at index {i}")
        _check(t, what)
    return listed


def compression(value: Any, what: str) -> None:
    """Horovod's `compression=`: a compressor class (`Compression.none`, `Compression.fp16`), not its name."""
    if not (callable(getattr(value, "compress", None)) and callable(getattr(value, "decompress", None))):
        raise TypeError(f"{what}: compression={value!r} is not a compressor; pass {_COMPRESSORS}")


def optimizer(value: Any, what: str) -> None:
    """A torch optimizer where one goes: a model (or its parameters) passed for it is named, with the call to make."""
    if isinstance(value, torch.optim.Optimizer):
        return
    got = f"a model ({type(value).__name__})" if isinstance(value, torch.nn.Module) else type(value).__name__
    raise TypeError(
        f"{what}: expected a torch.optim.Optimizer, got {got}; pass the optimizer built on the model's parameters, "
        "e.g. torch.optim.SGD(model.parameters(), lr=0.01)"
    )


def optimizer_args(passes: Any, predivide: Any) -> None:
    """`DistributedOptimizer`'s numbers, typed before Horovod's own checks compare them (a string would fail inside
    a comparison, a zero factor inside a division)."""
    if isinstance(passes, bool) or not isinstance(passes, int):
        raise TypeError(
            f"DistributedOptimizer: backward_passes_per_step={passes!r} is not a whole number; pass an int >= 1"
        )
    if isinstance(predivide, bool) or not isinstance(predivide, int | float) or not 0 < predivide < math.inf:
        raise ValueError(
            f"DistributedOptimizer: gradient_predivide_factor={predivide!r} must be a number > 0 (default 1.0)"
        )


def named_parameters(value: Any) -> list[Any]:
    """`DistributedOptimizer(named_parameters=...)` as a list of (name, parameter) pairs: a model, a dict or a list
    of bare parameters passed instead is named, with what to pass (Horovod's message, and class, for pairs that are
    not tuples)."""
    if isinstance(value, torch.nn.Module | dict | str | torch.Tensor) or not isinstance(value, Iterable):
        got = f"a model ({type(value).__name__})" if isinstance(value, torch.nn.Module) else type(value).__name__
        raise TypeError(
            f"DistributedOptimizer: named_parameters got {got}; pass model.named_parameters() (pairs of name and "
            "parameter)"
        )
    listed = list(value)
    bad = next((i for i, n in enumerate(listed) if not (isinstance(n, tuple) and len(n) == 2)), None)
    if bad is not None:
        raise ValueError(
            "DistributedOptimizer: named_parameters should be a sequence of (name, parameter) tuples, got "
            f"{type(listed[bad]).__name__} at index {bad}; pass model.named_parameters()"
        )
    return listed


def state_items(params: Any, what: str = "broadcast_parameters") -> list[tuple[Any, torch.Tensor]]:
    """`broadcast_parameters`' input as (name, tensor) pairs: a `state_dict()`, `named_parameters()` or a list of
    tensors. A model is refused (iterating a `Sequential` yields its layers, which are no tensors: it would
    broadcast nothing without a word), and so is any value that is not a tensor (Horovod fails on one too)."""
    if isinstance(params, torch.nn.Module):
        raise TypeError(
            f"{what}: expected a model's state_dict() or named_parameters(), got a model ({type(params).__name__}); "
            "pass model.state_dict()"
        )
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, str | bytes | torch.Tensor):
        items = list(params)
        if items and not isinstance(items[0], tuple):
            items = list(enumerate(items))
    else:
        raise ValueError(f"{what}: invalid params of type {type(params).__name__}; pass model.state_dict()")
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                f"{what}: item {i} is {type(item).__name__}, not a (name, tensor) pair; pass model.state_dict()"
            )
        if not isinstance(item[1], torch.Tensor):
            raise TypeError(
                f"{what}: params[{item[0]!r}] is {type(item[1]).__name__}, not a torch.Tensor; pass model.state_dict()"
            )
    return items
