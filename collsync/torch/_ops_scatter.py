"""Horovod's scattering collectives over the workers (or a process set's) communicator: `alltoall` (MPI_Alltoallv)
and `reducescatter` / `grouped_reducescatter` (MPI_Reduce_scatter), each with its `_async` form and the gradient
Horovod defines for it (see `collsync.torch.ops`).

Horovod's coordinator checks that the workers agree on a collective before it runs it; a disagreement raises
`HorovodInternalError` on every worker instead of hanging in MPI. A reducescatter agrees through the agreement
header the allreduces use (`_ops_base._Agreement`: dtypes, shapes, op, scale factors, name), posted without waiting
for the other workers, so `reducescatter_async` returns at once; a named alltoall meets the others' by name
(`_names`: its splits travel in the negotiation round), an unnamed one gathers the workers' dtypes, shapes and
splits in one small allgather first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from collsync.torch import _inputs
from collsync.torch._names import after
from collsync.torch._ops_base import (
    ALLTOALL,
    REDUCESCATTER,
    Adasum,
    Average,
    Compression,
    Sum,
    _agree,
    _Agreement,
    _check,
    _comm,
    _Handle,
    _mpi_type,
    _op,
    _reduce_op,
    _register,
    _Requests,
    _unnamed,
    global_process_set,
    scale_,
    synchronize,
    words,
)
from collsync.torch._ops_gather import grouped_allgather
from collsync.torch._process_sets import set_comm


def _inner(t: torch.Tensor) -> int:
    return int(np.prod(t.shape[1:])) if t.dim() > 1 else 1


def _splits(splits: Any, rows: int, size: int) -> list[int]:
    """Horovod's checks of alltoall's `splits` (ValueError, as Horovod raises): int32, one entry per worker,
    their sum at most the tensor's first dimension; None splits the first dimension evenly."""
    if splits is None:
        if rows % size:
            raise ValueError(
                "splits not provided, but first dimension of tensor is not an even multiple of the number of workers."
            )
        return [rows // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
        if splits.dim() > 1:
            raise ValueError("alltoall expects a 1D splits tensor")
        values = [int(v) for v in splits.tolist()]
    else:
        values = [int(v) for v in splits]
    if len(values) != size:
        raise ValueError("Number of entries in splits does not equal number of workers.")
    if any(v < 0 for v in values) or sum(values) > rows:
        raise ValueError("Sum of splits entries is greater than the first dimension of tensor.")
    return values


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = global_process_set
) -> int:
    """Start an alltoall: rows `splits[i]` (in order along dimension 0) go to worker i of the set, and every
    worker's rows for this one come back concatenated in rank order; `synchronize` returns `(output,
    received_splits)`, the latter an int32 tensor of the rows received from each worker (Horovod's answer)."""
    return _alltoall_async(tensor, splits, name, process_set, "alltoall_async")


def _alltoall_async(tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any, what: str) -> int:
    """`alltoall_async` under the name of the call the user made (`what`). The workers must agree on the dtype
    and on every dimension but the first, as Horovod's coordinator checks; each worker's splits say what it sends.
    A named alltoall meets the others' by name (`_names`: its first dimension and splits travel in the round, and
    a mismatch raises HorovodInternalError on every worker naming what each sent); an unnamed one gathers the
    same facts in one small allgather, in calling order."""
    _unnamed(name, what)
    comm, _ = set_comm(process_set, what) if name is not None else _comm(process_set, what)
    _check(tensor, what)
    if tensor.dim() == 0:
        raise ValueError(f"{what}: the tensor must have at least one dimension")
    size, me = comm.Get_size(), comm.Get_rank()
    sends = _splits(splits, tensor.shape[0], size)
    src = tensor.detach().contiguous()
    inner, done = _inner(src), []

    def start(comm: Any, rows: list[tuple[int, ...]]) -> Any:
        # rows: every worker's first dimension, then its splits (what it sends to each worker).
        received = [r[1 + me] for r in rows]
        out = torch.empty((sum(received), *src.shape[1:]), dtype=src.dtype)
        scounts = [s * inner for s in sends]
        rcounts = [r * inner for r in received]
        mpi_t = _mpi_type(src.dtype, what)
        done.append((out, torch.tensor(received, dtype=torch.int32)))
        return comm.Ialltoallv(
            [words(src), (scounts, _offsets(scounts)), mpi_t], [words(out), (rcounts, _offsets(rcounts)), mpi_t]
        )

    rows = (src.shape[0], *sends)
    if name is None or size == 1:
        if size == 1:
            metas = [rows]
        else:
            agreed = _agree(comm, (str(tensor.dtype), tuple(tensor.shape[1:]), sends), what, vary=(2,))
            metas = [(0, *m[2]) for m in agreed]
        return _register(_Handle(start(comm, metas), lambda: done[0]))
    agreement = _Agreement(comm, [src[:0]], Average, 1.0, 1.0, what, kind=ALLTOALL, name=name)
    return _register(_Handle(after(agreement, start, rows), lambda: done[0]), name, what)


