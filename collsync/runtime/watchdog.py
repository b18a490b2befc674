"""Leaving a job that lost a rank: a worker's watchdog, and rank 0 ending the job once the run folder is written.

A worker cut off from its servers (its host's link down, a partition) sits blocked inside an MPI call towards them
(a `Put`, a `Get`, a `Flush`): the call never returns, so no check in the worker's own loop ever runs, and the
worker would stay for as long as the kernel keeps the connection (the launcher may never hear of it either: it
cannot reach the host). The watchdog is a thread outside that call (mpi4py releases the GIL inside every MPI call)
that compares the time of the last answer the worker got from its servers (`last()`: each completed round trip to
a server window) with `bound`; once it is older, it writes one line naming this rank and its servers and ends the
process with `os._exit` (nothing else can leave a thread blocked in MPI; `MPI_Finalize` would block as well).

The bound is the worker's own silence bound (`runs.shards`: twice the server's deadline plus rank 0's time to
write the run folder): by then the servers have lost this worker and finished without it, so leaving loses
nothing. A worker that computes a gradient makes no round trip meanwhile, so a step longer than the bound would
also end it; the servers have lost it long before that (their deadline is less than half the bound).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from collsync.ending import end
from collsync.runtime.mpi_windows import Backoff
from collsync.runtime.placement import named_rank

if TYPE_CHECKING:
    from mpi4py import MPI

    from collsync.runtime.mpi_rma import WindowMailbox

# How often the thread looks: the bound is seconds to minutes; a second late is nothing next to it.
PERIOD_S = 1.0
# The exit status of a worker that left this way: 2, as every rank a deadline ends (cli._fail).
EXIT_CODE = 2


class Watchdog:
    """`start()` to arm, `stop()` to disarm (before a phase whose waits are bounded otherwise). `who`: how the line
    names this rank ("rank 3 on node2: worker 2"); `servers`: how it names the servers ("rank 0 on node0")."""

    def __init__(self, last: Callable[[], float], bound: float, who: str, servers: str) -> None:
        self.last, self.bound, self.who, self.servers = last, bound, who, servers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="collsync-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * PERIOD_S)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def silent_for(self) -> float:
        return time.monotonic() - self.last()

    def _watch(self) -> None:
        while not self._stop.wait(PERIOD_S):
            if self.silent_for() > self.bound:
                self._leave()

    def _leave(self) -> None:
        end(
            EXIT_CODE,
            f"\ncollsync: {self.who}: no answer from the server(s) ({self.servers}) for {self.bound:g}s, waiting "
            f"inside MPI: cut off from them, or they stopped; the run goes on or ended without this worker; "
            f"leaving (exit {EXIT_CODE})",
        )


def worker_watchdog(
    mailboxes: Sequence[WindowMailbox], rank: int, bound: float | None
) -> contextlib.AbstractContextManager[Any]:
    """A worker's watchdog over its shards' mailboxes (none without a bound): the oldest last answer of any shard
    counts, since a worker needs every shard's block; the line names this rank, its host and every server."""
    if bound is None or not mailboxes:
        return contextlib.nullcontext()
    hosts, comm = mailboxes[0].hosts or [], mailboxes[0].comm

    def where(r: int) -> str:  # the launcher's rank (`placement.named_rank`), the host by rank of `comm`
        return f"rank {named_rank(comm, r)}" + (f" on {hosts[r]}" if r < len(hosts) else "")

    servers = ", ".join(where(box.server) for box in mailboxes)
    who = f"{where(rank)}: worker {mailboxes[0].worker}"
    return Watchdog(lambda: min(box.answered for box in mailboxes), bound, who, servers)


# Rank 0 -> every rank that answered the final gather: whether a rank is gone (`tell_the_end`). After the gathers'
# tags (`mpi_shards.TAG_END` = 77 and SpecSync's 78).
TAG_VERDICT = 79
_TOLD: list[Any] = []  # rank 0's sends of the word (tell_the_end)


def agree_on_the_end(comm: MPI.Comm, blocks: list[Any], lost: bool, timeout: float | None, before: float = 0.0) -> bool:
    """After the final gather (`blocks`: rank 0's, None for a rank that did not answer; empty elsewhere), whether a
    rank is gone: on rank 0, one lost (`lost`) or silent at the gather, told to every rank that answered
    (`tell_the_end`); another rank hears it, and takes no word within `before` + 3 x `timeout` (rank 0 may first
    wait up to `before` for workers still out when training ended, the deadline, then up to `timeout` for a silent
    rank at each gather, two with SpecSync, before it tells; no word: rank 0 itself lost) as none gone (its own
    close is bounded). A rank that gave up earlier would end the job (MPICH) before rank 0 wrote its last word.
    Then no rank frees the windows: that is collective and would touch the rank gone (between hosts, an error
    that aborts the job before rank 0 has written the run folder)."""
    if comm.Get_rank() == 0:
        gone = lost or any(b is None for b in blocks)
        tell_the_end(comm, gone, [r for r, b in enumerate(blocks) if b is not None])
        if not gone:
            while _TOLD:  # every rank is there to take its word, and MPI_Finalize follows: complete the sends
                _TOLD.pop().wait()
        return gone
    return bool(hear_the_end(comm, None if timeout is None else before + 3 * timeout))


def tell_the_end(comm: MPI.Comm, gone: bool, answered: Collection[int]) -> None:
    """Rank 0, after the final gather: tell each rank in `answered` whether a rank is gone. Never a collective,
    and never a message to a rank that did not answer: between hosts a message to a rank cut off fails in MPI
    (MPICH's UCX: once the connection attempt fails, the error aborts the job, the run folder unwritten)."""
    for r in answered:
        if r != 0:
            # Kept: a request dropped before it completes may free its (pickled) buffer under MPI; completed in
            # agree_on_the_end where no rank is gone, left to the abort where one is.
            _TOLD.append(comm.isend(gone, dest=r, tag=TAG_VERDICT))


def hear_the_end(comm: MPI.Comm, timeout: float | None) -> bool | None:
    """A rank other than 0, after its part of the final gather: rank 0's word on whether a rank is gone, or None
    if none came within `timeout` seconds (rank 0 itself lost)."""
    request = comm.irecv(source=0, tag=TAG_VERDICT)
    backoff, end = Backoff(), None if timeout is None else time.monotonic() + timeout
    while end is None or time.monotonic() < end:
        done, gone = request.test()
        if done:
            return bool(gone)
        backoff.wait()
    request.Cancel()
    request.Wait()  # a cancelled receive still completes (MPI_Finalize would find it pending otherwise)
    return None
