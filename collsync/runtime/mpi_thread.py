"""`CommThread`: in-place sums on a thread of their own, so that a reduction runs while the main thread goes on
with the backward pass (`mpi_buckets.BucketReducer` posts its gradient buckets to one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from collsync.runtime.mpi_coll import threads_supported, wait
from collsync.runtime.mpi_world import own_cores, spans_hosts


class CommThread:
    """A thread that runs in-place sums over its own duplicate of `comm`, one at a time, in the order posted.

    `post(array, then)` queues `MPI_Allreduce(IN_PLACE, array, SUM)` and returns at once; `then()` (the division by
    the world size, say) runs in the thread after the sum, while the data is still in cache. `wait(deadline, what)`
    returns once everything posted is done. mpi4py releases the GIL inside MPI calls and torch inside its kernels,
    so the thread's reduction and the main thread's backward pass run at the same time (Horovod's background thread,
    Sergeev & Del Balso 2018; the gradients come out last layer first, so the first buckets are summed while the
    earlier layers' gradients are still being computed).

    Every rank posts the same sequence (MPI matches collectives on a communicator by order); the duplicate
    communicator keeps these sums apart from whatever the main thread reduces meanwhile. `wait` with a `deadline`
    raises TimeoutError once the sums have not completed in that many seconds (a rank stopped, hangs or died, and a
    collective cannot say which); the thread is then stuck in MPI until the world is aborted, as collsync's entry
    point does after any error. `blocking=False`: the thread polls `Iallreduce` with `Test` and `sched_yield()`
    instead of waiting inside MPI: MPICH spins in a blocking wait, and where ranks outnumber the node's cores that
    spin takes a core another rank needs (4.9x the hand-written loop at 4 ranks on 2 cores, measured when
    `collsync.torch` waited that way). The default, None, chooses that where the ranks share one machine's cores
    and more of them run there than it has cores; ranks on several hosts wait in MPI (its blocking collectives'
    algorithms are tuned for the network, the nonblocking ones are not: see `run`).
    Construction and `close()` are collective over `comm`.
    """

    def __init__(self, comm: MPI.Comm, *, blocking: bool | None = None, name: str = "collsync-allreduce") -> None:
        from mpi4py import MPI  # lazily: collsync's modules import without an MPI library

        if not threads_supported():
            raise RuntimeError("CommThread: MPI was not initialised with MPI_THREAD_MULTIPLE")
        self.MPI = MPI
        self.comm = comm.Dup()
        if blocking is None:
            blocking = own_cores(comm) or spans_hosts(comm)
        self.blocking = blocking
        self._cv = threading.Condition()
        self._jobs: deque[tuple[Any, Callable[[], object] | None] | None] = deque()
        self._posted = 0
        self._done = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, array: Any, then: Callable[[], object] | None = None) -> None:
        """Queue an in-place sum of `array` (a numpy view of a tensor) over the ranks, then `then()`."""
        with self._cv:
            self._jobs.append((array, then))
            self._posted += 1
            self._cv.notify()

    def _sum(self, array: Any) -> None:
        MPI = self.MPI  # noqa: N806 - the module's own name
        if self.blocking:
            self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            return
        wait(self.comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), None, "a reduction", pause=os.sched_yield)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._jobs.popleft()
            if job is None:
                return
            array, then = job
            try:
                self._sum(array)
                if then is not None:
                    then()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread, which raises it
                with self._cv:
                    self._error = error
                    self._cv.notify_all()
                return
            with self._cv:
                self._done += 1
                if self._done == self._posted:
                    self._cv.notify_all()

    def run(self, array: Any, deadline: float | None, what: str) -> None:
        """Wait for everything posted, then sum `array`: the last bucket of a step, nothing left to overlap it with.
        A blocking thread without a `deadline` sums it in the calling thread (a hand-over to the thread and back
        costs two wake-ups, which on a loaded node are scheduling delays); with a `deadline` it posts it and waits
        for the thread within the deadline, so that the sum is MPI's blocking `Allreduce`, as without one: MPICH
        picks another algorithm for `Iallreduce` (at 38 KB on 4 ranks across a 5 ms link, 28 ms against the
        blocking 15 ms: measured in the cluster in one box). A polling thread's caller sums it by an `Iallreduce`
        tested in a loop, bounded by `deadline` as `wait` is."""
        MPI = self.MPI  # noqa: N806 - the module's own name
        if self.blocking:
            if deadline is None:
                self.wait(deadline, what)
                self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            else:  # MPI's blocking algorithm, on the thread, and a wait that can give up on it
                self.post(array)
                self.wait(deadline, what)
            return
        self.wait(deadline, what)
        # Yield between tests even with a core per rank: a Python loop spinning on Test without it made a
        # 100k-parameter step 1.8x the hand-written loop on a loaded node (1.02x with it, 1.00x blocking).
        wait(self.comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), deadline, what, pause=os.sched_yield)

    def wait(self, deadline: float | None, what: str) -> None:
        """Return once every posted sum is done; raise TimeoutError after `deadline` seconds (None: no limit), or
        the thread's own error."""
        end = None if deadline is None else time.monotonic() + deadline
        with self._cv:
            while self._done < self._posted:
                if self._error is not None:
                    raise RuntimeError(f"{what} failed: {self._error}") from self._error
                if not self._thread.is_alive():
                    raise RuntimeError(f"{what}: the reduction thread is closed")
                if end is None:
                    self._cv.wait()
                    continue
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{what} did not complete within deadline={deadline:g}s: a rank stopped, hangs or died"
                    )
                self._cv.wait(left)

    def abandon(self) -> None:
        """Let the thread end without freeing its communicator: after a process failure it is revoked (its sums
        returned with an error, `mpi_ulfm.shrink`), and freeing it would be one more collective with a dead rank."""
        with self._cv:
            self._jobs.append(None)
            self._cv.notify()
        self._thread.join(timeout=1.0)

    def close(self) -> None:
        """Stop the thread once it is idle, and free the duplicate communicator (collective). A thread still stuck
        in a sum (after a timeout) is left to the world's abort."""
        with self._cv:
            self._jobs.append(None)
            self._cv.notify()
        self._thread.join(timeout=1.0)
        if not self._thread.is_alive() and self.comm != self.MPI.COMM_NULL:
            self.comm.Free()
