"""Runtime choices as Hydra targets: which transport runs the workers, and how many of them.

`conf/runtime/<name>.yaml` instantiates one of these; `collsync.train` dispatches on `RuntimeSpec.kind`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from collsync.margin import check_margin
from collsync.runtime.placement import DEFAULT as PLACEMENT
from collsync.runtime.placement import check_placement

# The launchers' environment variables, listed here only (`collsync.cli` and `mpi_world.launcher_size` read them too).
# The world size: MPICH's Hydra and `srun --mpi=pmi2` (PMI), Open MPI's mpirun.
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
# Set by a launcher that joins its processes into one MPI world: PMI (MPICH's Hydra, `srun --mpi=pmi2`), PMIx
# (`srun --mpi=pmix`, Open MPI's launcher), Open MPI's mpirun.
WORLD_VARS = ("PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")
# A process's rank as each launcher announces it (Slurm's task id last: it holds under every MPI plugin).
RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
# How long a rank other than 0 waits, when the launch does not fit, for rank 0 to print the error and abort the
# world (`collsync.cli._fail` aborts after `mpi_world.ABORT_GRACE_S`), before it exits by itself.
_AWAIT_ABORT_S = 10.0


@dataclass(frozen=True)
class RuntimeSpec:
    """`kind`: sim | mpi | allreduce | partial; `workers`: simulated workers (sim only); `servers`: server ranks
    (mpi), `placement`: which ranks they are (see `mpi`); `depth`, `margin`, `catch_up`, `protocol`: serverless
    backup's (partial; see `partial`)."""

    kind: str
    workers: int = 8
    servers: int = 1
    inject_stragglers: bool = False
    time_scale: float = 0.01
    depth: int = 8
    bucket_mib: float = 4.0
    margin: float | str | None = "auto"
    catch_up: bool | None = None
    protocol: str = "auto"
    placement: str = PLACEMENT

    def __post_init__(self) -> None:
        if self.kind not in ("sim", "mpi", "allreduce", "partial"):
            raise ValueError(f"runtime: kind={self.kind!r} must be one of sim, mpi, allreduce, partial")
        if self.depth < 1:
            raise ValueError(f"runtime: depth={self.depth} must be >= 1")
        check_margin(self.margin)
        if self.catch_up not in (None, True, False):
            raise ValueError(f"runtime: catch_up={self.catch_up!r} must be true, false or null (decide by itself)")
        if self.protocol not in ("auto", "direct", "host"):
            raise ValueError(f"runtime: protocol={self.protocol!r} must be auto, direct or host")
        if self.bucket_mib < 0:
            raise ValueError(f"runtime: bucket_mib={self.bucket_mib} must be >= 0 (0: no buckets)")
        if self.workers < 1:
            raise ValueError(f"runtime: workers={self.workers} must be >= 1")
        if not self.time_scale > 0:
            raise ValueError(f"runtime: time_scale={self.time_scale} must be > 0")
        if self.servers < 1:
            raise ValueError(f"runtime: servers={self.servers} must be >= 1")
        check_placement(self.placement, "runtime: placement")

    def check_launcher(self, env: Mapping[str, str] | None = None) -> None:
        """Stop before any training when the launcher does not fit this runtime, saying what to pass instead.

        Two launches would otherwise train several independent copies into one run folder and exit 0:

        * `srun -n N` (N > 1) without an MPI plugin (`--mpi=none`, the default of many clusters): every task is a
          world of one rank. Slurm sets `SLURM_STEP_NUM_TASKS` in each task of a step (not in a batch script's own
          shell), and a plugin that joins the tasks into one world sets PMI or PMIx variables: N > 1 tasks without
          them cannot form a world.
        * `runtime=sim` under a launcher of N > 1 ranks: the simulator runs in one process.

        Only rank 0 raises (ValueError: `collsync-train` prints it as one line, under MPI naming the rank, and aborts
        the world); the other ranks exit with status 2 without a message, so the line is printed once. In an MPI world
        they first join MPI's start-up, which MPICH makes collective (rank 0 needs it to abort), and wait for the
        abort. `env`: the environment to read (default `os.environ`).
        """
        env = os.environ if env is None else env
        rank = launcher_rank(env)
        tasks = env.get("SLURM_STEP_NUM_TASKS", "")
        ranks = next((int(env[v]) for v in SIZE_VARS if env.get(v, "").isdigit()), 1)
        if tasks.isdigit() and int(tasks) > 1 and not any(v in env for v in WORLD_VARS):
            if rank != 0:
                raise SystemExit(2)
            raise ValueError(
                f"launcher: srun started SLURM_STEP_NUM_TASKS={tasks} tasks with no MPI plugin (srun --mpi=none), so "
                f"each would train alone: pass srun --mpi=pmi2 (the mpich wheel; --mpi=pmix for Open MPI), e.g. "
                f"srun --mpi=pmi2 -n {tasks} .venv/bin/python -m mpi4py -m collsync.cli ..., or -n 1 for the simulator"
            )
        if self.kind == "sim" and ranks > 1:
            if rank != 0:
                from mpi4py import MPI  # noqa: F401 - joins MPI's start-up, which rank 0's abort of the world needs

                time.sleep(_AWAIT_ABORT_S)
                raise SystemExit(2)
            raise ValueError(
                f"runtime=sim runs the simulator in one process, but the launcher started {ranks} ranks, each of which "
                f"would train its own copy: pass runtime=mpi (or leave runtime=auto) to train over MPI, or run "
                f"collsync-train without a launcher (runtime.workers=N sets the simulated workers)"
            )


