"""Horovod's gather and broadcast operations (tensors and picklable objects), `barrier` and `join`, over the
workers' communicator (see `collsync.torch.ops`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from collsync.runtime.mpi_coll import shutdown
from collsync.torch._ops_base import (
    _check,
    _Handle,
    _mpi_type,
    _process_set,
    _register,
    global_process_set,
    synchronize,
    words,
)
from collsync.torch._world import state


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> int:
    """Start an allgather: the workers' tensors concatenated along dimension 0 (sizes there may differ)."""
    _process_set(process_set, "allgather")
    comm = state("allgather").comm
    _check(tensor, "allgather")
    src = tensor.detach().contiguous()
    rows = comm.allgather(src.shape[0] if src.dim() else 1)
    if src.dim() == 0:
        src = src.reshape(1)
    inner = int(np.prod(src.shape[1:])) if src.dim() > 1 else 1
    out = torch.empty((sum(rows), *src.shape[1:]), dtype=src.dtype)
    counts = [r * inner for r in rows]
    mpi_t = _mpi_type(src.dtype, "allgather")
    request = comm.Iallgatherv([words(src), mpi_t], [words(out), (counts, None), mpi_t])
    return _register(_Handle(request, lambda: out))


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> int:
    """Start an in-place broadcast of `tensor` from worker `root_rank`."""
    _process_set(process_set, "broadcast")
    comm = state("broadcast").comm
    _check(tensor, "broadcast")
    if not 0 <= root_rank < comm.Get_size():
        raise ValueError(f"broadcast: root_rank={root_rank} must be in 0..{comm.Get_size() - 1}")
    buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
    request = comm.Ibcast([words(buf), _mpi_type(buf.dtype, "broadcast")], root=root_rank)

    def finish() -> torch.Tensor:
        if buf.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(buf)
        return tensor

    return _register(_Handle(request, finish))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> int:
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """`tensor` of worker `root_rank`, as a new tensor on every worker."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Any picklable object of worker `root_rank`, on every worker."""
    _process_set(process_set, "broadcast_object")
    return state("broadcast_object").comm.bcast(obj, root=root_rank)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every worker's picklable object, in rank order."""
    return state("allgather_object").comm.allgather(obj)


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every worker gets here (an Ibarrier tested with pauses: ranks sharing cores do not spin)."""
    _process_set(process_set, "barrier")
    shutdown(state("barrier").comm)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Broadcast a model's `state_dict()`, or `named_parameters()`, from worker `root_rank`, in place."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list | tuple) or hasattr(params, "__iter__"):
        items = list(params)
        if items and not isinstance(items[0], tuple):
            items = list(enumerate(items))
    else:
        raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}")
    handles = []
    for _, p in items:
        if isinstance(p, torch.Tensor):
            handles.append(broadcast_async_(p, root_rank))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Every worker's optimizer takes worker `root_rank`'s state and hyperparameters."""
    state_dict = broadcast_object(optimizer.state_dict(), root_rank)
    optimizer.load_state_dict(state_dict)


def join(device: int = -1) -> int:
    """Horovod's join: this worker has no more batches. See `DistributedOptimizer.join` for what each mode does;
    with no collsync optimizer it is a barrier. Returns the rank that joined last."""
    st = state("join")
    if st.joiner is not None:
        return st.joiner()
    barrier()
    return int(st.comm.allreduce(st.comm.Get_rank(), op=_max()))


def _max() -> Any:
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    return MPI.MAX
