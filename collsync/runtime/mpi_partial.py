"""k-of-n partial allreduce on MPI one-sided windows: the first `quorum` contributions of a round are averaged.

Backup workers (000_..., Chen et al., "Revisiting Distributed Synchronous SGD", Alg. 3-4) run N + b workers and
update with the first N gradients of step t; the b later ones are dropped. Serverless, every rank holds a replica
of the server, and this primitive hands every rank the same mean for round t, the ranks it came from
(`contributors`, the first `quorum` to arrive) and the others (`dropped`: every rank not among the first `quorum`,
whether it arrived late or had not arrived yet when the round completed, so the lists are the same on every rank).
`quorum` = n is a full allreduce mean (the sum of all n contributions in rank order, divided by n).

Windows, all hosted by rank `host` (the others expose zero bytes; `mpi_partial_windows` holds them, their
encodings and the waits, and this module the rounds); `depth` rounds of results live in a ring:

    slots  float[n * numel]       one contribution slot per rank (holds that rank's latest counted contribution)
    ring   float[depth * numel]   the mean of round t in entry t % depth
    ctrl   int64[depth * (5 + n) + 4 * n]
           per ring entry: [tickets, tag, blocks, quorum, count, ranks[n]]   (ranks: the sorted contributors, -1
           padded; blocks: how many of the round's blocks are summed; each record word stamped with its round,
           `mpi_partial_windows.stamp`, so that one read of tag and record can tell a record not yet all there)
           then posted[n] (the round whose contribution sits in rank r's slot), read[n] (rounds rank r has read),
           summed[n] (the last round whose block rank r summed: a timeout names a contributor that stopped),
           waited[n] (the last full-quorum round in which rank r timed out: the roll call below)

Every access, the host's to its own memory included, is an RMA call inside one `Lock_all` epoch completed with
`Flush` (on MPICH a per-operation `Lock` waits until the target enters MPI; `Lock_all` + `Flush` does not). Control
words are only touched by atomics (`Fetch_and_op`, `Get_accumulate`/`Accumulate` with NO_OP/REPLACE), so a word
is never read half-written. One round t at rank r:

1. gate: wait until every rank has read round t - depth (min read >= t - depth + 1): entry t % depth is free.
2. ticket: `Fetch_and_op(SUM, 1)` on the entry's `tickets`; minus (n + CLOSED) per earlier round of this entry (every
   rank takes exactly one ticket per round, the closer adds CLOSED once, and the gate orders rounds t - depth and
   t), it is r's arrival order in round t, plus CLOSED if the round was closed before it.
3. ticket < quorum (or, with a margin, any ticket drawn before the close): Put the contribution into slot r, Flush,
   then posted[r] <- t. The Flush before the flag is what guarantees nobody sees the flag before the data.
4. ticket = quorum - 1 (the quorum-th arrival) closes the round: `Fetch_and_op(SUM, CLOSED)` on `tickets` (at once,
   or after the margin below), whose answer is how many tickets came before it (the count: `quorum` without a
   margin); waits until that many ranks posted round t, then writes tag <- "summing t" and the record (blocks <- 0,
   quorum, count, ranks), stamped with t, in one `Accumulate(REPLACE)` and one Flush.
5. each contributor, on seeing "summing t" with a record all stamped t (tag and record in one `Get_accumulate`: MPI
   makes each word atomic, not the words together, so a record not yet all there reads as pending), sums its block:
   the vector is cut into `count` blocks, and the i-th
   contributor (in rank order) Gets block i of every counted slot, adds them in rank order (so the bits depend
   neither on arrival order nor on the cut: each element is the same additions as one rank summing it all),
   divides by `count`, Puts it into the ring, Flush, then summed[r] <- t and `blocks += 1` under one Flush; whoever
   makes it `count` sets tag <- t.
   The sum is spread over the contributors as `MPI_Allreduce`'s reduce-scatter spreads it, instead of one rank
   copying 2 * quorum vectors while the others wait.
6. everyone reads: wait for tag = t (its record read with it, as in 5); Get the mean; Flush; re-read tag (a
   seqlock). If the tag moved, the entry was reused while being read: a `RuntimeError`, never a silently torn mean.
   Then read[r] <- t + 1.

Each rank reads every round's mean exactly once and in order, so replicas that apply the means stay bit-identical.

A margin (`margin=`, the same on every rank): without one, a round averages exactly the first `quorum` arrivals
and drops the n - quorum others even when they are a moment behind (000_...'s backup workers, b = n - quorum). With
one, the quorum-th arrival waits up to `margin` seconds (a number), or up to `margin.Margin`'s limit from the
arrivals it measured in earlier rounds ("auto"), for the others to draw tickets, then closes; every rank that drew
a ticket before the close posts and is counted, those after it are dropped. The close is one atomic on the same
word as the tickets, so a rank knows from its own ticket whether it counts, and membership is decided once, by the
protocol, as without a margin: the contributors, their number (the divisor) and the mean are the same on every
rank. Only the waiting differs between ranks' estimates, never what they read.

Full quorum (`quorum` = n, what `sync=bsp` and backup b = 0 ask for): nobody can be dropped or late, so the round
needs neither the host's slots and ring nor its control words: it is one allreduce over a duplicate of `comm`
(`MPI_Allreduce` without a `timeout`; with one, an `MPI_Iallreduce` waited for up to it). MPI's algorithms move
2 (n - 1) / n of the vector per rank straight between the ranks; the host-held path copies every contribution in
and the mean out through one rank's memory (1.3-1.7x `MPI_Allreduce` at 4 MiB and 4 ranks, against 1.0-1.1x:
benchmarks/mpi_partial_allreduce.py). Full and partial rounds still mix freely, at no atomic cost to the full ones:
- tickets: every rank knows which rounds were full (the quorum of a round is the same on every rank), so it counts
  per ring entry the full rounds that took no tickets, and the arrival arithmetic subtracts only the others;
- read[r]: written lazily, at the start of this rank's next partial call (before anything there can wait), so a
  gate never waits on a word that a rank past its full rounds has not yet brought up to date;
- the gate: a completed full round t proves every rank had read round t - 1.
The sum is in MPI's order: the same bits on every rank, not necessarily the rank-order sum of the partial rounds.
A collective cannot say which rank it waits for, so a timeout calls the roll: each rank that timed out in round t
writes waited[r] <- t and gives the others up to `timeout` to do the same; the ranks that never answered (not in the
allreduce, or stopped inside it) are named. The allreduce stays posted (MPI cannot cancel a collective), so the
object refuses further rounds. Ranks that disagree on whether round t is full end in that timeout, not in an error
naming the quorum.

Falling behind: the ring holds the last `depth` rounds, so a rank up to `depth` rounds behind reads the means it
missed, in order (`try_read` returns a completed round without contributing: a backup worker that is late need not
compute a gradient that would be dropped anyway). A rank more than `depth` rounds behind *blocks* the fast ranks at
step 1 until it has read the round whose entry they need. Blocking, not an error, because the alternative loses
state for good: once a mean is overwritten, the lagging replica can no longer apply it and would have to be
re-sent the whole server state (parameters and every rule state); an exception would turn a transient straggler
into a failed run. So the fast ranks lead the slowest reader by at most `depth` rounds (SSP-like flow control,
004_... §II-C, with bound `depth`), and a straggler costs them nothing while it stays within that lead.

With `timeout` set, any wait longer than `timeout` seconds raises `TimeoutError` naming what it waited for (at the
gate: the lagging ranks and the rounds they have read; for a round: how many ranks had arrived). A timeout in the
gate leaves the protocol intact (no ticket was taken), so the call may be retried; one while waiting for a round to
complete is final (the ticket is spent): stop the run.

`quorum` must be the same on every rank for a round (as a collective's count); the combiner records, readers check it.

Memory on the host: (n + depth) * numel floats (the direct exchange: depth * numel). Calls are made in round order
0, 1, 2, ... on every rank. `protocol="direct"` (up to 40 ranks) moves a round's contributions between its
contributors, not through the slots (steps 3-5; `mpi_partial_direct`: 1.2-1.4x an `MPI_Allreduce` across hosts at
quorum n - 1, `protocol="host"` 2.3-2.7x); `"auto"` (the default, `runtime.protocol`) takes it where the ranks span
hosts, else the host path, whose copies go through shared memory (`mpi_partial_direct.direct_protocol`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from collsync.runtime import PartialResult
from collsync.runtime.mpi_coll import wait
from collsync.runtime.mpi_partial_direct import DirectRounds
from collsync.runtime.mpi_partial_tags import OVERWRITTEN, READY, STAMP, SUMMING, stamp, tag_state, writing_tag
from collsync.runtime.mpi_partial_windows import PartialWindows, _posted_for, block, check_call, check_out, split
from collsync.runtime.mpi_world import RankLost
from collsync.types import Flat

__all__ = ["PartialAllreduce", "PartialResult"]


class PartialAllreduce(DirectRounds, PartialWindows):
    """Collective constructor over `comm` (every rank calls it, then every rank calls rounds 0, 1, 2, ... in order).

    `pa(tensor, quorum=k, round=t)` contributes `tensor` to round t and returns round t's `PartialResult`;
    `pa.try_read(quorum=k, round=t)` returns it without contributing if round t is already complete (else None).
    `depth` rounds of results are kept (see the module docstring for what a rank further behind does); `timeout`
    (seconds, None = wait for ever) bounds every wait; `margin` (None, seconds, or "auto") is how long a round waits
    after its quorum-th arrival for the others (module docstring), and a result's `quorum` is then the number of
    contributions averaged. `free()` (collective) releases the windows. `watch=True` (ULFM): see `mpi_partial_lost`.
    """

    _previous = False  # whether the last round read took every live rank (`Margin.paced`)
    _closed_round = -2  # the last round this rank closed with the auto margin

    # -- one round -------------------------------------------------------------------------------------------------
    def __call__(self, tensor: Flat, quorum: int, round: int, *, out: Flat | None = None) -> PartialResult:
        """Contribute `tensor` to round `round`; return the round's mean (first `quorum` contributions, rank order).
        The mean is a new tensor, or `out` (numel elements of the dtype, not `tensor`) overwritten: no allocation."""
        now = time.monotonic()
        self._check_not_stranded()
        check_call(self.numel, self.size, self.round, round, quorum, tensor)
        period, self._arrived_before = now - self._arrived_before, now  # since this rank's arrival a round ago
        if self._closed_round == round - 1:  # the round this rank closed: its period
            self._margin.paced(period, self._previous)
        step = now - self._read_at  # its own step: from the last mean it read to this arrival
        if out is not None:  # checked before the round starts: a ticket taken cannot be given back
            check_out(out, self.numel, self.dtype)
        if quorum == self.size > 1:
            return self._full(tensor, round, out)
        if self.tolerate:
            self._check_not_lost()
        if self.direct:
            self._flush_deferred()
        self._publish_read()
        data = tensor.detach().to(self.dtype).contiguous()
        self._gate(round)
        index, closed, before = self._ticket(round)
        if self.direct and index >= quorum and self.margin is None and not closed:  # dropped, before the close
            return self._finish(quorum, round, *self._direct_round(None, quorum, round, before, (period, step), out))
        if index >= quorum and (self.margin is None or closed):
            return self._await_delivered(quorum, round, out) if self.direct else self._collect(quorum, round, None, out)
        if self.direct:
            record, mean = self._direct_round(data, quorum, round, before, (period, step), out)
            # Its read[] is the writer's to mark (`DirectRounds._mark_read`): no round trip to the host here.
            result = self._finish(quorum, round, record, mean, store=False)
            self._stored_read = max(self._stored_read, round + 1)
            return result
        self._post(data, round)
        if index == quorum - 1:
            self._close(quorum, round, period, step)
        return self._collect(quorum, round, data, out)

    def try_read(self, quorum: int, round: int) -> PartialResult | None:
        """Round `round`'s result if it is already complete (this rank is then among the dropped), else None."""
        self._check_not_stranded()
        check_call(self.numel, self.size, self.round, round, quorum, None)
        if self.tolerate:
            self._check_not_lost()
        if self.direct:  # its delivery, or None: no round trip (`mpi_partial_deliver`)
            return self._take_delivered(quorum, round)
        if tag_state(self._load(self._entry_at(round) + 1), round) != READY:
            return None
        self._arrived_before = time.monotonic()  # this rank's arrival in `round`, too late to count
        # A complete round passed its gate, so the ticket arithmetic holds without waiting here.
        index, closed, _ = self._ticket(round)
        if index < quorum or not closed:
            raise RuntimeError(
                f"{self._who}: partial allreduce: round {round} was complete but this rank drew arrival {index} < "
                f"{quorum=}: ranks disagree on the quorum of round {round}"
            )
        return self._collect(quorum, round, None)

    def stop_reading(self) -> None:
        """The caller reads no further round for now (`runtime.Partial.stop_reading`): the direct exchange's reads
        from deliveries leave their tickets and read counter to the next read while a backlog lasts (one Flush for
        all of it, `_flush_deferred`); a caller that stops inside the backlog (its room, an epoch's end) completes
        them here, or a rank stopped before its next call (SIGSTOP) would leave the gate and the lost-rank rules a
        read counter behind its rounds. No round trip when nothing is left (the host-summed path: never)."""
        if self.direct:
            self._flush_deferred(final=True)

    def _post(self, data: Flat, round_: int) -> None:
        """Step 3: data into this rank's slot, Flush, and only then the flag that says which round it belongs to."""
        target = (self.rank * self.numel, self.numel, self._mpi_t)
        self.win_slots.Put([data.numpy(), self._mpi_t], self.host, target=target)
        self.win_slots.Flush(self.host)
        self._store(self._posted + self.rank, round_)

    def _close(self, quorum: int, round_: int, period: float, step: float) -> None:
        """Step 4 (the quorum-th arrival, `period` s after its arrival in the round before and `step` s after it
        read that round's mean): close the round's tickets (after the margin, if any); once every rank that drew one
        before the close posted, record who they are; tag 'summing'."""
        count = quorum
        if self.margin is None:
            self._close_tickets(round_)
        else:
            count = self._extend(quorum, round_, period, step)[0]
        ranks = self._poll(
            lambda: _posted_for(self._load_many(self._posted, self.size), round_, count),
            lambda: (
                f"round {round_} combines, but fewer than {count} ranks have posted their data" + self._late(round_)
            ),
        )
        record = np.full(3 + self.size, -1, dtype=np.int64)
        record[0], record[1], record[2], record[3 : 3 + count] = 0, quorum, count, ranks
        # Tag and record in one write (blocks <- 0: the entry's last round is read by all, the gate): a reader
        # takes the record only once every word of it is stamped with this round (`_entry_state`).
        words = np.concatenate((np.array([writing_tag(round_)], dtype=np.int64), stamp(round_, record)))
        self._store_many(self._entry_at(round_) + 1, words)

    def _extend(self, quorum: int, round_: int, period: float, step: float) -> tuple[int, int]:
        """Step 4 with a margin: wait up to it (`Margin.limit` for "auto") for the ranks that have not drawn a
        ticket, close, and return how many drew one before the close (all of them count) and, direct exchange,
        the mask of their ranks."""
        margin, auto = self.margin, False
        if isinstance(margin, (int, float)):
            limit = float(margin)
        else:  # "auto" (None never comes here: it closes at once)
            # Waiting weighed against closing at once only across hosts, where a late rank's exchange crosses its link.
            workers = self.size - len(self.lost) if self.direct else None
            limit, auto = self._margin.limit(period, quorum, step, workers), True
            self._closed_round = round_
        start = last = time.monotonic()
        seen, backoff = quorum, self._backoff
        backoff.reset()
        while True:
            arrived = self._arrived(round_)
            now = time.monotonic()
            if arrived > seen:
                seen, last = arrived, now
            if seen >= self.size - len(self.lost) or now - start >= limit:
                break
            backoff.wait()
        count, mask = self._close_tickets(round_)
        if auto:
            self._margin.observe(last - start, count == self.size, limit)
        return count, mask

    def _sum_block(self, own: Flat, round_: int, record: np.ndarray) -> None:
        """Step 5: sum this contributor's block of the counted slots in rank order, Put it, count it; the last block
        done makes the round complete. `record`: the entry's, read with the tag that said 'summing'."""
        entry = self._entry_at(round_)
        count = int(record[2])  # the quorum, or more with a margin
        ranks = [int(r) for r in record[3 : 3 + count]]
        if self.rank not in ranks:
            raise RuntimeError(
                f"{self._who}: partial allreduce: this rank posted round {round_} but is not among its "
                f"contributors {ranks}: ranks disagree on the quorum"
            )
        lo, hi = block(ranks.index(self.rank), count, self.numel)
        width = hi - lo
        if width:
            if self._parts is None or self._parts.numel() < count * width:
                self._parts = torch.empty(count * width, dtype=self.dtype)
            parts = self._parts[: count * width].view(count, width)
            for i, r in enumerate(ranks):  # every Get first, one Flush for all
                if r != self.rank:
                    target = (r * self.numel + lo, width, self._mpi_t)
                    self.win_slots.Get([parts[i].numpy(), self._mpi_t], self.host, target=target)
            self.win_slots.Flush(self.host)
            parts[ranks.index(self.rank)].copy_(own[lo:hi])
            mean = parts[0]  # the same additions, in the same order, as one rank summing the whole vector
            for i in range(1, count):
                mean.add_(parts[i])
            mean.div_(count)
            target = ((round_ % self.depth) * self.numel + lo, width, self._mpi_t)
            self.win_ring.Put([mean.numpy(), self._mpi_t], self.host, target=target)
            self.win_ring.Flush(self.host)
        # summed[r] only names a stopped contributor in a timeout's message: it needs no Flush of its own, the
        # count's completes both (the block's Put was flushed before either, so a count never runs ahead of it).
        self._words.store_many(self._summed + self.rank, np.array([round_], dtype=np.int64), flush=False)
        if self._fetch(entry + 2, 1, self.MPI.SUM) == round_ * STAMP + 2 + count - 1:
            self._store(entry + 1, round_)

    def _full(self, tensor: Flat, round_: int, out: Flat | None) -> PartialResult:
        """A full-quorum round: one allreduce, no control word touched (module docstring)."""
        data = tensor.detach().reshape(-1)
        mean = data.to(self.dtype, copy=True) if out is None else out.copy_(data)  # the caller's tensor stays as it was
        buffer = [mean.numpy(), self._mpi_t]
        if self.timeout is None:
            self._full_comm.Allreduce(self.MPI.IN_PLACE, buffer, op=self.MPI.SUM)
            return self._full_done(mean, round_)
        request = self._full_comm.Iallreduce(self.MPI.IN_PLACE, buffer, op=self.MPI.SUM)
        try:
            wait(request, self.timeout, f"round {round_}'s allreduce")
        except TimeoutError:
            # The allreduce stays posted (MPI cannot cancel a collective) and a late rank may still complete it,
            # writing into `mean`: both must outlive this object.
            _STRANDED.append((request, mean))
            self._stranded = round_
            raise RankLost(self._roll_call(round_)) from None
        return self._full_done(mean, round_)

    def _full_done(self, mean: Flat, round_: int) -> PartialResult:  # the bookkeeping after a full round
        mean.div_(self.size)
        self._full_rounds[round_ % self.depth] += 1
        self._previous = True
        self._floor = max(self._floor, round_)  # every rank entered round_, so every rank had read round_ - 1
        self.round = round_ + 1
        self._read_at = time.monotonic()
        return PartialResult(mean, round_, self.size, list(range(self.size)), [])

    def _collect(self, quorum: int, round_: int, own: Flat | None, out: Flat | None = None) -> PartialResult:
        """Steps 5-6: wait for the round (summing this rank's block on the way if `own`, its contribution, was
        counted), read record and mean, re-check the tag (torn reads fail loudly)."""
        entry = self._entry_at(round_)
        tag = entry + 1
        helping = own

        def probe() -> np.ndarray | None:
            nonlocal helping
            state, record = self._entry_state(round_)
            if state == OVERWRITTEN:
                raise RuntimeError(self._overwritten(round_))
            if state == SUMMING and helping is not None and record is not None:
                self._sum_block(helping, round_, record)
                helping = None
                return self._collect_ready(round_)
            return record if state == READY else None

        def describe() -> str:
            state, record = self._entry_state(round_)
            if state == SUMMING and record is not None:
                done, count = int(record[0]), int(record[2])
                return f"round {round_} is being summed: {done} of {count} blocks done" + self._unsummed(round_)
            arrived = self._arrived(round_)
            return f"round {round_} incomplete: {max(arrived, 0)} of {self.size} ranks arrived, {quorum=}" + self._late(
                round_
            )

        record = self._poll(probe, describe)[1:]  # [quorum, count, ranks[n]], read with the tag that said 'ready'
        mean = torch.empty(self.numel, dtype=self.dtype) if out is None else out
        target = ((round_ % self.depth) * self.numel, self.numel, self._mpi_t)
        self.win_ring.Get([mean.numpy(), self._mpi_t], self.host, target=target)
        self.win_ring.Flush(self.host)
        if tag_state(self._load(tag), round_) != READY:
            raise RuntimeError(self._overwritten(round_) + " (while it was being read)")
        return self._finish(quorum, round_, record, mean)

    def _finish(self, quorum: int, round_: int, record: np.ndarray, mean: Flat, store: bool = True) -> PartialResult:
        """Check the round's `record` ([quorum, count, ranks[n]]), mark it read (the gate; `store` False: later, by
        `_flush_deferred`), return its result."""
        if int(record[0]) != quorum:
            raise ValueError(
                f"{self._who}: partial allreduce: round {round_} ran with quorum={int(record[0])}, "
                f"this rank asked for {quorum=}: every rank must pass the same quorum"
            )
        contributors, dropped = split([int(r) for r in record[2 : 2 + int(record[1])]], self.size)
        self._previous = len(contributors) >= self.size - len(self.lost)
        if store:
            self._store_read(self.rank, round_ + 1)
            self._stored_read = round_ + 1
        self.round = round_ + 1
        if self.lost:
            self._read_for_lost()
        self._read_at = time.monotonic()
        return PartialResult(mean, round_, len(contributors), contributors, dropped)

    def _collect_ready(self, round_: int) -> np.ndarray | None:
        """After summing a block: the round's record if it is complete already (this was its last block)."""
        self._backoff.reset()  # the others' blocks are as fast as this one: poll promptly again
        state, record = self._entry_state(round_)
        return record if state == READY else None


# Full rounds' allreduces abandoned by a timeout, with their buffers: MPI may still complete them (a late rank joins)
# and write the buffer, so neither may be freed while the process lives. One entry per timeout, which ends a run.
_STRANDED: list[tuple[Any, Flat]] = []
