"""Collectives over mpi4py for the serverless full-sync path (`runtime=allreduce`).

`MpiCollective` averages a whole flat vector at once (`mpi_buckets.BucketReducer` averages it in buckets while the
backward pass runs). `wait` waits for a nonblocking collective within a deadline; `shutdown` lets ranks that finish
at different times leave together without spinning; `threads_supported` says whether a reduction thread may run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

import os
import time
from collections.abc import Callable
from typing import Any

from collsync.runtime.mpi_windows import Backoff
from collsync.runtime.mpi_world import RankLost, lost
from collsync.types import Flat


def wait(request: Any, deadline: float | None, what: str, pause: Callable[[], None] | None = None) -> None:
    """Wait for a nonblocking collective; with a `deadline` (seconds), raise TimeoutError once it has not
    completed in that time: a rank stopped, hangs or died, and a collective cannot tell which (every rank's wait
    fires, and the first to report aborts the world). Between two tests: `pause()` (default: `Backoff`'s growing
    sleeps after `_YIELD_S` of `sched_yield()`); without a `deadline` or a `pause`, MPI's own blocking wait."""
    if deadline is None and pause is None:
        request.Wait()
        return
    if pause is None:
        pause = _yield_then_sleep()
    end = None if deadline is None else time.monotonic() + deadline
    while not request.Test():
        if end is not None and time.monotonic() >= end:
            raise TimeoutError(f"{what} did not complete within deadline={deadline:g}s: a rank stopped, hangs or died")
        pause()


# How long a deadline-bounded wait yields the core between tests before it sleeps. A nonblocking collective on
# MPICH progresses only while its ranks are inside MPI: a rank asleep in a growing back-off stalls every other
# rank's part of the reduction, and they take turns sleeping (measured: a 100k-parameter step 3.6x the blocking
# loop with sleeps from the first miss). Yielding keeps each test prompt and still lets a rank sharing the core
# run; past this, the collective is late (a straggler, a stopped rank) and sleeping spares the CPU.
_YIELD_S = 0.05


def _yield_then_sleep() -> Callable[[], None]:
    backoff = Backoff(spins=0)
    until = time.monotonic() + _YIELD_S

    def pause() -> None:
        if time.monotonic() < until:
            os.sched_yield()
        else:
            backoff.wait()

    return pause


def threads_supported() -> bool:
    """Whether MPI was initialised with MPI_THREAD_MULTIPLE (mpi4py's default), which a `CommThread` needs: its
    reductions run while the main thread may call MPI on another communicator."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


class MpiCollective:
    """`Collective` over an MPI communicator.

    Allreduce runs in place on the tensor's numpy view: `Tensor.numpy()` shares memory with a CPU tensor, so MPI
    reads and writes torch's buffer directly and no copy is made.
    """

    def __init__(self, comm: MPI.Comm, deadline: float | None = None) -> None:
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.deadline = deadline  # seconds an allreduce may take before a rank counts as stopped (None: no limit)

    def allreduce_mean(self, flat: Flat) -> Flat:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        buf = flat.detach().contiguous()
        if self.deadline is None:
            self.comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
            return buf.div_(self.size)
        try:
            wait(self.comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM), self.deadline, "an allreduce")
        except TimeoutError as exc:
            raise lost(self.comm, str(exc), self.deadline) from None  # the roll call names the missing ranks
        return buf.div_(self.size)

    def broadcast(self, flat: Flat, root: int = 0) -> Flat:
        buf = flat.detach().contiguous()
        self.comm.Bcast(buf.numpy(), root=root)
        return buf

    def iallreduce_mean(self, flat: Flat) -> tuple[Any, Flat]:
        """Start a nonblocking sum; `finish(request, flat)` waits and divides. Lets work overlap communication."""
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        buf = flat.detach().contiguous()
        return self.comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM), buf

    def finish(self, request: Any, buf: Flat) -> Flat:
        request.Wait()
        return buf.div_(self.size)

    def barrier(self) -> None:
        self.comm.Barrier()

    def shutdown(self, timeout: float | None = None) -> None:
        """See `shutdown` below; `timeout` defaults to the deadline (the end never waits for ever on a lost rank)."""
        shutdown(self.comm, self.deadline if timeout is None else timeout)


class ShutdownTimeout(RankLost):
    """`shutdown` gave up waiting; `request` is its barrier, still posted (the late ranks will complete it)."""

    def __init__(self, message: str, request: Any) -> None:
        super().__init__(message)
        self.request = request


def shutdown(comm: MPI.Comm, timeout: float | None = None, while_waiting: Callable[[], None] | None = None) -> None:
    """Return once every rank of `comm` has called this: an `Ibarrier`, tested with growing sleeps in between.

    A rank that finishes early (the others still training, or rank 0 still writing the run folder) sleeps instead
    of spinning inside a blocking barrier on a core a slower rank may need. With `timeout` seconds, raise an error
    naming the ranks that did not arrive by then (the roll call: a rank stuck or gone): `ShutdownTimeout`, whose
    `request` is the barrier, still posted; wait on it, or abort the world (collsync's entry point does).
    `while_waiting()` is called between two tests (a server still answering requests while the others finish).
    """
    request = comm.Ibarrier()
    backoff = Backoff()
    end = None if timeout is None else time.monotonic() + timeout
    while not request.Test():
        if end is not None and time.monotonic() > end:
            said = lost(comm, f"shutdown: not every rank reached shutdown within {timeout:g}s", timeout)
            raise ShutdownTimeout(str(said), request)
        if while_waiting is not None:
            while_waiting()
        backoff.wait()
