"""collsync's training-script API, compatible with `horovod.torch`: change `import horovod.torch as hvd` to
`import collsync.torch as hvd` and choose how workers synchronise with one argument.

    import collsync.torch as hvd
    hvd.init()                                   # hvd.init(sync="async") reserves a parameter-server rank
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), sync="backup", backups=1)

Launch as under Horovod: `mpiexec -n 5 python train.py` or `srun --mpi=pmi2 -n 5 python train.py`. The modes:
`bsp` (Horovod's allreduce, on mpi4py or on Horovod itself with `backend="horovod"`), `backup` (k-of-n partial
allreduce), and the parameter-server modes `async`, `ssp`, `psp`, `bfasgd`, `specsync` (shards on MPI one-sided
windows on ranks 0..M-1, which serve inside `init()` and never run the script; SpecSync's scheduler runs in rank 0's
server loop, and `hvd.speculative(step)` re-runs a step a re-sync aborted). See `collsync.torch.optimizer` for each
mode's semantics and `collsync.torch.config` for the options.
"""

from __future__ import annotations

from collsync.torch import elastic
from collsync.torch._build import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from collsync.torch._world import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    role,
    servers,
    shutdown,
    size,
    where,
    world_rank,
)
from collsync.torch.config import SyncConfig, from_config, sync_config
from collsync.torch.ops import (
    Adasum,
    Average,
    Compression,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    global_process_set,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    sparse_allreduce_async,
    synchronize,
)
from collsync.torch.optimizer import DistributedOptimizer
from collsync.torch.partial import partial_allreduce
from collsync.torch.sampler import DistributedSampler
from collsync.torch.speculative import speculative
from collsync.torch.sync_batch_norm import SyncBatchNorm


def _unsupported(name: str) -> object:
    def call(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"collsync.torch.{name}: not supported by collsync (Horovod has it)")

    call.__name__ = name
    return call


start_timeline = _unsupported("start_timeline")
stop_timeline = _unsupported("stop_timeline")

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "DistributedSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "SyncConfig",
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
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "from_config",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "partial_allreduce",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "role",
    "servers",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "speculative",
    "sync_config",
    "synchronize",
    "where",
    "world_rank",
]
