"""Runtime choices as Hydra targets: which transport runs the workers, and how many of them.

`conf/runtime/<name>.yaml` instantiates one of these; `collsync.train` dispatches on `RuntimeSpec.kind`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Environment variables through which launchers announce the world size: MPICH's Hydra and `srun --mpi=pmi2` (PMI),
# Open MPI's mpirun.
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class RuntimeSpec:
    """`kind`: sim | mpi | allreduce | partial; `workers`: simulated workers (sim only); `servers`: server ranks
    (mpi); `depth`: rounds of means a lagging rank may still read (partial)."""

    kind: str
    workers: int = 8
    servers: int = 1
    inject_stragglers: bool = False
    time_scale: float = 0.01
    depth: int = 8
    bucket_mib: float = 4.0

    def __post_init__(self) -> None:
        if self.kind not in ("sim", "mpi", "allreduce", "partial"):
            raise ValueError(f"runtime: kind={self.kind!r} must be one of sim, mpi, allreduce, partial")
        if self.depth < 1:
            raise ValueError(f"runtime: depth={self.depth} must be >= 1")
        if self.bucket_mib < 0:
            raise ValueError(f"runtime: bucket_mib={self.bucket_mib} must be >= 0 (0: no buckets)")
        if self.workers < 1:
            raise ValueError(f"runtime: workers={self.workers} must be >= 1")
        if not self.time_scale > 0:
            raise ValueError(f"runtime: time_scale={self.time_scale} must be > 0")
        if self.servers < 1:
            raise ValueError(f"runtime: servers={self.servers} must be >= 1")


def launched_under_mpi() -> bool:
    """True when a launcher started this process as one of several ranks (read from the environment only)."""
    for var in _SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False


def sim(workers: int = 8) -> RuntimeSpec:
    """The deterministic simulator with `workers` simulated workers."""
    return RuntimeSpec("sim", workers=workers)


def mpi(servers: int = 1, inject_stragglers: bool = False, time_scale: float = 0.01) -> RuntimeSpec:
    """Parameter server on MPI one-sided windows: ranks 0..servers-1 serve, the rest are workers.

    `servers` M >= 2 splits the parameters into M shards balanced by size, shard j served by rank j (each with its
    own update counter; PSP's partial pull, `sync=psp sync.pull_fraction=...`, works across them). Rank 0 writes
    the run folder.

    `inject_stragglers`: each worker also sleeps the compute time and message delay the straggler model draws for
    its batch, times `time_scale` (the simulator's seconds are model seconds; 0.01 turns 1 s into 10 ms); a frozen
    worker stops computing until training ends. The same seeded draws as the simulator's.
    """
    return RuntimeSpec("mpi", servers=servers, inject_stragglers=inject_stragglers, time_scale=time_scale)


def allreduce(bucket_mib: float = 4.0, inject_stragglers: bool = False, time_scale: float = 0.01) -> RuntimeSpec:
    """Serverless full sync over MPI collectives: every rank is a worker (BSP only).

    `bucket_mib`: gradients are averaged in buckets of about this many MiB with `MPI_Iallreduce` while the
    backward pass runs (overlap, as Horovod's tensor fusion and DDP's buckets); 0: one blocking `MPI_Allreduce` of
    the whole gradient after backward (faster where there is no spare core to progress MPI, see benchmarks/).
    """
    return RuntimeSpec("allreduce", inject_stragglers=inject_stragglers, time_scale=time_scale, bucket_mib=bucket_mib)


def partial(depth: int = 8, inject_stragglers: bool = False, time_scale: float = 0.01) -> RuntimeSpec:
    """Serverless backup workers over a k-of-n partial allreduce on MPI windows (`sync=backup` or `sync=bsp`):
    every rank is a worker and holds a replica of the server; each round averages the first N gradients.

    `depth`: a rank up to `depth` rounds behind reads the means it missed; further behind, the others wait for it
    (with `sync.deadline`, for at most that long before the run fails naming it).
    """
    return RuntimeSpec("partial", inject_stragglers=inject_stragglers, time_scale=time_scale, depth=depth)


def auto(workers: int = 8, servers: int = 1, inject_stragglers: bool = False, time_scale: float = 0.01) -> RuntimeSpec:
    """MPI when launched as several ranks (mpiexec, srun), else the simulator with `workers` workers."""
    return mpi(servers, inject_stragglers, time_scale) if launched_under_mpi() else sim(workers)
