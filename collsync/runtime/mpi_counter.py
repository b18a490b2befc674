"""One shared counter on an MPI one-sided window: every rank takes the next ticket with `MPI_Fetch_and_op`.

The word lives in a window on rank `host` of the communicator (8 bytes there, none elsewhere) and is only touched by
atomics inside one `Lock_all` epoch opened at construction, each completed by its own `Flush`
(`collsync.runtime.mpi_windows`): on MPICH a per-operation `Lock` would wait until the host enters MPI, `Lock_all`
plus `Flush` does not on one node (shared memory); Open MPI needs no progress from the host either. Between nodes on
MPICH a take completes once the host next enters MPI (any MPI call of its own: a training step's communication).
Tickets are handed out exactly once each, in the order the takes reach the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

from typing import Any, cast

import numpy as np

from collsync.runtime.mpi_windows import Windows, Words


class SharedCounter(Windows):
    """Collective constructor over `comm`: a counter starting at 0 on rank `host`. `free()` (collective) ends it."""

    def __init__(self, comm: MPI.Comm, host: int = 0) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        if not 0 <= host < comm.Get_size():
            raise ValueError(f"mpi: counter host rank {host} is not a rank of a communicator of {comm.Get_size()}")
        self.MPI, self.comm, self.host = MPI, comm, host
        hosting = comm.Get_rank() == host
        self.win = MPI.Win.Allocate(8 if hosting else 0, 8, comm=cast("MPI.Intracomm", comm))  # an intracomm
        if hosting:
            np.frombuffer(cast(Any, self.win.tomemory()), dtype=np.int64)[:] = 0  # mpi4py types its buffer loosely
        comm.Barrier()  # the zeroed word is in place before anyone takes a ticket
        self.win.Lock_all()
        self._wins = (self.win,)
        self._word = Words(self.win, host)

    def take(self, count: int = 1) -> int:
        """Add `count` to the counter atomically; the value before (this rank's ticket)."""
        return self._word.fetch(0, count, self.MPI.SUM)

    def load(self) -> int:
        """The counter's value now (the next ticket), read atomically."""
        return self._word.load(0)
