"""The point-to-point messages of the partial allreduce's direct exchange (`mpi_partial_direct`, whose docstring
gives the rounds): their tags, how a phase's messages are posted and waited for, and the one wait loop every
message wait of the exchange runs (`Messages.until`), so that each pauses, counts and times out the same way and
names what it waited for. Apart from the rounds because it knows nothing of them: a phase is a set of buffers and
peers, a probe is whatever says "done"."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from collsync import keepalive
from collsync.runtime.mpi_channel import Channel
from collsync.runtime.mpi_partial_deliver import Deliveries
from collsync.runtime.mpi_windows import Backoff, RmaCounts
from collsync.runtime.mpi_world import RankLost

if TYPE_CHECKING:
    from mpi4py import MPI

T = TypeVar("T")

_PHASES = 3  # message tags per round: the record, the blocks of the sum, the blocks of the mean
RECORD, SUM, MEAN = range(_PHASES)
_YIELD_S = 0.05  # how long a data phase yields between tests before it sleeps (`Messages.until`)
# A vector above this many bytes moves in rendezvous, only while both sides call into MPI: its phases yield between
# tests. Small ones travel eagerly and, on one host, their phases sleep as every other wait does (ranks share cores:
# a yielding rank still takes turns from the one it waits for, and the auto margin's tests measured it); across
# hosts they yield too (`PartialWindows._spin`).
LARGE_MESSAGE = 1 << 16

# Requests abandoned by a timeout with their buffers: MPI may still complete them (a late peer), writing the buffer.
# (mpi4py's requests hold their buffers.)
_STRANDED: list[list[Any]] = []


@dataclass(frozen=True)
class Pending:
    """One posted message: the peer it is exchanged with and which way (`send`: to it; else from it). A timeout
    names the pending ones, so a rank names the peer it waits on and never itself (a request's place in the list
    is not a contributor's)."""

    peer: int
    send: bool


@dataclass
class Posted:
    """A phase's requests (receives first, then sends) and, for the i-th, its `Pending` at `messages[i]`."""

    requests: list[Any] = field(default_factory=list)
    messages: list[Pending] = field(default_factory=list)

    def outstanding(self) -> list[Pending]:
        """The messages not yet complete, sorted by peer, receives before sends (each request tested once more:
        `Testall` that answered false modified none of them)."""
        late = [m for req, m in zip(self.requests, self.messages, strict=True) if not req.Test()]
        return sorted(set(late), key=lambda m: (m.peer, m.send))


class Messages:
    """The direct exchange's point-to-point messages, on a `Channel` of the ranks' communicator (never matched with
    the caller's, nor with those an earlier exchange left unreceived). Counted into `counts` where a benchmark asks
    (`Windows.count` calls `count_into`): each message an operation (`Isend`, `Irecv`) and its bytes, each wait for
    a phase that has messages one blocking round trip, each pause in it one local test (`RmaCounts.tests`, not a
    round trip)."""

    def __init__(self, comm: MPI.Comm, mpi_t: Any, backoff: Backoff, deliveries: Deliveries | None = None) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        self.channel = Channel(comm)  # tags of its own: no message an earlier exchange left behind matches them
        self.MPI, self.comm, self.mpi_t, self.backoff = MPI, self.channel.comm, mpi_t, backoff
        self.rounds = max(1, self.channel.tags // _PHASES)
        self.counts: RmaCounts | None = None
        self.deliveries = deliveries  # the means sent to the ranks outside an exchange

    def count_into(self, counts: RmaCounts) -> None:
        self.counts = counts
        if self.deliveries is not None:
            self.deliveries.count_into(counts)

    def tag(self, round_: int, phase: int) -> int:
        """Rounds more than `rounds` apart never meet: the gate keeps ranks within the ring's depth."""
        return self.channel.tag((round_ % self.rounds) * _PHASES + phase)

    def post(
        self, sends: Sequence[tuple[np.ndarray, int]], recvs: Sequence[tuple[np.ndarray, int]], tag: int
    ) -> Posted:
        """Post every receive, then every send (`(buffer, peer)` each: never `MPI.ANY_SOURCE`, see `receive_any`)
        with `tag`: the requests, each with its peer and direction."""
        kind = self.mpi_t if all(b.dtype != np.int64 for b, _ in (*sends, *recvs)) else self.MPI.INT64_T
        posted = Posted()
        for b, peer in recvs:
            posted.requests.append(self.comm.Irecv([b, kind], peer, tag))
            posted.messages.append(Pending(peer, send=False))
        for b, peer in sends:
            posted.requests.append(self.comm.Isend([b, kind], peer, tag))
            posted.messages.append(Pending(peer, send=True))
        if self.counts is not None:
            self.counts.ops["Irecv"] += len(recvs)
            self.counts.ops["Isend"] += len(sends)
            self.counts.data_bytes += sum(int(b.nbytes) for b, _ in (*sends, *recvs))
        return posted

    def wait(
        self, posted: Posted, timeout: float | None, late: Callable[[list[Pending]], str], spin: bool = False
    ) -> None:
        """Wait for the `posted` messages (`until`: not MPI's blocking wait, which spins, while the record may wait
        out a whole margin and ranks share cores); with `spin` (a large vector's phases, or any across hosts: every
        peer is inside MPI for them; over TCP a large message moves only while both sides call into MPI, and a pause
        of 1 ms stalls it) yielding the core between tests for the first `_YIELD_S`, as `mpi_coll.wait` does. After
        `timeout` s, `RankLost` with `late(the messages still pending)`, its requests left to `_STRANDED`."""
        if not posted.requests:
            return
        if self.counts is not None:
            self.counts.round_trips += 1

        def stranded() -> str:
            pending = posted.outstanding()
            _STRANDED.append(posted.requests)
            return late(pending)

        self.until(lambda: self._testall(posted.requests) or None, timeout, stranded, spin)

    def until(
        self, probe: Callable[[], T | None], timeout: float | None, late: Callable[[], str], spin: bool = False
    ) -> T:
        """What `probe()` returns once it is not None, probed between the pauses of `backoff` (each pause one local
        test in `counts`), or with `spin` yielding between probes for the first `_YIELD_S`. After `timeout` s
        (shorter once the launcher said that a rank died: `keepalive.patience`), `RankLost` with `late()`. The
        one wait loop of the exchange's messages: `probe` carries what differs (a phase's requests, a probe for a
        record, a delivery or the ring)."""
        backoff, start = self.backoff, time.monotonic()
        backoff.reset()
        while (got := probe()) is None:
            waited = time.monotonic() - start
            limit = keepalive.patience(timeout)
            if limit is not None and waited >= limit:
                raise RankLost(late() + f" after timeout={limit}s")
            if self.counts is not None:
                self.counts.tests += 1
            if spin and waited < _YIELD_S:
                os.sched_yield()
            else:
                backoff.wait()
        return got

    def _testall(self, reqs: list[Any]) -> bool:
        try:
            return bool(self.MPI.Request.Testall(reqs))
        except self.MPI.Exception:
            # MPI_ERR_IN_STATUS: a request failed. Under ULFM a dead peer's: the failure detector reports it as the
            # process failure it is (`mpi_ulfm.Watch.check` raises), so that the caller shrinks the world.
            if self.backoff.check is not None:
                self.backoff.check()
            raise

    def receive_any(self, buf: np.ndarray, tag: int, timeout: float | None, late: Callable[[], str]) -> None:
        """Receive `buf` (int64) with `tag` from whichever rank sends it: probed for, then received from the rank
        found (a receive posted from any source was never matched across hosts under MPICH's UCX network module,
        a probe is); after `timeout` s, `RankLost` with `late()`."""
        status = self.MPI.Status()
        self.until(lambda: status if self.comm.Iprobe(self.MPI.ANY_SOURCE, tag, status) else None, timeout, late)
        self.comm.Recv([buf, self.MPI.INT64_T], status.Get_source(), tag)
        if self.counts is not None:
            self.counts.ops["Irecv"] += 1
            self.counts.data_bytes += int(buf.nbytes)
            self.counts.round_trips += 1

    def free(self) -> None:
        if self.deliveries is not None:
            self.deliveries.free()
        self.channel.free()