def launcher_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank as the launcher announced it in `env` (default `os.environ`); 0 without a launcher."""
    env = os.environ if env is None else env
    return next((int(env[v]) for v in RANK_VARS if env.get(v, "").isdigit()), 0)


def launched_under_mpi() -> bool:
    """True when a launcher started this process as one of several ranks (read from the environment only)."""
    for var in SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False


def sim(workers: int = 8, margin: float | str | None = "auto", catch_up: bool | None = None) -> RuntimeSpec:
    """The deterministic simulator with `workers` simulated workers.

    `margin` and `catch_up`: backup rounds (`sync=backup`) as `partial` runs them between real ranks, the same keys
    and defaults, on the simulator's clock (`margin` in its model seconds: the straggler model's). "auto": a
    round waits after its N-th gradient as long as the arrivals measured before say nobody straggles
    (`margin.Margin`); a number, that many seconds; null, exactly the first N (000_...'s fixed b). `catch_up`
    (null: on): a late worker computes the batch of the round it joins, skipping those of the rounds it missed.
    """
    return RuntimeSpec("sim", workers=workers, margin=margin, catch_up=catch_up)


def mpi(
    servers: int = 1, inject_stragglers: bool = False, time_scale: float = 0.01, placement: str = PLACEMENT
) -> RuntimeSpec:
    """Parameter server on MPI one-sided windows: `servers` ranks serve, the rest are workers.

    `servers` M >= 2 splits the parameters into M shards balanced by size, shard j served by server j (each with
    its own update counter; PSP's partial pull, `sync=psp sync.pull_fraction=...`, works across them). Rank 0 writes
    the run folder (and is always server 0).

    `placement`: which ranks serve. "spread" (default): round-robin over the hosts (each host's first rank, then
    each host's second, ...), so that under block placement (consecutive ranks on one host) the shards' traffic
    does not all go through the first host's link; on one host it picks ranks 0..M-1, exactly as "first" does.
    "first": ranks 0..M-1 of the launch. Messages name ranks as the launcher numbers them either way
    (`collsync.runtime.placement`).

    `inject_stragglers`: each worker also sleeps the compute time and message delay the straggler model draws for
    its batch, times `time_scale` (the simulator's seconds are model seconds; 0.01 turns 1 s into 10 ms); a frozen
    worker stops computing until training ends. The same seeded draws as the simulator's.
    """
    return RuntimeSpec(
        "mpi", servers=servers, inject_stragglers=inject_stragglers, time_scale=time_scale, placement=placement
    )


def allreduce(bucket_mib: float = 4.0, inject_stragglers: bool = False, time_scale: float = 0.01) -> RuntimeSpec:
    """Serverless full sync over MPI collectives: every rank is a worker (BSP only).

    `bucket_mib`: gradients are averaged in buckets of about this many MiB while the backward pass runs (overlap,
    as Horovod's tensor fusion and DDP's buckets): each bucket's `MPI_Allreduce` on a communication thread
    (`mpi_buckets.CommThread`, where MPI allows threads; `MPI_Iallreduce` + `Testall` otherwise); 0: one
    `MPI_Allreduce` of the whole gradient after backward. Either way bounded by `sync.deadline`.
    """
    return RuntimeSpec("allreduce", inject_stragglers=inject_stragglers, time_scale=time_scale, bucket_mib=bucket_mib)


def partial(
    depth: int = 8,
    margin: float | str | None = "auto",
    catch_up: bool | None = None,
    inject_stragglers: bool = False,
    time_scale: float = 0.01,
    protocol: str = "auto",
) -> RuntimeSpec:
    """Serverless backup workers over a k-of-n partial allreduce on MPI windows (`sync=backup` or `sync=bsp`):
    every rank is a worker and holds a replica of the server; each round averages the first N gradients. The same
    keys, defaults and meaning as `collsync.torch`'s serverless backup (`sync_config(depth=, margin=, catch_up=)`,
    one driver: `collsync.rounds`):

    `depth`: a rank up to `depth` rounds behind reads the means it missed; further behind, the others wait for it
    (with `sync.deadline`, for at most that long before it is lost: the others go on while at most `backups` are).
    `margin`: "auto" waits after a round's N-th gradient for the others as long as the measured arrivals say
    nobody straggles (`margin.Margin`); a number waits that many seconds; null takes exactly the first N.
    `catch_up`: a rank that comes after its round completed applies every round completed meanwhile and skips their
    batches (null: on; collsync.torch turns it off by itself under a user's per-step LR scheduler); false: it
    computes its own next batch for the next round.
    `protocol`: how a partial round's contributions move: "direct" (between the contributors, by messages), "host"
    (through rank 0's windows), or "auto": direct where the ranks span hosts, host on one host (each measured the
    faster there; `runtime.mpi_partial_direct.direct_protocol`).
    """
    return RuntimeSpec(
        "partial",
        protocol=protocol,
        inject_stragglers=inject_stragglers,
        time_scale=time_scale,
        depth=depth,
        margin=margin,
        catch_up=catch_up,
    )


def auto(
    workers: int = 8,
    servers: int = 1,
    inject_stragglers: bool = False,
    time_scale: float = 0.01,
    margin: float | str | None = "auto",
    catch_up: bool | None = None,
    placement: str = PLACEMENT,
) -> RuntimeSpec:
    """MPI when launched as several ranks (mpiexec, srun), else the simulator with `workers` workers (`margin` and
    `catch_up`: the simulator's backup rounds, see `sim`; the parameter server's backup rounds take exactly the
    first N: `runtime=partial` is the serverless backup with a margin over MPI; `servers` and `placement`: the
    parameter server's, see `mpi`)."""
    check_placement(placement, "runtime: placement")  # refused alike wherever the run lands
    if launched_under_mpi():
        check_margin(margin)  # refused alike wherever the run lands
        return mpi(servers, inject_stragglers, time_scale, placement)
    return sim(workers, margin, catch_up)
