"""The MPI world as collsync sees it: checked against the launcher, with errors that name the rank."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

from collsync.runtime.spec import SIZE_VARS, launched_under_mpi

__all__ = ["launcher_size", "launched_under_mpi", "rank_prefix", "abort", "abort_on_error", "world", "set_threads"]


def launcher_size(env: Mapping[str, str] | None = None) -> int | None:
    """The world size the launcher announced in the environment (PMI, Open MPI), or None if none did."""
    env = os.environ if env is None else env
    for var in SIZE_VARS:
        value = env.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def check_world_size(announced: int | None, actual: int) -> None:
    """A launcher of one MPI starting ranks of another yields N separate one-rank worlds: stop with one line."""
    if announced is not None and announced != actual:
        raise RuntimeError(
            f"mpi: the launcher started {announced} ranks but MPI sees a world of {actual}: the launcher and the "
            f"MPI library do not match (use the venv's own mpiexec, or `srun --mpi=pmi2` for the mpich wheel)"
        )


def world() -> Any:
    """COMM_WORLD, after checking that its size is what the launcher asked for."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    check_world_size(launcher_size(), comm.Get_size())
    return comm


def rank_prefix(comm: Any) -> str:
    """'rank 3 of 8 on node17': the attribution every distributed error message starts with."""
    return f"rank {comm.Get_rank()} of {comm.Get_size()} on {socket.gethostname()}"


def node_size(comm: Any) -> int:
    """How many ranks of `comm` share this rank's node (collective)."""
    return node_layout(comm)[0]


def affinity() -> set[int]:
    """The cores this process may run on (its affinity mask: a Slurm task bound with `--cpu-bind` sees its own)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def node_layout(comm: Any) -> tuple[int, int]:
    """(ranks of `comm` on this node, cores those ranks may run on together) (collective). The cores are the union
    of the ranks' affinity masks: under `srun --cpu-bind=cores` each rank's own mask is one core, which says
    nothing about whether the node's ranks share cores; unbound ranks each see the whole node."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    masks = local.allgather(sorted(affinity()))
    local.Free()
    return len(masks), len(set().union(*masks))


def own_cores(comm: Any) -> bool:
    """Whether every rank of `comm` on this node can have a core of its own (collective): no more ranks here than
    cores they may run on together."""
    ranks, cores = node_layout(comm)
    return ranks <= cores


def threads_per_rank(own: int, total: int, node: int) -> int:
    """torch intra-op threads for one of `node` ranks on a node of `total` cores, itself allowed on `own` of them:
    an equal share, never more than its own cores (a rank bound to one core runs one thread)."""
    return max(1, min(own, total // max(1, node)))


def set_threads(comm: Any, node: int | None = None) -> int:
    """Give each rank an equal share of the node's cores for torch's intra-op threads (no oversubscription).
    `node`: the ranks on this node, if the caller counted them already (`node_size`, collective)."""
    import torch

    threads = threads_per_rank(len(affinity()), os.cpu_count() or 1, node_size(comm) if node is None else node)
    torch.set_num_threads(threads)
    return threads


# How long a failing rank waits between writing its message and aborting. MPI_Abort has the launcher kill every
# process at once, and output still in the pipes to the launcher's proxies is lost with them (seen with MPICH's
# Hydra: the error line vanished in about one run of ten); a moment's wait lets the proxies forward it first.
ABORT_GRACE_S = 1.0


def abort(comm: Any, code: int) -> None:
    """Abort the world with `code` once this rank's stdout and stderr have had time to reach the launcher."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    comm.Abort(code)
    # Abort returns only where the world is already being torn down (another rank aborted first): leave anyway.
    os._exit(code)


@contextlib.contextmanager
def abort_on_error(comm: Any, user_errors: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """An exception on one rank prints its attributed message and aborts the world, which would otherwise hang."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure must take the world down
        if isinstance(exc, user_errors):
            print(f"collsync: {rank_prefix(comm)}: error: {exc}", file=sys.stderr, flush=True)
        else:
            print(f"collsync: {rank_prefix(comm)}: unhandled error:", file=sys.stderr, flush=True)
            traceback.print_exc()
            sys.stderr.flush()
        abort(comm, 1 if not isinstance(exc, user_errors) else 2)
