"""The MPI world as collsync sees it: checked against the launcher, with errors that name the rank."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from collsync.ending import end, stop_now
from collsync.runtime import startup
from collsync.runtime.placement import named_rank
from collsync.runtime.spec import SIZE_VARS, launched_under_mpi
from collsync.say import say

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "launcher_size",
    "launched_under_mpi",
    "rank_prefix",
    "abort_on_error",
    "world",
    "set_threads",
    "RankLost",
    "hello",
    "gate",
    "lost",
    "open_mpi",
]


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


def rank_prefix(comm: MPI.Comm) -> str:
    """'rank 3 of 8 on node17': the attribution every distributed error message starts with (the launcher's rank,
    wherever the servers' placement put this rank in `comm`: `placement.named_rank`)."""
    return f"rank {named_rank(comm, comm.Get_rank())} of {comm.Get_size()} on {socket.gethostname()}"


class RankLost(TimeoutError):
    """A rank did not arrive within the run's deadline (stopped, hung, dead, cut off); the message is one line
    naming it by rank and host. A `TimeoutError`, so what handles a deadline handles this too; uncaught in a
    `collsync.torch` script it is shown as that one line and the job is aborted (`collsync.torch.init`)."""


# Tags of the roll call below, on the communicator whose collective timed out: point-to-point messages never match
# collectives (MPI keeps them apart), and these tags are above anything collsync sends.
_ROLL, _VERDICT = 32001, 32002
# How long rank 0 collects the others' answers after its own wait timed out (and they wait for its verdict): the
# live ranks time out at about the same time, each `deadline` after it arrived; capped as the run folder's grace.
ROLL_WINDOW_S = 30.0
# Each rank's host name by COMM_WORLD rank, from `hello` (so a later timeout names a lost rank's host).
_HOSTS: dict[int, str] = {}


def host_of(comm: MPI.Comm, rank: int) -> str:
    """The host of `comm`'s rank `rank` as `hello` heard it ('?' before `hello`, or for a rank that never said)."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    world_rank = MPI.Group.Translate_ranks(comm.Get_group(), [rank], MPI.COMM_WORLD.Get_group())[0]
    return _HOSTS.get(world_rank, "?")


def _test_until(requests: list[Any], end: float) -> None:
    """Test `requests` with short sleeps until all completed or `end` (monotonic) passed."""
    while not all(r.Test() for r in requests) and time.monotonic() < end:
        time.sleep(0.005)


def roll_call(comm: MPI.Comm, window: float) -> list[int]:
    """After a bounded wait on `comm` timed out here: the ranks that are not waiting too. Each rank tells rank 0
    that it is alive (a point-to-point message, which no stopped rank can block); rank 0 collects for `window`
    seconds and answers each with the ranks that never told it; a rank that gets no answer names rank 0."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    rank, size = comm.Get_rank(), comm.Get_size()
    heard = np.zeros(size, dtype=np.int64)
    if rank != 0:
        comm.Isend([np.ones(1, dtype=np.int64), MPI.INT64_T], dest=0, tag=_ROLL)
        request = comm.Irecv([heard, MPI.INT64_T], source=0, tag=_VERDICT)
        _test_until([request], time.monotonic() + window)
        if not request.Test():
            request.Cancel()
            return [0]
        return [r for r in range(size) if not heard[r]]
    heard[0] = 1
    boxes = [np.zeros(1, dtype=np.int64) for _ in range(size)]
    requests = [comm.Irecv([boxes[r], MPI.INT64_T], source=r, tag=_ROLL) for r in range(1, size)]
    end = time.monotonic() + window
    while time.monotonic() < end and not all(heard):
        for r, request in enumerate(requests, start=1):
            if not heard[r] and request.Test():
                heard[r] = 1
        time.sleep(0.005)
    for r, request in enumerate(requests, start=1):
        if not heard[r]:
            request.Cancel()
    sends = [comm.Isend([heard, MPI.INT64_T], dest=r, tag=_VERDICT) for r in range(1, size) if heard[r]]
    _test_until(sends, time.monotonic() + 1.0)  # eager messages of n words: done at once, bounded anyway
    return [r for r in range(size) if not heard[r]]


def lost(comm: MPI.Comm, message: str, deadline: float | None) -> RankLost:
    """`message` (what timed out on this rank, within `deadline`) completed by the roll call's verdict: the ranks
    that did not arrive, by rank and host of `comm`."""
    window = ROLL_WINDOW_S if deadline is None else min(ROLL_WINDOW_S, max(1.0, deadline))
    missing = roll_call(comm, window)
    if not missing:
        cause = "every rank is waiting inside it (MPI made no progress)"
    else:
        named = ", ".join(f"rank {named_rank(comm, r)} on {host_of(comm, r)}" for r in missing)
        cause = f"{named} did not arrive (stopped, hung or dead)"
    prefix = f"{rank_prefix(comm)}: "
    message = message.removeprefix(prefix).removesuffix(": a rank stopped, hangs or died")  # said better below
    return RankLost(f"{prefix}{message}: {cause}")


def _poll(request: Any, end: float | None, startup: bool = True) -> bool:
    """Test `request` with growing sleeps until it completes (True) or `end` (monotonic) passes (False). At
    `startup`, a signal that asked the run to stop (`collsync.checkpoint`) ends the process here: nothing is
    trained yet to save, and no training loop will look at the request before every rank is in."""
    pause = 1e-4
    while not request.Test():
        if startup:
            stop_now("during start-up")
        if end is not None and time.monotonic() >= end:
            return False
        time.sleep(pause)
        pause = min(0.01, pause * 2)
    return True


def gate(comm: MPI.Comm, deadline: float | None, what: str, startup: bool = True) -> None:
    """Return once every rank of `comm` reached this point (an `Ibarrier`), or raise `RankLost` naming those that
    did not within `deadline` seconds (None: wait for ever). Placed before a collective set-up that cannot be
    bounded itself (`Split_type`, `Dup`, window creation): once every rank is here, it completes. `startup`: a
    stop signal ends the process at once here (False after training, whose run folder is still to be written)."""
    if not _poll(comm.Ibarrier(), None if deadline is None else time.monotonic() + deadline, startup):
        raise lost(comm, f"{what} did not complete within deadline={deadline:g}s", deadline)


def hello(comm: MPI.Comm, deadline: float | None) -> list[str]:
    """The start-up exchange (collective over COMM_WORLD's ranks in `comm`): each rank's host name, kept for the
    messages that name a lost rank later; bounded by `deadline` (`RankLost`: which ranks did not arrive)."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    own = np.zeros(256, dtype=np.uint8)
    name = socket.gethostname().encode()[:255]
    own[: len(name)] = np.frombuffer(name, dtype=np.uint8)
    names = np.zeros((comm.Get_size(), 256), dtype=np.uint8)
    request = comm.Iallgather([own, MPI.BYTE], [names, MPI.BYTE])
    if not _poll(request, None if deadline is None else time.monotonic() + deadline):
        missing = roll_call(comm, ROLL_WINDOW_S if deadline is None else min(ROLL_WINDOW_S, max(1.0, deadline)))
        arrived = [r for r in range(comm.Get_size()) if r not in missing]
        if not missing and deadline is not None:  # every rank timed out, then answered the roll call: too short
            late = f"every rank of {comm.Get_size()} arrived, but not within deadline={deadline:g}s of this one"
            raise RankLost(f"{rank_prefix(comm)}: start-up: {late}: {startup.too_short(deadline)}")
        raise RankLost(
            f"{rank_prefix(comm)}: start-up: rank(s) {', '.join(map(str, missing))} of {comm.Get_size()} did not "
            f"arrive within deadline={deadline:g}s (stopped, hung or dead; arrived: ranks {_ranges(arrived)})"
        )
    hosts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in names]
    ranks = MPI.Group.Translate_ranks(comm.Get_group(), list(range(len(hosts))), MPI.COMM_WORLD.Get_group())
    _HOSTS.update(zip(ranks, hosts, strict=True))
    return hosts


def _ranges(ranks: list[int]) -> str:
    """'0-2, 5': ranks as runs of consecutive numbers."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def node_size(comm: MPI.Comm) -> int:
    """How many ranks of `comm` share this rank's node (collective)."""
    return node_layout(comm)[0]


def affinity() -> set[int]:
    """The cores this process may run on (its affinity mask: a Slurm task bound with `--cpu-bind` sees its own)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def machine() -> str:
    """This machine's identity: the kernel's boot id, else the host name. Hosts made as network and UTS namespaces
    (the cluster in one box) and containers have names of their own but share one kernel, and so its cores; MPI's
    shared-memory split goes by name and would count each such host as a machine with every core to itself."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def node_layout(comm: MPI.Comm, deadline: float | None = None) -> tuple[int, int]:
    """(ranks of `comm` on this machine, cores those ranks may run on together) (collective). The cores are the
    union of the ranks' affinity masks: under `srun --cpu-bind=cores` each rank's own mask is one core, which says
    nothing about whether the machine's ranks share cores; unbound ranks each see the whole machine. The machine is
    `machine()`, not MPI's node: ranks on namespaced hosts of one kernel compete for the same cores (measured in
    the box: each of 4 ranks on 3 hosts over 2 cores believed it had a core, spun in MPI's blocking waits, and a
    step across a 5 ms link took 230 ms against Horovod's 33). With `deadline`, a rank that does not arrive
    within it is named (`gate`) rather than waited for: `allgather` has no bound of its own."""
    if deadline is not None:
        gate(comm, deadline, "start-up (the node layout)")
    everyone = comm.allgather((machine(), sorted(affinity())))
    here = everyone[comm.Get_rank()][0]
    masks = [mask for key, mask in everyone if key == here]
    return len(masks), len(set().union(*masks))


def spans_hosts(comm: MPI.Comm) -> bool:
    """Whether the ranks of `comm` run on more than one host (by host name: MPI reaches the others over the
    network, not through shared memory) (collective)."""
    return len(set(comm.allgather(socket.gethostname()))) > 1


def own_cores(comm: MPI.Comm) -> bool:
    """Whether every rank of `comm` on this node can have a core of its own (collective): no more ranks here than
    cores they may run on together."""
    ranks, cores = node_layout(comm)
    return ranks <= cores


def threads_per_rank(own: int, total: int, node: int) -> int:
    """torch intra-op threads for one of `node` ranks on a node of `total` cores, itself allowed on `own` of them:
    an equal share, never more than its own cores (a rank bound to one core runs one thread)."""
    return max(1, min(own, total // max(1, node)))


def set_threads(comm: MPI.Comm, node: int | None = None) -> int:
    """Give each rank an equal share of the node's cores for torch's intra-op threads (no oversubscription).
    `node`: the ranks on this node, if the caller counted them already (`node_size`, collective)."""
    threads = threads_per_rank(len(affinity()), os.cpu_count() or 1, node_size(comm) if node is None else node)
    torch.set_num_threads(threads)
    return threads


def open_mpi() -> bool:
    """Whether the MPI library is Open MPI (whose `mpirun --enable-recovery` keeps a job whose rank died)."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    return MPI.Get_library_version().startswith("Open MPI")


@contextlib.contextmanager
def abort_on_error(comm: MPI.Comm, user_errors: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """An exception on one rank prints its attributed message and aborts the world, which would otherwise hang."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure must take the world down
        if isinstance(exc, user_errors):
            end(2, f"collsync: {rank_prefix(comm)}: error: {exc}", comm=comm)
        say(f"collsync: {rank_prefix(comm)}: unhandled error:")
        traceback.print_exc()
        end(1, comm=comm)
