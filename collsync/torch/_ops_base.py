"""What `collsync.torch.ops`'s collectives share: Horovod's op and compression constants, the argument checks, MPI
datatypes (float16 moved as 16-bit words and summed in float32, as Horovod does), scaling, and the handles that
`*_async` returns (`synchronize`, `poll`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class global_process_set:  # noqa: N801 - Horovod's name
    """Horovod's default process set: every worker. Other process sets are not supported."""


class NoneCompressor:
    """No compression (Horovod's `Compression.none`)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 and come back in their own dtype (Horovod's `Compression.fp16`)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        return (tensor.to(torch.float16) if dtype.is_floating_point else tensor), dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """Horovod's compression choices for gradients on the wire."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _op(op: int | None, average: bool | None, what: str) -> int:
    if average is not None:
        if op is not None:
            raise ValueError(f"{what}: give op= or the deprecated average=, not both")
        return Average if average else Sum
    op = Average if op is None else op
    if op in _OP_NAMES:
        raise NotImplementedError(f"{what}: op={_OP_NAMES[op]} is not supported by collsync (Average and Sum are)")
    if op not in (Average, Sum):
        raise ValueError(f"{what}: op={op!r} must be collsync.torch.Average or Sum")
    return op


def _process_set(process_set: Any, what: str) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(f"{what}: process sets are not supported (process_set={process_set!r})")


def _check(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise NotImplementedError(f"{what}: collsync moves CPU tensors; got one on {tensor.device}")
    if tensor.is_sparse:
        raise NotImplementedError(f"{what}: sparse tensors are not supported (densify them first)")


_MPI_TYPES: dict[torch.dtype, str] = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
    torch.int16: "INT16_T",
    torch.int8: "INT8_T",
    torch.uint8: "UINT8_T",
    torch.float16: "UINT16_T",  # moved as raw 16-bit words, summed by _half_sum
    torch.bfloat16: "UINT16_T",  # likewise, summed by _bfloat16_sum (numpy has no bfloat16)
}
# The 16-bit floating-point types: MPI and numpy see their raw words (`words`), a user operation sums them.
HALVES = (torch.float16, torch.bfloat16)


def words(tensor: torch.Tensor) -> np.ndarray:
    """The numpy view MPI moves: the tensor itself, or a 16-bit float's raw words (no copy either way)."""
    return tensor.view(torch.int16).numpy() if tensor.dtype in HALVES else tensor.numpy()


def _mpi_type(dtype: torch.dtype, what: str) -> Any:
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    name = _MPI_TYPES.get(dtype)
    if name is None:
        raise NotImplementedError(f"{what}: dtype {dtype} is not supported")
    return getattr(MPI, name)


def _half_sum_fn(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    a = np.frombuffer(inbuf, dtype=np.float16)
    b = np.frombuffer(inoutbuf, dtype=np.float16)
    b[:] = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)


def _bfloat16_sum_fn(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    # torch reads the words as bfloat16 and rounds float32 back to nearest-even, as its own .to(bfloat16) does.
    a = torch.frombuffer(inbuf, dtype=torch.bfloat16)
    b = torch.frombuffer(inoutbuf, dtype=torch.bfloat16)
    b.copy_(a.to(torch.float32) + b.to(torch.float32))


_SUMS: dict[torch.dtype, Any] = {}


def _sum_op(dtype: torch.dtype) -> Any:
    """MPI.SUM, or for float16 and bfloat16 a user operation: each addition in float32, rounded back to the 16-bit
    type (Horovod's float16 operation; bfloat16 the same way, to nearest-even)."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    if dtype not in HALVES:
        return MPI.SUM
    if dtype not in _SUMS:
        _SUMS[dtype] = MPI.Op.Create(_half_sum_fn if dtype == torch.float16 else _bfloat16_sum_fn, commute=True)
    return _SUMS[dtype]


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """tensor *= factor, for float16 and bfloat16 computed in float32 and rounded once (Horovod's ScaleBuffer on
    the CPU)."""
    if factor == 1.0:
        return tensor
    if tensor.dtype in HALVES:
        return tensor.copy_((tensor.to(torch.float32) * float(np.float32(factor))).to(tensor.dtype))
    if not tensor.dtype.is_floating_point:
        return tensor.copy_((tensor.to(torch.float64) * factor).to(tensor.dtype))
    return tensor.mul_(factor)


class _Handle:
    """A collective in flight: `wait()` completes it and returns its result."""

    def __init__(self, request: Any, finish: Callable[[], Any]) -> None:
        self.request, self.finish, self.result, self.done = request, finish, None, False

    def test(self) -> bool:
        if not self.done and (self.request is None or self.request.Test()):
            self.result, self.done = self.finish(), True
        return self.done

    def wait(self) -> Any:
        if not self.done:
            if self.request is not None:
                # Test and yield the core, rather than a blocking Wait: a rank that shares its core with another
                # rank hands it over while it waits, yet reacts within one scheduling slice (sleeping pauses cost
                # milliseconds per reduction here).
                while not self.request.Test():
                    os.sched_yield()
            self.result, self.done = self.finish(), True
        return self.result


_HANDLES: dict[int, _Handle] = {}
_IDS = itertools.count(1)


def _register(handle: _Handle) -> int:
    key = next(_IDS)
    _HANDLES[key] = handle
    return key


def _handle(key: int, what: str) -> _Handle:
    if key not in _HANDLES:
        raise ValueError(f"{what}: handle {key!r} is unknown or was synchronized already")
    return _HANDLES[key]


def synchronize(handle: int) -> Any:
    """Wait for an asynchronous operation; returns its output tensor (Horovod's `hvd.synchronize`)."""
    _handle(handle, "synchronize")
    return _HANDLES.pop(handle).wait()


def poll(handle: int) -> bool:
    """True if the asynchronous operation has finished (then `synchronize` returns at once)."""
    return _handle(handle, "poll").test()
