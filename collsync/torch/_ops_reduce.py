"""Horovod's allreduce family over the workers' MPI communicator (or a process set's): `allreduce` and
`grouped_allreduce`, in place (`_`), asynchronous (`_async`) and with autograd (the gradient of an allreduce is the
allreduce of the gradient, as in Horovod). Below the gathers and scatters, whose gradients are allreduces;
`collsync.torch.ops` is where every public name is imported from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from collsync.torch import _inputs
from collsync.torch._names import after
from collsync.torch._ops_base import (
    Average,
    Compression,
    _Agreement,
    _check,
    _flush,
    _Handle,
    _mpi_type,
    _op,
    _reduce_op,
    _register,
    _Requests,
    _unnamed,
    scale_,
    synchronize,
    words,
)
from collsync.torch._process_sets import global_process_set, set_comm
from collsync.torch._world import state


def _allreduce_start(
    tensor: torch.Tensor,
    output: torch.Tensor,
    op: int,
    prescale: float,
    postscale: float,
    what: str,
    blocking: bool = False,
    process_set: Any = global_process_set,
    check: bool = True,
    name: str | None = None,
) -> _Handle:
    """Start (or with `blocking`, run: one MPI_Allreduce, the fastest where the caller waits anyway) the reduction
    of `tensor` into `output` over the process set's workers; the handle's `wait()` applies the post-scaling (for
    Average, 1/size of the set) and returns `output`. With `check`, the workers first agree that they reduce the
    same type and shape with the same op and scale factors (`_Agreement`; HorovodInternalError on every worker if
    not, with `output` untouched); a `name` is checked too."""
    handle = _allreduce_many([tensor], [output], op, prescale, postscale, what, blocking, process_set, check, name)
    finish = handle.finish
    handle.finish = lambda: finish()[0]
    return handle


def _allreduce_many(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    op: int,
    prescale: float,
    postscale: float,
    what: str,
    blocking: bool = False,
    process_set: Any = global_process_set,
    check: bool = True,
    name: str | None = None,
) -> _Handle:
    """`_allreduce_start` of several tensors as one operation (one agreement for the group, then one MPI
    allreduce per tensor); the handle's `wait()` returns the outputs."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    st = state(what)
    comm, _ = set_comm(process_set, what)
    blocking = blocking and not st.oversubscribed and name is None  # a named one waits for its name (`_names`)
    for tensor in tensors:
        _check(tensor, what)
    post = postscale / comm.Get_size() if op == Average else postscale
    bufs: list[torch.Tensor] = []

    def start(comm: Any) -> Any:
        requests = []
        for tensor, output in zip(tensors, outputs, strict=True):
            if output is not tensor:
                output.copy_(tensor)
            buf = output if output.is_contiguous() else output.contiguous()
            scale_(buf, prescale)
            message = [words(buf.detach()), _mpi_type(buf.dtype, what)]
            if blocking:
                comm.Allreduce(MPI.IN_PLACE, message, op=_reduce_op(buf.dtype, op))
            else:
                requests.append(comm.Iallreduce(MPI.IN_PLACE, message, op=_reduce_op(buf.dtype, op)))
            bufs.append(buf)
        if not requests:
            return None
        return requests[0] if len(requests) == 1 else _Requests(requests)

    def finish() -> list[torch.Tensor]:
        for buf, output in zip(bufs, outputs, strict=True):
            scale_(buf, post)
            if buf is not output:
                output.copy_(buf)
        return list(outputs)

    if not check or comm.Get_size() == 1:
        _flush(comm)
        return _Handle(start(comm), finish)
    agreement = _Agreement(comm, tensors, op, prescale, postscale, what, blocking=blocking, name=name)
    if blocking:
        _flush(comm)
        agreement.now()
        return _Handle(start(comm), finish)
    return _Handle(after(agreement, start), finish)


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
    op = _op(op, average, "allreduce_async_")
    _unnamed(name, "allreduce_async_")
    return _register(
        _allreduce_start(
            tensor, tensor, op, prescale_factor, postscale_factor, "allreduce_async_", False, process_set, name=name
        ),
        name,
        "allreduce_async_",
    )


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
    op = _op(op, average, "allreduce_async")
    _unnamed(name, "allreduce_async")
    _check(tensor, "allreduce_async")
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _register(
        _allreduce_start(
            tensor, out, op, prescale_factor, postscale_factor, "allreduce_async", False, process_set, name=name
        ),
        name,
        "allreduce_async",
    )


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
    op = _op(op, average, "allreduce_")
    _unnamed(name, "allreduce_")
    handle = _allreduce_start(
        tensor, tensor, op, prescale_factor, postscale_factor, "allreduce_", True, process_set, name=name
    )
    return handle.wait()


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
    op = _op(op, average, "allreduce")
    _check(tensor, "allreduce")  # before autograd's Function, which would fail on tensor.detach()
    _inputs.compression(compression, "allreduce")
    _unnamed(name, "allreduce")
    return _AllreduceFn.apply(tensor, op, prescale_factor, postscale_factor, compression, process_set, name)


class _AllreduceFn(torch.autograd.Function):
    """Horovod's `HorovodAllreduce`: the gradient of an allreduce is the same allreduce of the gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: int,
        pre: float,
        post: float,
        compression: Any,
        process_set: Any,
        name: str | None = None,
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        compressed, cctx = compression.compress(tensor.detach())
        out = torch.empty_like(compressed, memory_format=torch.contiguous_format)
        result = _allreduce_start(compressed, out, op, pre, post, "allreduce", True, process_set, name=name).wait()
        return compression.decompress(result, cctx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out = allreduce(
            grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post, process_set=ctx.process_set
        )
        return out, None, None, None, None, None, None


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
    op = _op(op, average, "grouped_allreduce_async_")
    _unnamed(name, "grouped_allreduce_async_")
    tensors = _inputs.tensors(tensors, "grouped_allreduce_async_")
    return _register(
        _allreduce_many(
            tensors, tensors, op, prescale_factor, postscale_factor, "grouped_allreduce", False, process_set, name=name
        ),
        name,
        "grouped_allreduce",
    )


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    tensors = _inputs.tensors(tensors, "grouped_allreduce_async")
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
    tensors = _inputs.tensors(tensors, "grouped_allreduce_")
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
    """Allreduce several tensors at once; new tensors come back, in order (autograd passes through, as for
    `allreduce`: Horovod's `HorovodGroupedAllreduce`)."""
    op = _op(op, average, "grouped_allreduce")
    tensors = _inputs.tensors(tensors, "grouped_allreduce")
    _inputs.compression(compression, "grouped_allreduce")
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduceFn.apply(op, prescale_factor, postscale_factor, process_set, name, *[p[0] for p in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs, strict=True)]


class _GroupedAllreduceFn(torch.autograd.Function):
    """Horovod's `HorovodGroupedAllreduce`: the gradients are allreduced the same way, as one group."""

    @staticmethod
    def forward(
        ctx: Any, op: int, pre: float, post: float, process_set: Any, name: str | None, *tensors: torch.Tensor
    ) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        return tuple(grouped_allreduce_(copies, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce(
            list(grads), op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post, process_set=ctx.process_set
        )
        return (None, None, None, None, None, *reduced)
