"""What `collsync.torch.ops`'s collectives share: Horovod's op and compression constants, its exceptions, the
argument checks, the agreement check of the metadata of a collective, MPI datatypes and operations (16-bit floats
moved as 16-bit words and combined in float32, as Horovod does), scaling, and the handles that `*_async` returns
(`synchronize`, `poll`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from collsync.torch._process_sets import global_process_set

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's `HorovodInternalError`): here, the workers disagreed on a collective's
    dtype, shape or root. `hvd.elastic.run` restores the last commit on it and calls the function again, as
    Horovod's elastic mode does; elsewhere it is an error."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """Horovod's elastic-mode interrupt (the set of hosts changed). collsync has no host discovery and never raises
    it; a script may, and `hvd.elastic.run` then resets as Horovod's does."""

    def __init__(self, skip_sync: bool) -> None:
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


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
    """Horovod's reduction: `op` (Average when None) or the deprecated `average=`; Adasum is refused."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{what}: give op= or the deprecated average=, not both")
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise NotImplementedError(f"{what}: op=Adasum is not supported by collsync (Average, Sum, Min, Max, Product)")
    if op not in _OP_NAMES:
        raise ValueError(f"{what}: op={op!r} must be collsync.torch.Average, Sum, Min, Max or Product")
    return op


def _process_set(process_set: Any, what: str) -> None:
    """Refuse a process set other than the global one, where an operation does not take one."""
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(f"{what}: process sets are not supported here (process_set={process_set!r})")


def _agree(comm: Any, meta: tuple[Any, ...], what: str, vary: tuple[int, ...] = ()) -> list[tuple[Any, ...]]:
    """Every worker's `meta` (dtype, shape, root...) of one collective, gathered in rank order; HorovodInternalError
    on every worker if they differ in a field not listed in `vary` (Horovod's coordinator checks the same before it
    runs a collective; a mismatch reaching MPI would hang or corrupt memory)."""
    metas: list[tuple[Any, ...]] = comm.allgather(meta)
    for field in range(len(meta)):
        values = [m[field] for m in metas]
        if field not in vary and any(v != values[0] for v in values):
            raise HorovodInternalError(f"{what}: the workers disagree: {values} (by rank)")
    return metas


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


_COMBINE: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    Min: torch.minimum,
    Max: torch.maximum,
    Product: torch.mul,
}


def _half_fn(dtype: torch.dtype, op: int) -> Callable[[Any, Any, Any], None]:
    """A user operation for a 16-bit float type: each combination in float32, rounded back (nearest-even)."""
    combine = _COMBINE[op]

    def fn(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = torch.frombuffer(inbuf, dtype=dtype)
        b = torch.frombuffer(inoutbuf, dtype=dtype)
        b.copy_(combine(a.to(torch.float32), b.to(torch.float32)))

    return fn


_USER_OPS: dict[tuple[torch.dtype, int], Any] = {}


def _reduce_op(dtype: torch.dtype, op: int) -> Any:
    """The MPI operation for Horovod's `op` (Average and Sum both sum; Min, Max, Product), or for float16 and
    bfloat16 a user operation: each combination in float32, rounded back to the 16-bit type (Horovod's float16
    operations; bfloat16 the same way, to nearest-even)."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    if op in (Average, Sum):
        return _sum_op(dtype)
    if dtype not in HALVES:
        return {Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}[op]
    if (dtype, op) not in _USER_OPS:
        _USER_OPS[(dtype, op)] = MPI.Op.Create(_half_fn(dtype, op), commute=True)
    return _USER_OPS[(dtype, op)]


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


class _Requests:
    """Several MPI requests tested as one (a grouped operation's handle)."""

    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests

    def Test(self) -> bool:  # noqa: N802 - MPI.Request's name, which _Handle calls
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        return bool(MPI.Request.Testall(self.requests))


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
