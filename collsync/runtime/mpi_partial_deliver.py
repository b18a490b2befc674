"""Deliveries of the direct exchange's means (`mpi_partial_direct`): the contributor that copies a round's mean into
the host's ring also sends it, with the round's record, in one message to every rank outside the round's exchange
(dropped after the close, late, or catching up), so that such a rank takes the round without a round trip.

Read from the ring, a round costs a rank outside its exchange five dependent round trips to the host (the tag, the
ticket, the record, the mean, the tag again) and one more for its read counter (the gate). Across a slow link that
is the rank's whole round: with one host behind 5 ms each way a late rank read a round in about 100 ms while the
others ran one in 25, so it fell a ring's depth behind and the gate held every rank for it (benchmarks/README.md,
"A late host's rounds by message"). A delivery is one message one way, sent as soon as the round is complete and
received while the rank computes: a rank catching up takes every round that has come with no round trip; its
tickets (an `Accumulate` each, with no answer: the round's record comes with the mean) are completed by one
`Flush` once the backlog is taken, then its read counter written (`DirectRounds._flush_deferred`): two round trips
for the backlog. A caller that stops reading inside the backlog (a catch-up's room, an epoch's end) completes them
there (`PartialAllreduce.stop_reading`, which `rounds.BackupRounds.pause` calls), not at its next call: a rank
stopped in between would leave the ring's accounting of it behind.

The ring stays the record of every round: a rank whose delivery has not come looks there after a while (its
writer may have been lost after the ring's copy), and deliveries of rounds it has read another way are dropped.
A delivery is `[round, quorum, count, ranks[n]]` as int64 words, then the mean's bytes: one message, matched by
`Improbe` from any source (a receive posted from any source is not matched across hosts under MPICH's UCX module;
a probe is, `mpi_partial_messages.Messages.receive_any`) and received by `Imrecv` into a buffer of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from collsync.runtime.mpi_channel import Channel
from collsync.runtime.mpi_windows import RmaCounts
from collsync.types import Flat

if TYPE_CHECKING:
    from mpi4py import MPI

# Sends and receives left in flight at `free`, with their buffers, which MPI may still read or write.
_STRANDED: list[tuple[list[Any], np.ndarray]] = []


class Deliveries:
    """One rank's deliveries: the ones it sent (in flight, each with its buffer) and the ones it received (by round).
    On a `Channel` of the ranks' communicator, so that a probe from any source matches nothing else."""

    def __init__(self, comm: MPI.Comm, numel: int, dtype: torch.dtype, size: int) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        # Tags of its own: a delivery an earlier allreduce sent to a rank that never took it (a lost rank) would
        # otherwise be taken here as a round of this one (`mpi_channel`).
        self.channel = Channel(comm, tags=1)
        self.MPI, self.comm, self._tag = MPI, self.channel.comm, self.channel.tag(0)
        self._np = np.float32 if dtype == torch.float32 else np.float64
        self.head = 3 + size  # round, quorum, count, ranks[size]
        self.nbytes = self.head * 8 + numel * np.dtype(self._np).itemsize
        self.sending: list[tuple[list[Any], np.ndarray]] = []
        self.receiving: list[tuple[Any, np.ndarray]] = []
        self.arrived: dict[int, np.ndarray] = {}
        self.counts: RmaCounts | None = None
        # The receiver's writes left to its next Flush (`DirectRounds._flush_deferred`), and their buffers.
        self.ticket, self.read_word = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        self.tickets_pending = self.read_pending = False

    def count_into(self, counts: RmaCounts) -> None:
        self.counts = counts

    def send(self, round_: int, record: np.ndarray, mean: Flat, targets: Sequence[int]) -> None:
        """Send round `round_`'s `record` ([quorum, count, ranks[n]]) and `mean` to each of `targets` (one buffer
        for all, kept until every send of it completed; a send never waits for its receiver)."""
        self._reap()
        if not targets:
            return
        buf = np.empty(self.nbytes, dtype=np.uint8)
        head = buf[: self.head * 8].view(np.int64)
        head[0], head[1:] = round_, record
        buf[self.head * 8 :].view(self._np)[:] = mean.numpy()
        self.sending.append(([self.comm.Isend([buf, self.MPI.BYTE], t, self._tag) for t in targets], buf))
        if self.counts is not None:
            self.counts.ops["Isend"] += len(targets)
            self.counts.data_bytes += self.nbytes * len(targets)

    def _reap(self) -> None:
        self.sending = [(reqs, buf) for reqs, buf in self.sending if not self.MPI.Request.Testall(reqs)]

    def take(self, round_: int) -> tuple[np.ndarray, Flat] | None:
        """Round `round_`'s (record, mean) if its delivery has come, else None; drops those of earlier rounds (read
        from the ring, or by a rank that ran past them). Local: a probe and tests, no round trip."""
        self._receive(round_)
        buf = self.arrived.pop(round_, None)
        if buf is None:
            return None
        record = buf[8 : self.head * 8].view(np.int64).copy()
        return record, torch.from_numpy(buf[self.head * 8 :].view(self._np))

    def arrived_from(self, floor: int) -> int:
        """How many deliveries of rounds `floor` and on have come and wait to be taken (local; for monitoring)."""
        self._receive(floor)
        return len(self.arrived)

    def _receive(self, floor: int) -> None:
        while (message := self.comm.Improbe(self.MPI.ANY_SOURCE, self._tag)) is not None:
            buf = np.empty(self.nbytes, dtype=np.uint8)
            self.receiving.append((message.Irecv([buf, self.MPI.BYTE]), buf))
            if self.counts is not None:
                self.counts.ops["Irecv"] += 1
                self.counts.data_bytes += self.nbytes
        still = []
        for req, buf in self.receiving:
            if not req.Test():
                still.append((req, buf))
                continue
            round_ = int(buf[:8].view(np.int64)[0])
            if round_ >= floor:
                self.arrived[round_] = buf
        self.receiving = still
        for round_ in [r for r in self.arrived if r < floor]:
            del self.arrived[round_]

    def free(self) -> None:
        """Drop what came, keep what is still being sent alive (`_STRANDED`), release the communicator."""
        self._reap()
        _STRANDED.extend(self.sending)
        _STRANDED.extend(([req], buf) for req, buf in self.receiving)
        self.sending, self.receiving, self.arrived = [], [], {}
        self.channel.free()