def _offsets(counts: list[int]) -> list[int]:
    return [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])] if counts else []


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Horovod's `alltoall`: the rows this worker receives, concatenated in rank order; with `splits` given,
    `(output, received_splits)`. Autograd passes through (Horovod's `HorovodAlltoall`): the gradient goes back by
    the alltoall the other way, with the received splits as its splits."""
    return _AlltoallFn.apply(tensor, splits, process_set, name)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, process_set: Any, name: str | None) -> Any:
        out, received = synchronize(_alltoall_async(tensor, splits, name, process_set, "alltoall"))
        ctx.process_set, ctx.received, ctx.rows = process_set, received, tensor.shape[0]
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, ...]:
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.process_set)
        if back.shape[0] < ctx.rows:  # rows past sum(splits) were not sent: their gradient is zero
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0], *back.shape[1:]))])
        return back, None, None, None


def _scatter_rows(rows: int, size: int) -> list[int]:
    """Horovod's split of dimension 0 for reducescatter: rows // size each, one more for the first rows % size."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def _reducescatter_start(
    tensors: list[torch.Tensor], op: int, process_set: Any, pre: float, post: float, what: str, name: str | None = None
) -> _Handle:
    """Start the reducescatters of `tensors` (one Ireduce_scatter each) after one agreement on their dtypes,
    shapes, op and scale factors, posted without waiting for the other workers (`_AfterAgreement`)."""
    if op == Adasum:
        raise NotImplementedError(f"{what}: op=Adasum is not supported (Horovod's reducescatter refuses it too)")
    if op not in (Average, Sum):
        raise NotImplementedError(f"{what}: Horovod's reducescatter supports only Average and Sum")
    comm, _ = set_comm(process_set, what)  # no `_flush`: queued after the operations called before
    for t in tensors:
        _check(t, what)
        if t.dim() == 0:
            raise ValueError(f"{what}: a scalar cannot be scattered (the tensor needs a first dimension)")
    size, me = comm.Get_size(), comm.Get_rank()
    scaled = post / size if op == Average else post
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []  # each input's copy is kept until its request completes

    def start(comm: Any) -> Any:
        requests = []
        for t in tensors:
            buf = t.detach().clone(memory_format=torch.contiguous_format)
            scale_(buf, pre)
            rows = _scatter_rows(t.shape[0], size)
            out = torch.empty((rows[me], *t.shape[1:]), dtype=t.dtype)
            counts = [r * _inner(buf) for r in rows]
            mpi_t = _mpi_type(buf.dtype, what)
            op_mpi = _reduce_op(buf.dtype, op)
            requests.append(comm.Ireduce_scatter([words(buf), mpi_t], [words(out), mpi_t], counts, op=op_mpi))
            outs.append((buf, out))
        return _Requests(requests)

    def finish() -> list[torch.Tensor]:
        return [scale_(out, scaled) for _, out in outs]

    if size == 1:
        return _Handle(start(comm), finish)
    agreement = _Agreement(comm, tensors, op, pre, post, what, kind=REDUCESCATTER, name=name)
    return _Handle(after(agreement, start), finish)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start a reducescatter; `synchronize` returns this worker's part of the Average (or Sum) over the set."""
    op = _op(op, None, "reducescatter")
    _unnamed(name, "reducescatter_async")
    handle = _reducescatter_start([tensor], op, process_set, prescale_factor, postscale_factor, "reducescatter", name)
    finish = handle.finish
    handle.finish = lambda: finish()[0]
    return _register(handle, name, "reducescatter")


def grouped_reducescatter_async(
    tensors: list[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducescatters of several tensors as one operation; `synchronize` returns the list of parts."""
    op = _op(op, None, "grouped_reducescatter")
    what = "grouped_reducescatter"
    tensors = _inputs.tensors(tensors, what)
    _unnamed(name, what)
    handle = _reducescatter_start(tensors, op, process_set, prescale_factor, postscale_factor, what, name)
    return _register(handle, name, what)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Horovod's `reducescatter`: the Average (default) or Sum of `tensor` over the set's workers, split along
    dimension 0 (the first `rows % size` workers get one row more), this worker's part. The tensors must agree in
    dtype and shape. Autograd passes through with Horovod's gradient (`HorovodReducescatter`): the allgather of the
    output gradients, times the set's size for Sum, times both scale factors."""
    wire, cctx = compression.compress(tensor)
    out = _ReducescatterFn.apply(op, process_set, prescale_factor, postscale_factor, name, "reducescatter", wire)[0]
    return compression.decompress(out, cctx)


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """`reducescatter` of each tensor, as one operation (Horovod's `grouped_reducescatter`, autograd included)."""
    tensors = _inputs.tensors(tensors, "grouped_reducescatter")
    pairs = [compression.compress(t) for t in tensors]
    wires = [p[0] for p in pairs]
    outs = _ReducescatterFn.apply(
        op, process_set, prescale_factor, postscale_factor, name, "grouped_reducescatter", *wires
    )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs, strict=True)]


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        op: int,
        process_set: Any,
        pre: float,
        post: float,
        name: str | None,
        what: str,
        *tensors: torch.Tensor,
    ) -> Any:
        op = _op(op, None, what)
        ctx.op, ctx.process_set, ctx.pre, ctx.post = op, process_set, pre, post
        _unnamed(name, what)
        handle = _reducescatter_start(list(tensors), op, process_set, pre, post, what, name)
        return tuple(handle.wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        factor = ctx.pre * ctx.post
        if ctx.op == Sum:
            comm, _ = _comm(ctx.process_set, "reducescatter")
            factor *= comm.Get_size()
        scaled = [g * factor if factor != 1.0 else g for g in grads]
        return (None, None, None, None, None, None, *grouped_allgather(scaled, process_set=ctx.process_set))
