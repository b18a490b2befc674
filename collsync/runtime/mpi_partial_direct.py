"""The direct exchange of the k-of-n partial allreduce (`mpi_partial`): a round's contributions go straight between
its contributors, in `MPI_Allreduce`'s shape, and only control words and one copy of the mean touch the host.

The host-summed path (`protocol="host"`) moves every byte through one rank's memory (a contributor Puts its
vector there, Gets its block of every slot, Puts its block of the mean, Gets the whole mean: 3 vectors a round)
in 8-13 dependent round trips to the host, and the ranks waiting poll the host's words; across hosts quorum n - 1
cost 3.0-3.1x an `MPI_Allreduce` (benchmarks/README.md, "Round trips of the partial allreduce"). Here, one round
t at rank r, once its ticket says it counts:

1. ticket: `Fetch_and_op(SUM, 1 << r)` on the entry's ticket word (the gate as before), so the answer is the set
   of ranks that came before r in round t, not only their number (`PartialWindows._state`: the earlier rounds of
   the entry each added every rank's bit and one close flag, 1 << n). Its arrival order is the set's size.
2. the quorum-th arrival closes the round (`Fetch_and_op(SUM, closed)`, after the margin if any) and knows the
   contributors from its own ticket (without a margin: the `quorum` first) or from the close's answer (with a
   margin: every rank that drew a ticket before the close); it sends the record [quorum, count, ranks] to every
   other contributor (one message each): nobody polls the host for who counts.
3. reduce-scatter: the vector is cut into `count` blocks; contributor i receives block i of every other
   contributor's vector and sends it block j of its own (one message per pair), then adds the `count` parts in
   rank order and divides by `count`: the same additions, in the same order, as the host-summed path, so the same
   bits whichever rank sums, whatever the cut.
4. allgather: contributor i sends its block of the mean to every other contributor and receives theirs.
   A contributor moves 2 (count - 1) / count of the vector each way, what a ring `MPI_Allreduce` moves.
5. one contributor (the writer: the host if it counts, else one on the host's machine, else the first) Puts the
   mean into the host's ring (tag and record in one `Accumulate(REPLACE)`) and sends it with the record to every
   rank outside the exchange (`mpi_partial_deliver`: a late rank takes it with no round trip); 6. the writer also
   marks read[r] <- t + 1 for every contributor r (one `Accumulate(MAX)`, completed by the ring's Flush): a
   contributor has the mean from the exchange and never reads the ring, so it writes no read counter of its own.

Round trips to the host per contributor: the ticket (the closer adds its close, the writer the ring's Put and the
tag); three message phases between contributors, each one latency. Across hosts an atomic on the host's window
completes only once the host rank enters MPI: a read counter written by each contributor after its round waited
for the host's next compute (benchmarks/README.md, "Backup's read counters"). Membership, the margin, the drop
counting and the lost-rank rules are the host-summed path's (the same ticket word, closed by one atomic; a rank
lost between rounds has its bit drawn for it). A contributor stopped inside a round holds the others' exchange:
they fail after `timeout` naming it (and whether a block from it or one to it is pending), as the host-summed path
does when its block of the sum is missing. The ticket word holds one bit per rank, so up to `DIRECT_MAX_RANKS`
ranks use this path and larger worlds the host-summed one (a run of 2 ** (62 - n) rounds per ring entry fits the
word). The messages themselves (tags, posts, the waits) are `mpi_partial_messages.Messages`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from collsync.runtime import PartialResult
from collsync.runtime.mpi_partial_messages import MEAN, RECORD, SUM, Messages, Pending
from collsync.runtime.mpi_partial_tags import READY, TagState
from collsync.runtime.mpi_windows import Words
from collsync.types import Flat

DIRECT_MAX_RANKS = 40
PROTOCOLS = ("auto", "direct", "host")


def direct_protocol(protocol: str, hosts: Sequence[str]) -> bool:
    """Whether ranks on `hosts` (each rank's host name) exchange a partial round directly (`protocol`: "direct",
    "host", or "auto": direct where the ranks span hosts, host-summed on one host, where its copies go through
    shared memory and were measured the faster: benchmarks/README.md, "Round trips of the partial allreduce").
    Either way the direct exchange only up to `DIRECT_MAX_RANKS` ranks (its ticket word's bits)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"partial allreduce: {protocol=} must be one of {', '.join(PROTOCOLS)}")
    direct = protocol == "direct" or (protocol == "auto" and len(set(hosts)) > 1)
    return direct and len(hosts) <= DIRECT_MAX_RANKS


_RING_AFTER_S = 0.5  # how long a rank waits for a delivery before it also looks at the ring (`_await_delivered`)


def writer_of(ranks: Sequence[int], host: int, hosts: Sequence[str]) -> int:
    """The contributor that copies a round's mean into the host's ring: the host itself (a copy in its own memory),
    else one on the host's machine (shared memory), else the first (across the network)."""
    if host in ranks:
        return host
    return next((r for r in ranks if hosts[r] == hosts[host]), ranks[0])


class DirectRounds:
    """A contributor's round on the direct exchange (module docstring); mixed into `PartialAllreduce`."""

    MPI: Any
    size: int
    rank: int
    numel: int
    dtype: torch.dtype
    depth: int
    host: int
    timeout: float | None
    margin: float | str | None
    msgs: Messages | None
    win_ring: Any
    win_ctrl: Any
    lost: dict[int, int]
    round: int
    _words: Words
    _read: int
    _stored_read: int
    _arrived_before: float
    _mpi_t: Any
    _hosts: list[str]
    _who: str
    _parts: Flat | None
    _reads: np.ndarray
    _spin: bool  # whether the exchange's phases yield between tests rather than sleep (`PartialWindows.__init__`)

    if TYPE_CHECKING:  # PartialWindows' and PartialAllreduce's

        def _close_tickets(self, round_: int) -> tuple[int, int]: ...
        def _extend(self, quorum: int, round_: int, period: float, step: float) -> tuple[int, int]: ...
        def _publish_ready(self, round_: int, record: np.ndarray) -> None: ...
        def _arrived(self, round_: int) -> int: ...
        def _late(self, round_: int) -> str: ...
        def _entry_at(self, round_: int) -> int: ...
        def _entry_state(self, round_: int) -> tuple[TagState, np.ndarray | None]: ...
        def _bit(self, rank: int) -> int: ...
        def _collect(self, quorum: int, round_: int, own: Flat | None, out: Flat | None = None) -> PartialResult: ...
        def _finish(
            self, quorum: int, round_: int, record: np.ndarray, mean: Flat, store: bool = True
        ) -> PartialResult: ...

    def _direct_round(
        self,
        data: Flat | None,
        quorum: int,
        round_: int,
        before: int,
        timing: tuple[float, float],
        out: Flat | None,
    ) -> tuple[np.ndarray, Flat]:
        """Steps 2-5 for a rank whose ticket counts, or (`data` None) one that came after the quorum-th arrival but
        before the close (a listener: dropped, it takes the mean's blocks with the contributors instead of waiting
        for the ring). `before`: the mask of the ranks that came before it; `timing`: its period and step, for the
        margin. Returns the record [quorum, count, ranks[count], listeners..., -1...] and the mean."""
        assert self.msgs is not None
        msgs, n = self.msgs, self.size
        record = np.full(2 + n, -1, dtype=np.int64)
        if data is not None and before.bit_count() == quorum - 1:  # the quorum-th arrival closes the round
            if self.margin is None:
                members = before | 1 << self.rank
                drawn = self._close_tickets(round_)[1]  # every ticket before the close: the rest listen
            else:
                drawn = members = self._extend(quorum, round_, *timing)[1]
            ranks = [r for r in range(n) if members >> r & 1]
            listeners = [r for r in range(n) if (drawn & ~members) >> r & 1]
            record[0], record[1], record[2 : 2 + len(ranks) + len(listeners)] = quorum, len(ranks), ranks + listeners
            others = [r for r in ranks + listeners if r != self.rank]
            posted = msgs.post([(record, r) for r in others], [], msgs.tag(round_, RECORD))
            msgs.wait(posted, self.timeout, lambda pending: self._unsent(round_, pending))
        else:
            msgs.receive_any(record, msgs.tag(round_, RECORD), self.timeout, lambda: self._unclosed(round_, quorum))
        count = int(record[1])
        ranks, listeners = [int(r) for r in record[2 : 2 + count]], [int(r) for r in record[2 + count :] if r >= 0]
        if (self.rank in ranks) != (data is not None):
            raise RuntimeError(
                f"{self._who}: partial allreduce: this rank's ticket in round {round_} and its contributors {ranks} "
                "disagree: ranks disagree on the quorum"
            )
        mean = torch.empty(self.numel, dtype=self.dtype) if out is None else out
        self._exchange(data, ranks, listeners, round_, mean)
        record[2 + count :] = -1  # the round's record names its contributors; the listeners were dropped
        if self.rank == writer_of(ranks, self.host, self._hosts):
            self._mark_read(ranks, round_)
            self._write_ring(mean, record, round_)
            inside = {*ranks, *listeners, *self.lost}
            assert msgs.deliveries is not None
            msgs.deliveries.send(round_, record, mean, [r for r in range(n) if r not in inside])
        return record, mean

    # -- a rank outside the round's exchange: its delivery (`mpi_partial_deliver`) ---------------------------------
    def _take_delivered(self, quorum: int, round_: int) -> PartialResult | None:
        """`try_read`: round `round_` from its delivery if it came (its ticket drawn with no answer), else None."""
        assert self.msgs is not None and self.msgs.deliveries is not None
        d = self.msgs.deliveries
        if (got := d.take(round_)) is None:
            self._flush_deferred(final=True)
            return None
        self._arrived_before = time.monotonic()  # this rank's arrival in `round_`, too late to count
        record, mean = got
        d.ticket[0] = self._bit(self.rank)
        target = (self._entry_at(round_), 1, self.MPI.INT64_T)
        self.win_ctrl.Accumulate([d.ticket, self.MPI.INT64_T], self.host, target=target, op=self.MPI.SUM)
        d.tickets_pending = True
        result = self._finish(quorum, round_, record, mean, store=False)
        if round_ + 1 not in d.arrived:
            self._flush_deferred(final=True)  # no backlog: the caller may compute, or stop, before its next call
        return result

    def _await_delivered(self, quorum: int, round_: int, out: Flat | None) -> PartialResult:
        """This rank's ticket came after the close of `round_`: wait for its delivery (local tests), looking at the
        ring every `_RING_AFTER_S` (a writer lost after the ring's copy sends nothing); `timeout` as any wait."""
        assert self.msgs is not None and self.msgs.deliveries is not None
        msgs, deliveries = self.msgs, self.msgs.deliveries
        looked = time.monotonic()

        def probe() -> PartialResult | None:  # the round, whichever way it came first
            nonlocal looked
            if (got := deliveries.take(round_)) is not None:
                record, mean = got
                return self._finish(quorum, round_, record, mean if out is None else out.copy_(mean))
            if time.monotonic() - looked >= _RING_AFTER_S:
                looked = time.monotonic()
                if self._entry_state(round_)[0] == READY:
                    return self._collect(quorum, round_, None, out)
            return None

        return msgs.until(probe, self.timeout, lambda: self._unclosed(round_, quorum))

    def _flush_deferred(self, final: bool = False) -> None:
        """Complete the tickets drawn with no answer, then write read[rank] (after them: MPI orders accumulates to
        one word, not two; the gate must not let a rank into an entry before them), completed too if `final` (a rank
        stopped then leaves both agreeing, as `mpi_partial_lost` needs), else by the next `Flush`."""
        assert self.msgs is not None and self.msgs.deliveries is not None
        d = self.msgs.deliveries
        if d.tickets_pending or d.read_pending:
            self.win_ctrl.Flush(self.host)  # also completes the last read counter's write: its buffer is free
            d.tickets_pending = d.read_pending = False
        if self._stored_read < self.round:
            d.read_word[0] = self.round  # its own buffer: in flight until the next Flush
            self._words.store_many(self._read + self.rank, d.read_word, flush=final, op=self.MPI.MAX)
            self._stored_read, d.read_pending = self.round, not final

    def _exchange(self, own: Flat | None, ranks: list[int], listeners: list[int], round_: int, mean: Flat) -> None:
        """Steps 3-4: this contributor's block of the sum (the parts in rank order), then every block of the mean,
        which the listeners receive too (`own` None: this rank is one of them)."""
        assert self.msgs is not None
        msgs, count = self.msgs, len(ranks)
        cuts = [(i * self.numel // count, (i + 1) * self.numel // count) for i in range(count)]
        dst = mean.numpy()
        peers = [(i, r) for i, r in enumerate(ranks) if r != self.rank]
        late_sum = lambda pending: self._unsummed_by(round_, pending, "sum")  # noqa: E731
        late_mean = lambda pending: self._unsummed_by(round_, pending, "mean")  # noqa: E731
        if own is None:  # a listener: every block of the mean from its contributor
            recvs = [(dst[cuts[i][0] : cuts[i][1]], r) for i, r in peers if cuts[i][1] > cuts[i][0]]
            msgs.wait(msgs.post([], recvs, msgs.tag(round_, MEAN)), self.timeout, late_mean, spin=self._spin)
            return
        me = ranks.index(self.rank)
        lo, hi = cuts[me]
        width = hi - lo
        if self._parts is None or self._parts.numel() < count * width:
            self._parts = torch.empty(count * width, dtype=self.dtype)
        parts = self._parts[: count * width].view(count, width)
        src = own.numpy()
        sends = [(src[cuts[i][0] : cuts[i][1]], r) for i, r in peers if cuts[i][1] > cuts[i][0]]
        recvs = [(parts[i].numpy(), r) for i, r in peers] if width else []
        msgs.wait(msgs.post(sends, recvs, msgs.tag(round_, SUM)), self.timeout, late_sum, spin=self._spin)
        if width:
            parts[me].copy_(own[lo:hi])
            total = parts[0]  # the host-summed path's additions, in the same order (`mpi_partial._sum_block`)
            for i in range(1, count):
                total.add_(parts[i])
            mean[lo:hi].copy_(total.div_(count))
        sends = [(dst[lo:hi], r) for r in [*ranks, *listeners] if r != self.rank] if width else []
        recvs = [(dst[cuts[i][0] : cuts[i][1]], r) for i, r in peers if cuts[i][1] > cuts[i][0]]
        msgs.wait(msgs.post(sends, recvs, msgs.tag(round_, MEAN)), self.timeout, late_mean, spin=self._spin)

    def _mark_read(self, ranks: list[int], round_: int) -> None:
        """Step 6 for every contributor, by the writer: read[r] <- round_ + 1 in one `Accumulate(MAX)`, completed by
        the ring's `Flush`. A contributor holds the mean from the exchange and never reads the ring's entry, so it is
        done with it; writing its own word was a round trip to the host that, across hosts, completed only once the
        host next entered MPI (it computes meanwhile): a contributor on another host waited for the host's compute
        every round (benchmarks/README.md, "Backup's read counters")."""
        self._reads[:] = -1  # MAX with -1 leaves a word alone
        self._reads[ranks] = round_ + 1
        self._words.store_many(self._read, self._reads, flush=False, op=self.MPI.MAX)

    def _write_ring(self, mean: Flat, record: np.ndarray, round_: int) -> None:
        """Step 5: the mean into the host's ring (flushed), then tag 'ready' and the record in one write."""
        target = ((round_ % self.depth) * self.numel, self.numel, self._mpi_t)
        self.win_ring.Put([mean.numpy(), self._mpi_t], self.host, target=target)
        self.win_ring.Flush(self.host)
        count = int(record[1])
        self._publish_ready(round_, np.concatenate(([count], record)))  # blocks: every block is there

    def _unclosed(self, round_: int, quorum: int) -> str:
        arrived = self._arrived(round_)
        return (
            f"{self._who}: partial allreduce: round {round_} incomplete: {max(arrived, 0)} of {self.size} ranks "
            f"arrived, {quorum=}" + self._late(round_)
        )

    def _unsent(self, round_: int, pending: list[Pending]) -> str:
        named = ", ".join(f"rank {m.peer} on {self._hosts[m.peer]}" for m in pending)
        return f"{self._who}: partial allreduce: round {round_}'s record was not taken by {named or 'its contributors'}"

    def _unsummed_by(self, round_: int, pending: list[Pending], phase: str) -> str:
        """A data phase timed out: name each peer whose message is still pending, and which way (a block not
        received from it, or one of this rank's not taken by it)."""
        ways: dict[int, list[str]] = {}
        for m in pending:
            way = f"this rank's block of the {phase} not taken" if m.send else f"its block of the {phase} not received"
            ways.setdefault(m.peer, []).append(way)
        named = "; ".join(f"rank {r} on {self._hosts[r]} ({', '.join(w)})" for r, w in ways.items())
        return (
            f"{self._who}: partial allreduce: round {round_} is being summed: waiting on {named or 'its contributors'}"
        )
