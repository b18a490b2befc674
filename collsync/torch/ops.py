"""Horovod's collective operations over the workers' MPI communicator (mpi4py, CPU tensors).

Same names, signatures and defaults as `horovod.torch` 0.28: `op` defaults to `Average` (also `Sum`, `Min`, `Max`,
`Product`); a trailing underscore works in place; `*_async` returns a handle for `synchronize` / `poll`; every
operation takes `process_set=` (`collsync.torch.add_process_set`; an MPI communicator per set). Reductions run in
place on the tensors' numpy views (no copy for contiguous CPU tensors). float16 tensors are combined pairwise in
float32 and rounded back to float16 after each step, as Horovod's own float16 MPI operations do, so
`Compression.fp16` gives Horovod's numbers; bfloat16 tensors (numpy has none: MPI moves their raw 16-bit words)
are combined the same way, rounded to nearest-even by torch (not checked against Horovod's bits). Autograd passes
through `allreduce`, `grouped_allreduce`, `allgather`, `grouped_allgather`, `broadcast`, `alltoall` and the
reducescatters with the gradients Horovod defines. What Horovod has and collsync does not (Adasum, GPU
tensors) raises `NotImplementedError` naming it.

One module per family: the allreduces here, gathers and broadcasts in `_ops_gather`, alltoall and reducescatter
in `_ops_scatter`, process sets in `_process_sets`, what they share (constants, exceptions, checks, datatypes,
handles) in `_ops_base`; every public name is importable from here.
"""

from __future__ import annotations

from collsync.torch._ops_base import (
    Adasum,
    Average,
    Compression,
    FP16Compressor,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    NoneCompressor,
    Product,
    Sum,
    poll,
    scale_,
    synchronize,
)
from collsync.torch._ops_base import (
    _op as _op,  # DistributedOptimizer checks its op through it
)
from collsync.torch._ops_base import (
    _process_set as _process_set,  # DistributedOptimizer refuses process sets through it
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
    grouped_allgather,
    grouped_allgather_async,
    join,
    sparse_allreduce_async,
)
from collsync.torch._ops_reduce import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from collsync.torch._ops_scatter import (
    alltoall,
    alltoall_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from collsync.torch._process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "FP16Compressor",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "NoneCompressor",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "alltoall",
    "alltoall_async",
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
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "scale_",
    "sparse_allreduce_async",
    "synchronize",
]
