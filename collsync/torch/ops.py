"""Horovod's collective operations over the workers' MPI communicator (mpi4py, CPU tensors).

Same names, signatures and defaults as `horovod.torch` 0.28: `op` defaults to `Average`; a trailing underscore
works in place; `*_async` returns a handle for `synchronize` / `poll`. Reductions run in place on the tensors'
numpy views (no copy for contiguous CPU tensors). float16 tensors are summed pairwise in float32 and rounded back
to float16 after each addition, as Horovod's own float16 MPI operation does, so `Compression.fp16` gives Horovod's
numbers; bfloat16 tensors (numpy has none: MPI moves their raw 16-bit words) are summed the same way, rounded to
nearest-even by torch (not checked against Horovod's bits). What Horovod has and collsync does not (Adasum,
Min/Max/Product, process sets, elastic, GPU tensors) raises `NotImplementedError` naming it.

One module per family: the allreduces here, gathers and broadcasts in `_ops_gather`, what they share (constants,
checks, datatypes, handles) in `_ops_base`; every public name is importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from collsync.torch._ops_base import (
    Adasum,
    Average,
    Compression,
    FP16Compressor,
    Max,
    Min,
    NoneCompressor,
    Product,
    Sum,
    _check,
    _Handle,
    _mpi_type,
    _op,
    _process_set,
    _register,
    _sum_op,
    global_process_set,
    poll,
    scale_,
    synchronize,
    words,
)
from collsync.torch._ops_gather import (
    allgather,
    allgather_async,
    allgather_object,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
)
from collsync.torch._world import state

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "FP16Compressor",
    "Max",
    "Min",
    "NoneCompressor",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "global_process_set",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "join",
    "poll",
    "scale_",
    "synchronize",
]


def _allreduce_start(
    tensor: torch.Tensor,
    output: torch.Tensor,
    op: int,
    prescale: float,
    postscale: float,
    what: str,
    blocking: bool = False,
) -> _Handle:
    """Start (or with `blocking`, run: one MPI_Allreduce, the fastest where the caller waits anyway) the reduction
    of `tensor` into `output`; the handle's `wait()` applies the post-scaling and returns `output`."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    st = state(what)
    comm = st.comm
    blocking = blocking and not st.oversubscribed
    _check(tensor, what)
    if output is not tensor:
        output.copy_(tensor)
    buf = output if output.is_contiguous() else output.contiguous()
    scale_(buf, prescale)
    post = postscale / comm.Get_size() if op == Average else postscale
    message = [words(buf.detach()), _mpi_type(buf.dtype, what)]
    if blocking:
        comm.Allreduce(MPI.IN_PLACE, message, op=_sum_op(buf.dtype))
        request = None
    else:
        request = comm.Iallreduce(MPI.IN_PLACE, message, op=_sum_op(buf.dtype))

    def finish() -> torch.Tensor:
        scale_(buf, post)
        if buf is not output:
            output.copy_(buf)
        return output

    return _Handle(request, finish)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """Start an in-place allreduce; `synchronize(handle)` returns `tensor` holding the result."""
    _process_set(process_set, "allreduce_async_")
    op = _op(op, average, "allreduce_async_")
    return _register(_allreduce_start(tensor, tensor, op, prescale_factor, postscale_factor, "allreduce_async_"))


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """Start an allreduce into a new tensor; `synchronize(handle)` returns it."""
    _process_set(process_set, "allreduce_async")
    op = _op(op, average, "allreduce_async")
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _register(_allreduce_start(tensor, out, op, prescale_factor, postscale_factor, "allreduce_async"))


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """In-place allreduce: `tensor` becomes the Average (default) or Sum over the workers."""
    _process_set(process_set, "allreduce_")
    op = _op(op, average, "allreduce_")
    return _allreduce_start(tensor, tensor, op, prescale_factor, postscale_factor, "allreduce_", True).wait()


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """The Average (default) or Sum of `tensor` over the workers, as a new tensor (autograd passes through:
    the gradient of an allreduce is the allreduce of the gradient, as in Horovod)."""
    _process_set(process_set, "allreduce")
    op = _op(op, average, "allreduce")
    return _AllreduceFn.apply(tensor, op, prescale_factor, postscale_factor, compression)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, pre: float, post: float, compression: Any) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.compression = op, pre, post, compression
        compressed, cctx = compression.compress(tensor.detach())
        out = torch.empty_like(compressed, memory_format=torch.contiguous_format)
        result = _allreduce_start(compressed, out, op, pre, post, "allreduce", True).wait()
        return compression.decompress(result, cctx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out = allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post)
        return out, None, None, None, None


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """Start in-place allreduces of several tensors as one operation; `synchronize` returns the list."""
    _process_set(process_set, "grouped_allreduce_async_")
    op = _op(op, average, "grouped_allreduce_async_")
    handles = [_allreduce_start(t, t, op, prescale_factor, postscale_factor, "grouped_allreduce") for t in tensors]
    return _register(_Handle(None, lambda: [h.wait() for h in handles]))


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """Allreduce several tensors at once; new tensors come back, in order."""
    pairs = [compression.compress(t.detach()) for t in tensors]
    outs = grouped_allreduce_(
        [p[0].clone() for p in pairs], average, name, op, prescale_factor, postscale_factor, process_set
    )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs, strict=True)]
