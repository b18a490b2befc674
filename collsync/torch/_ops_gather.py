"""Horovod's gather and broadcast operations (tensors and picklable objects), `barrier` and `join`, over the
workers' communicator (see `collsync.torch.ops`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from collsync.runtime.mpi_coll import shutdown
from collsync.torch import _inputs, _stall
from collsync.torch._names import after, in_one_round, join_collectives, progress
from collsync.torch._ops_base import (
    ALLGATHER,
    BROADCAST,
    Average,
    _Agreement,
    _check,
    _comm,
    _Handle,
    _mpi_type,
    _register,
    _Requests,
    _unnamed,
    barrier_comm,
    global_process_set,
    synchronize,
    words,
)
from collsync.torch._ops_reduce import allreduce, grouped_allreduce
from collsync.torch._process_sets import set_comm, set_root
from collsync.torch._world import state


def _gather_start(tensors: list[torch.Tensor], process_set: Any, what: str, name: str | None = None) -> _Handle:
    """Start the allgathers of `tensors` (one Iallgatherv each) after one agreement on their dtypes and shapes
    (all but the first dimension must agree, as Horovod checks), posted without waiting for the other workers
    (`_AfterAgreement`); once it has arrived, the workers' first dimensions are gathered (in step on every worker:
    operations start in their calling order) and the data moves. The handle's `wait()` returns the outputs."""
    comm, _ = set_comm(process_set, what)  # no `_flush`: this data starts after the data called before it
    for t in tensors:
        _check(t, what)
    srcs = [t.detach().contiguous() for t in tensors]
    srcs = [s.reshape(1) if s.dim() == 0 else s for s in srcs]
    outs: list[torch.Tensor] = []

    def start(comm: Any, rows: Any = None) -> Any:
        # A named allgather's first dimensions came with its round (`_names`); else they are gathered here.
        rows = comm.allgather(tuple(s.shape[0] for s in srcs)) if rows is None else rows
        requests = []
        for i, src in enumerate(srcs):
            counts = [r[i] for r in rows]
            inner = int(np.prod(src.shape[1:])) if src.dim() > 1 else 1
            out = torch.empty((sum(counts), *src.shape[1:]), dtype=src.dtype)
            mpi_t = _mpi_type(src.dtype, what)
            sizes = [c * inner for c in counts]
            requests.append(comm.Iallgatherv([words(src), mpi_t], [words(out), (sizes, None), mpi_t]))
            outs.append(out)
        return _Requests(requests)

    if comm.Get_size() == 1:
        return _Handle(start(comm), lambda: outs)
    # Refused while a worker has joined, as in Horovod (the header carries the join).
    agreement = _Agreement(comm, [s[:0] for s in srcs], Average, 1.0, 1.0, what, kind=ALLGATHER, name=name)
    return _Handle(after(agreement, start, tuple(s.shape[0] for s in srcs)), lambda: outs)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> int:
    """Start an allgather: the workers' tensors concatenated along dimension 0 (sizes there may differ)."""
    return _gather_async([tensor], name, process_set, "allgather_async", single=True)


def _gather_async(tensors: list[torch.Tensor], name: str | None, process_set: Any, what: str, single: bool) -> int:
    """`allgather_async` (`single`: its handle returns the one output) or `grouped_allgather_async`, under the
    name of the call the user made (`what`: the stall check and the errors say it)."""
    _unnamed(name, what)
    handle = _gather_start(tensors, process_set, what, name)
    if single:
        finish = handle.finish
        handle.finish = lambda: finish()[0]
    return _register(handle, name, what)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    """The workers' tensors concatenated along dimension 0, in rank order (autograd passes through, as in Horovod's
    `HorovodAllgather`: the gradient is the average of the output's gradients over the workers, sliced to this
    worker's rows)."""
    _check(tensor, "allgather")  # before autograd's Function, which would fail on tensor.dim()
    return _AllgatherFn.apply(process_set, name, "allgather", tensor)[0]


def grouped_allgather_async(
    tensors: list[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> int:
    """Start allgathers of several tensors as one operation; `synchronize` returns the list of outputs."""
    tensors = _inputs.tensors(tensors, "grouped_allgather_async")
    return _gather_async(tensors, name, process_set, "grouped_allgather_async", single=False)


def grouped_allgather(
    tensors: list[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> list[torch.Tensor]:
    """`allgather` of each tensor, as one operation (Horovod's `grouped_allgather`, autograd included)."""
    tensors = _inputs.tensors(tensors, "grouped_allgather")
    return list(_AllgatherFn.apply(process_set, name, "grouped_allgather", *tensors))


class _AllgatherFn(torch.autograd.Function):
    """Horovod's `HorovodAllgather` / `HorovodGroupedAllgather`: the gradient of each input is the average over
    the workers of its output's gradient, narrowed to this worker's rows (an average, as Horovod has it)."""

    @staticmethod
    def forward(ctx: Any, process_set: Any, name: str | None, what: str, *tensors: torch.Tensor) -> Any:
        ctx.process_set = process_set
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        # The call the user made (`what`): allgather's single tensor is Horovod's `allgather.<name>`, not a group.
        return tuple(synchronize(_gather_async(list(tensors), name, process_set, what, single=False)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        comm, _ = _comm(ctx.process_set, "allgather")
        rows = comm.allgather(ctx.rows)
        me = comm.Get_rank()
        out = []
        for i, g in enumerate(reduced):
            offset = sum(r[i] for r in rows[:me])
            out.append(g.narrow(0, offset, ctx.rows[i]))
        return (None, None, None, *out)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> int:
    """Start an in-place broadcast of `tensor` from worker `root_rank` (a worker rank, in process sets too, as in
    Horovod), after one agreement on dtype, shape, root and name (`_Agreement`, posted without waiting for the
    other workers: a disagreement raises HorovodInternalError from `synchronize`)."""
    _unnamed(name, "broadcast_async_")
    comm, ranks = set_comm(process_set, "broadcast")  # no `_flush`: queued after the operations called before
    _check(tensor, "broadcast")
    root = set_root(root_rank, ranks, comm.Get_size(), "broadcast")
    buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()

    def start(comm: Any) -> Any:
        return comm.Ibcast([words(buf), _mpi_type(buf.dtype, "broadcast")], root=root)

    def finish() -> torch.Tensor:
        if buf.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(buf)
        return tensor

    if comm.Get_size() == 1:
        return _register(_Handle(start(comm), finish), name, "broadcast")
    agreement = _Agreement(comm, [tensor], Average, 1.0, 1.0, "broadcast", kind=BROADCAST, root=root_rank, name=name)
    return _register(_Handle(after(agreement, start), finish), name, "broadcast")


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> int:
    _check(tensor, "broadcast_async")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """`tensor` of worker `root_rank`, as a new tensor on every worker (autograd passes through, as in Horovod's
    `HorovodBroadcast`: the root's gradient is the average of the workers' gradients, the others' zero)."""
    _check(tensor, "broadcast")  # before autograd's Function, which would fail on tensor.detach()
    return _BroadcastFn.apply(tensor, root_rank, process_set, name)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, process_set: Any, name: str | None) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if state("broadcast").comm.Get_rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Any picklable object of worker `root_rank`, on every worker of the process set."""
    comm, ranks = _comm(process_set, "broadcast_object")
    return comm.bcast(obj, root=set_root(root_rank, ranks, comm.Get_size(), "broadcast_object"))


def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Every worker's picklable object, in rank order."""
    comm, _ = _comm(process_set, "allgather_object")
    return comm.allgather(obj)


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every worker of the process set gets here (an Ibarrier tested with pauses: ranks sharing cores
    do not spin). The operations in flight are not waited for, as in Horovod: the barrier runs on a communicator
    of its own (`barrier_comm`), and while it waits it starts those whose agreement has arrived (`progress`), so
    a worker may start a named operation, enter the barrier, and meet the others' same operation after it."""
    comm, _ = set_comm(process_set, "barrier")

    def meanwhile() -> None:
        progress(comm)
        _stall.STALL.tick()  # answers the other workers' stall questions meanwhile

    shutdown(barrier_comm(comm), while_waiting=meanwhile)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Broadcast a model's `state_dict()`, or `named_parameters()`, from worker `root_rank`, in place.

    Each tensor is broadcast under its name, as Horovod names it (its key; bare tensors go unnamed), so the
    broadcasts meet by name (`_names`): a worker that lists its parameters in another order still gets each from
    the root's tensor of the same name, and one whose names or shapes differ is told which."""
    items = _inputs.state_items(params)
    comm, _ = set_comm(global_process_set, "broadcast_parameters")
    handles = []
    with in_one_round(comm) if comm.Get_size() > 1 else nullcontext():
        for key, p in items:
            handles.append(broadcast_async_(p, root_rank, key if isinstance(key, str) else None))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Every worker's optimizer takes worker `root_rank`'s state and hyperparameters.

    As Horovod does, an optimizer with no state yet first steps once on zero gradients (sparse ones for SparseAdam
    and for SGD on a sparse embedding of `model`), so that its state exists on every worker with the root's shapes;
    the parameters that require a gradient are left with zero gradients. LBFGS is refused, as in Horovod. In
    collsync's parameter-server modes the optimizer's own state is not used, and that step is not taken."""
    _inputs.optimizer(optimizer, "broadcast_optimizer_state")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"] and not _served(optimizer):
        sparse: set[int] = set()
        if model is not None:
            for m in model.modules():
                if isinstance(m, torch.nn.Embedding) and m.sparse:
                    sparse.update(id(p) for p in m.parameters())
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p.data)
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse
                    ):
                        p.grad = p.grad.to_sparse()
        _local_step(optimizer)
    _broadcast_state(optimizer, root_rank)


def _broadcast_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """The root's optimizer state, as Horovod moves it: each state tensor broadcast in place under its name
    ('<state key>.<occurrence>', e.g. 'exp_avg.3', the same on every worker for the same optimizer), the other
    values (a step count, each group's options) in one object. A state tensor of `state_dict()` is the optimizer's
    own (the per-parameter dicts are shared), so the in-place broadcast is the load."""
    state_dict = optimizer.state_dict()
    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    assign: dict[str, Callable[[Any], None]] = {}
    occurrences: dict[str, int] = {}
    for index, group in enumerate(state_dict["param_groups"]):
        for option, value in group.items():
            if option != "params":
                key = f"{option}.{index}"
                scalars[key] = value
                assign[key] = _setter(optimizer.param_groups[index], option)
        for pid in group["params"]:
            for state_key, value in state_dict["state"].get(pid, {}).items():
                occurrences[str(state_key)] = occurrences.get(str(state_key), 0) + 1
                key = f"{state_key}.{occurrences[str(state_key)]}"
                if isinstance(value, torch.Tensor):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    assign[key] = _setter(state_dict["state"][pid], state_key)
    broadcast_parameters(tensors, root_rank)
    for key, value in broadcast_object(scalars, root_rank).items():
        if key not in assign:
            raise ValueError(
                f"broadcast_optimizer_state: worker {root_rank}'s optimizer has {key!r}, this worker's has not; "
                "build the same optimizer class with the same parameter groups on every worker"
            )
        assign[key](value)


def _setter(holder: dict[Any, Any], key: Any) -> Callable[[Any], None]:
    def put(value: Any) -> None:
        holder[key] = value

    return put


def _served(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a collsync optimizer runs a parameter-server mode (its own state unused)."""
    from collsync.torch._server_mode import ServerMode  # lazily: the optimizer's modules import this one

    return isinstance(getattr(optimizer, "_collsync", None), ServerMode)


def _local_step(optimizer: torch.optim.Optimizer) -> None:
    """The user's optimizer's own step, without the gradient synchronisation of a collsync optimizer (Horovod
    calls the wrapped class's step the same way)."""
    local = getattr(optimizer, "_local_step", None)  # a DistributedOptimizer's own class's step
    if callable(local):
        local()
    else:
        optimizer.step()


def join(device: int = -1) -> int:
    """Horovod's join: this worker has no more batches. With a collsync optimizer, see `DistributedOptimizer.join`
    for what each mode does; without one, this worker contributes zeros to the other workers' allreduces until
    every worker has joined, and their allgathers and broadcasts meanwhile raise HorovodInternalError, as in
    Horovod (`_names.join_collectives`). Returns the rank that joined last, the same on every worker."""
    st = state("join")
    optimizer = None if st.joiner is None else st.joiner()
    if optimizer is not None:
        return int(optimizer.join())
    if st.comm.Get_size() == 1:
        return 0
    return join_collectives(st.comm)


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None = None, op: int = Average, process_set: Any = global_process_set
) -> Callable[[], torch.Tensor]:
    """Horovod's `sparse_allreduce_async`: a sparse tensor's indices and values allgathered over the set (the sum
    of the workers' sparse tensors, uncoalesced; divided by the set's size for Average). Returns a function that
    waits and returns the result, as Horovod's does."""
    comm, _ = _comm(process_set, "sparse_allreduce_async")
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), process_set=process_set)
    values = allgather_async(tensor._values(), process_set=process_set)
    size = comm.Get_size()

    def wait() -> torch.Tensor:
        vals = synchronize(values)
        idx = synchronize(indices)
        if op == Average:
            vals = vals / size
        if idx.dim() == 0 or vals.dim() == 0:
            return tensor.new().resize_as_(tensor)
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, tensor.size(), check_invariants=True)

    return wait
