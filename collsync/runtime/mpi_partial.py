"""k-of-n partial allreduce on MPI one-sided windows: the first `quorum` contributions of a round are averaged.

Backup workers (000_..., Chen et al., "Revisiting Distributed Synchronous SGD", Alg. 3-4) run N + b workers and
update with the first N gradients of step t; the b later ones are dropped. Serverless, every rank holds a replica
of the server, and this primitive hands every rank the same mean for round t, the ranks it came from
(`contributors`, the first `quorum` to arrive) and the others (`dropped`: every rank not among the first `quorum`,
whether it arrived late or had not arrived yet when the round completed, so the lists are the same on every rank).
`quorum` = n is a full allreduce mean (the sum of all n contributions in rank order, divided by n).

Windows, all hosted by rank `host` (the others expose zero bytes); `depth` rounds of results live in a ring:

    slots  float[n * numel]       one contribution slot per rank (holds that rank's latest counted contribution)
    ring   float[depth * numel]   the mean of round t in entry t % depth
    ctrl   int64[depth * (5 + n) + 3 * n]
           per ring entry: [tickets, tag, blocks, quorum, count, ranks[n]]   (ranks: the sorted contributors, -1
           padded; blocks: how many of the round's blocks are summed)
           then posted[n] (the round whose contribution sits in rank r's slot), read[n] (rounds rank r has read),
           summed[n] (the last round whose block rank r summed: a timeout names a contributor that stopped)

Every access, the host's to its own memory included, is an RMA call inside one `Lock_all` epoch completed with
`Flush` (on MPICH a per-operation `Lock` waits until the target enters MPI; `Lock_all` + `Flush` does not). Control
words are only touched by atomics (`Fetch_and_op`, `Get_accumulate`/`Accumulate` with NO_OP/REPLACE), so a word
is never read half-written. One round t at rank r:

1. gate: wait until every rank has read round t - depth (min read >= t - depth + 1): entry t % depth is free.
2. ticket: `Fetch_and_op(SUM, 1)` on the entry's `tickets`; minus n per earlier round of this entry (every rank takes
   exactly one ticket per round, and the gate orders rounds t - depth and t), it is r's arrival order in round t.
3. ticket < quorum: Put the contribution into slot r, Flush, then posted[r] <- t. The Flush before the flag is what
   guarantees nobody sees the flag before the data.
4. ticket = quorum - 1 (the last counted arrival) closes the round: waits until `quorum` ranks posted round t,
   writes the record (blocks <- 0, quorum, count, ranks), Flush, then tag <- "summing t".
5. each contributor, on seeing "summing t", sums its block: the vector is cut into `quorum` blocks, and the i-th
   contributor (in rank order) Gets block i of every counted slot, adds them in rank order (so the bits depend
   neither on arrival order nor on the cut: each element is the same additions as one rank summing it all),
   divides by `quorum`, Puts it into the ring, Flush, then summed[r] <- t and `blocks += 1`; whoever makes it
   `quorum` sets tag <- t.
   The sum is spread over the contributors as `MPI_Allreduce`'s reduce-scatter spreads it, instead of one rank
   copying 2 * quorum vectors while the others wait.
6. everyone reads: wait for tag = t; Get record and mean; Flush; re-read tag (a seqlock). If the tag moved, the
   entry was reused while being read: a `RuntimeError`, never a silently torn mean. Then read[r] <- t + 1.

Each rank reads every round's mean exactly once and in order, so replicas that apply the means stay bit-identical.

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

`quorum` must be the same on every rank for a round (like the count of a collective); the combining rank records it
and every reader checks it.

Memory on the host: (n + depth) * numel floats. Calls are made in round order 0, 1, 2, ... on every rank.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from collsync.runtime import PartialResult
from collsync.runtime.mpi_rma import Backoff, Windows, poll_cap
from collsync.types import Flat

T = TypeVar("T")

_EMPTY = -1  # the tag of a ring entry no round has used yet
_ENTRY_HEAD = 5  # tickets, tag, blocks, quorum, count (then ranks[n])

PENDING, SUMMING, READY, OVERWRITTEN = "pending", "summing", "ready", "overwritten"


# -- pure helpers (no MPI): the encodings the protocol relies on ----------------------------------------------------
def writing_tag(round_: int) -> int:
    """The tag of an entry whose mean for `round_` is being summed (its contributors known, each summing a block):
    negative, distinct from `_EMPTY`."""
    return -2 - round_


def tag_state(tag: int, round_: int) -> str:
    """What an entry's tag says to a reader of `round_`: PENDING (its quorum not yet in), SUMMING (the contributors
    are summing their blocks), READY, or OVERWRITTEN (the entry has moved on to a later round: the mean is gone)."""
    if tag == _EMPTY:
        return PENDING
    complete = tag >= 0
    holds = tag if complete else -2 - tag
    if holds > round_:
        return OVERWRITTEN
    if holds < round_:
        return PENDING
    return READY if complete else SUMMING


def block(index: int, parts: int, numel: int) -> tuple[int, int]:
    """[start, stop) of block `index` of `parts` nearly equal contiguous blocks of 0..numel-1 (some empty when
    numel < parts)."""
    return index * numel // parts, (index + 1) * numel // parts


def arrival_index(ticket: int, round_: int, depth: int, size: int) -> int:
    """A rank's arrival order in `round_` from the entry's cumulative ticket counter: each of the round // depth
    earlier rounds of this entry took exactly `size` tickets, all before the first of this round (the gate)."""
    return ticket - (round_ // depth) * size


def split(contributors: Sequence[int], size: int) -> tuple[list[int], list[int]]:
    """(contributors sorted, every other rank of 0..size-1 sorted): the lists every rank reports for a round."""
    counted = sorted(contributors)
    chosen = set(counted)
    return counted, [r for r in range(size) if r not in chosen]


def lagging(read: Sequence[int], round_: int, depth: int) -> list[int]:
    """Ranks that have not read round `round_ - depth` yet, so `round_` may not reuse its ring entry."""
    return [r for r, n in enumerate(read) if n < round_ - depth + 1]


def check_call(numel: int, size: int, expected_round: int, got: int, quorum: int, tensor: Flat | None) -> None:
    """Reject a call that would break the protocol, naming the value."""
    if got != expected_round:
        raise ValueError(f"partial allreduce: round={got}, expected round={expected_round} (rounds go 0, 1, 2, ...)")
    if not 1 <= quorum <= size:
        raise ValueError(f"partial allreduce: {quorum=} must be in 1..{size} (the world size)")
    if tensor is not None and tensor.numel() != numel:
        raise ValueError(f"partial allreduce: tensor has {tensor.numel()} elements, the windows hold {numel=}")


class PartialAllreduce(Windows):
    """Collective constructor over `comm` (every rank calls it, then every rank calls rounds 0, 1, 2, ... in order).

    `pa(tensor, quorum=k, round=t)` contributes `tensor` to round t and returns round t's `PartialResult`;
    `pa.try_read(quorum=k, round=t)` returns it without contributing if round t is already complete (else None).
    `depth` rounds of results are kept (see the module docstring for what a rank further behind does); `timeout`
    (seconds, None = wait for ever) bounds every wait. `free()` (collective) releases the windows.
    """

    def __init__(
        self,
        comm: Any,
        numel: int,
        *,
        dtype: torch.dtype = torch.float32,
        depth: int = 8,
        host: int = 0,
        timeout: float | None = None,
    ) -> None:
        from mpi4py import MPI

        from collsync.runtime.mpi_world import rank_prefix

        size, rank = comm.Get_size(), comm.Get_rank()
        _check_args(numel, dtype, depth, host, size, timeout)
        self.MPI, self.comm = MPI, comm
        self.numel, self.dtype, self.depth, self.host, self.timeout = numel, dtype, depth, host, timeout
        self.size, self.rank = size, rank
        self.round = 0  # the next round this rank reads
        self._parts: Flat | None = None  # a contributor's block of each counted slot (see `_sum_block`), kept
        self._who = rank_prefix(comm)
        self._hosts: list[str] = comm.allgather(socket.gethostname())  # so a timeout names a late rank's host
        self._np = np.float32 if dtype == torch.float32 else np.float64
        self._mpi_t = MPI.FLOAT if dtype == torch.float32 else MPI.DOUBLE
        self._entry = _ENTRY_HEAD + size
        self._posted = depth * self._entry
        self._read = self._posted + size
        self._summed = self._read + size
        self._wins = self._allocate(rank == host)
        self.win_slots, self.win_ring, self.win_ctrl = self._wins
        self._floor = 0  # a lower bound on every rank's read counter (saves polling the gate)
        self._one = np.ones(1, dtype=np.int64)
        self._val = np.zeros(1, dtype=np.int64)
        self._res = np.zeros(1, dtype=np.int64)
        self._backoff = Backoff(cap=poll_cap(comm))

    # -- set-up and tear-down --------------------------------------------------------------------------------------
    def _allocate(self, hosting: bool) -> tuple[Any, Any, Any]:
        MPI, item = self.MPI, np.dtype(self._np).itemsize
        words = self._summed + self.size
        slots = MPI.Win.Allocate(self.size * self.numel * item if hosting else 0, item, comm=self.comm)
        ring = MPI.Win.Allocate(self.depth * self.numel * item if hosting else 0, item, comm=self.comm)
        ctrl = MPI.Win.Allocate(words * 8 if hosting else 0, 8, comm=self.comm)
        if hosting:
            # Before the epoch opens, the host may write its memory directly: no one can access it yet.
            for win in (slots, ring):
                np.frombuffer(win.tomemory(), dtype=np.uint8)[:] = 0
            words_ = np.frombuffer(ctrl.tomemory(), dtype=np.int64)
            words_[:] = 0
            words_[1 : self._posted : self._entry] = _EMPTY  # every entry's tag
            words_[self._posted : self._read] = -1  # no rank has posted any round
            words_[self._summed :] = -1  # nor summed a block of one
        self.comm.Barrier()  # initialised memory is in place before anyone reads it
        for win in (slots, ring, ctrl):
            win.Lock_all()
        return slots, ring, ctrl

    # -- control words (atomics, each completed by a Flush) --------------------------------------------------------
    def _fetch(self, disp: int, value: int, op: Any) -> int:
        self._val[0] = value
        self.win_ctrl.Fetch_and_op(self._val, self._res, self.host, disp, op=op)
        self.win_ctrl.Flush(self.host)
        return int(self._res[0])

    def _load(self, disp: int) -> int:
        return self._fetch(disp, 0, self.MPI.NO_OP)

    def _store(self, disp: int, value: int) -> None:
        self._fetch(disp, value, self.MPI.REPLACE)

    def _load_many(self, disp: int, count: int) -> np.ndarray:
        """`count` words, each read atomically, in one Get_accumulate (not `count` round trips)."""
        out = np.empty(count, dtype=np.int64)
        target = (disp, count, self.MPI.INT64_T)
        self.win_ctrl.Get_accumulate(
            [np.zeros(count, dtype=np.int64), self.MPI.INT64_T],
            [out, self.MPI.INT64_T],
            self.host,
            target=target,
            op=self.MPI.NO_OP,
        )
        self.win_ctrl.Flush(self.host)
        return out

    def _store_many(self, disp: int, values: np.ndarray) -> None:
        target = (disp, len(values), self.MPI.INT64_T)
        self.win_ctrl.Accumulate([values, self.MPI.INT64_T], self.host, target=target, op=self.MPI.REPLACE)
        self.win_ctrl.Flush(self.host)

    def _entry_at(self, round_: int) -> int:
        return (round_ % self.depth) * self._entry

    # -- waiting ---------------------------------------------------------------------------------------------------
    def _poll(self, probe: Callable[[], T | None], describe: Callable[[], str]) -> T:
        """Poll with backoff (ranks share cores) until `probe` answers; after `timeout` s, fail naming the cause."""
        backoff = self._backoff
        backoff.reset()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            got = probe()
            if got is not None:
                return got
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self._who}: partial allreduce: {describe()} after timeout={self.timeout}s")
            backoff.wait()

    def _gate(self, round_: int) -> None:
        """Step 1: the ring entry of `round_` is free once every rank has read round `round_ - depth`."""
        need = round_ - self.depth + 1
        if self._floor >= need:
            return
        read = np.zeros(self.size, dtype=np.int64)

        def probe() -> bool | None:
            read[:] = self._load_many(self._read, self.size)
            self._floor = int(read.min())
            return True if self._floor >= need else None

        def describe() -> str:
            late = lagging(read.tolist(), round_, self.depth)
            behind = ", ".join(f"rank {r} has read up to round {int(read[r]) - 1}" for r in late)
            return (
                f"round {round_} waits for ranks {late} to read round {round_ - self.depth} ({behind}; {self.depth=})"
            )

        self._poll(probe, describe)

    # -- one round -------------------------------------------------------------------------------------------------
    def __call__(self, tensor: Flat, quorum: int, round: int) -> PartialResult:
        """Contribute `tensor` to round `round`; return the round's mean (first `quorum` contributions, rank order)."""
        check_call(self.numel, self.size, self.round, round, quorum, tensor)
        data = tensor.detach().to(self.dtype).contiguous()
        self._gate(round)
        index = self._ticket(round)
        if index >= quorum:
            return self._collect(quorum, round, None)
        self._post(data, round)
        if index == quorum - 1:
            self._close(quorum, round)
        return self._collect(quorum, round, data)

    def try_read(self, quorum: int, round: int) -> PartialResult | None:
        """Round `round`'s result if it is already complete (this rank is then among the dropped), else None."""
        check_call(self.numel, self.size, self.round, round, quorum, None)
        if tag_state(self._load(self._entry_at(round) + 1), round) != READY:
            return None
        # A complete round passed its gate, so the ticket arithmetic holds without waiting here.
        index = self._ticket(round)
        if index < quorum:
            raise RuntimeError(
                f"{self._who}: partial allreduce: round {round} was complete but this rank drew arrival {index} < "
                f"{quorum=}: ranks disagree on the quorum of round {round}"
            )
        return self._collect(quorum, round, None)

    def latest(self) -> int:
        """The highest round whose mean is complete in the ring (-1 if none): for monitoring and tests."""
        tags = [self._load(s * self._entry + 1) for s in range(self.depth)]
        return max([t for t in tags if t >= 0], default=-1)

    def _ticket(self, round_: int) -> int:
        """Step 2: this rank's arrival order in `round_` (every rank takes exactly one ticket per round)."""
        ticket = self._fetch(self._entry_at(round_), 1, self.MPI.SUM)
        return arrival_index(ticket, round_, self.depth, self.size)

    def _post(self, data: Flat, round_: int) -> None:
        """Step 3: data into this rank's slot, Flush, and only then the flag that says which round it belongs to."""
        target = (self.rank * self.numel, self.numel, self._mpi_t)
        self.win_slots.Put([data.numpy(), self._mpi_t], self.host, target=target)
        self.win_slots.Flush(self.host)
        self._store(self._posted + self.rank, round_)

    def _close(self, quorum: int, round_: int) -> None:
        """Step 4 (the last counted arrival): once `quorum` ranks posted, record who they are; tag 'summing'."""
        ranks = self._poll(
            lambda: _posted_for(self._load_many(self._posted, self.size), round_, quorum),
            lambda: (
                f"round {round_} combines, but fewer than {quorum=} ranks have posted their data" + self._late(round_)
            ),
        )
        entry = self._entry_at(round_)
        record = np.full(3 + self.size, -1, dtype=np.int64)
        record[0], record[1], record[2], record[3 : 3 + quorum] = 0, quorum, quorum, ranks
        self._store_many(entry + 2, record)  # blocks <- 0 (the entry's last round is read by all: the gate)
        self._store(entry + 1, writing_tag(round_))

    def _sum_block(self, own: Flat, round_: int) -> None:
        """Step 5: sum this contributor's block of the counted slots in rank order, Put it, count it; the last block
        done makes the round complete."""
        entry = self._entry_at(round_)
        record = self._load_many(entry + 3, 2 + self.size)
        quorum, ranks = int(record[0]), [int(r) for r in record[2 : 2 + int(record[1])]]
        if self.rank not in ranks:
            raise RuntimeError(
                f"{self._who}: partial allreduce: this rank posted round {round_} but is not among its "
                f"contributors {ranks}: ranks disagree on the quorum"
            )
        lo, hi = block(ranks.index(self.rank), quorum, self.numel)
        width = hi - lo
        if width:
            if self._parts is None or self._parts.numel() < quorum * width:
                self._parts = torch.empty(quorum * width, dtype=self.dtype)
            parts = self._parts[: quorum * width].view(quorum, width)
            for i, r in enumerate(ranks):  # every Get first, one Flush for all
                if r != self.rank:
                    target = (r * self.numel + lo, width, self._mpi_t)
                    self.win_slots.Get([parts[i].numpy(), self._mpi_t], self.host, target=target)
            self.win_slots.Flush(self.host)
            parts[ranks.index(self.rank)].copy_(own[lo:hi])
            mean = parts[0]  # the same additions, in the same order, as one rank summing the whole vector
            for i in range(1, quorum):
                mean.add_(parts[i])
            mean.div_(quorum)
            target = ((round_ % self.depth) * self.numel + lo, width, self._mpi_t)
            self.win_ring.Put([mean.numpy(), self._mpi_t], self.host, target=target)
            self.win_ring.Flush(self.host)
        self._store(self._summed + self.rank, round_)
        if self._fetch(entry + 2, 1, self.MPI.SUM) == quorum - 1:
            self._store(entry + 1, round_)

    def _late(self, round_: int) -> str:
        """'; waiting on rank 2 on node17': the ranks that have not posted `round_`, for a timeout's message."""
        posted = self._load_many(self._posted, self.size)
        late = ", ".join(f"rank {r} on {self._hosts[r]}" for r in range(self.size) if int(posted[r]) < round_)
        return f"; waiting on {late}" if late else ""

    def _unsummed(self, round_: int) -> str:
        """'; waiting on rank 2 on node17 (its block)': the contributors of `round_` whose block is not summed."""
        record = self._load_many(self._entry_at(round_) + 3, 2 + self.size)
        summed = self._load_many(self._summed, self.size)
        ranks = [int(r) for r in record[2 : 2 + int(record[1])]]
        late = ", ".join(f"rank {r} on {self._hosts[r]}" for r in ranks if int(summed[r]) < round_)
        return f"; waiting on {late} (its block of the sum)" if late else ""

    def _collect(self, quorum: int, round_: int, own: Flat | None) -> PartialResult:
        """Steps 5-6: wait for the round (summing this rank's block on the way if `own`, its contribution, was
        counted), read record and mean, re-check the tag (torn reads fail loudly)."""
        entry = self._entry_at(round_)
        tag = entry + 1
        helping = own

        def probe() -> bool | None:
            nonlocal helping
            state = tag_state(self._load(tag), round_)
            if state == OVERWRITTEN:
                raise RuntimeError(self._overwritten(round_))
            if state == SUMMING and helping is not None:
                self._sum_block(helping, round_)
                helping = None
                return self._collect_ready(tag, round_)
            return True if state == READY else None

        def describe() -> str:
            state = tag_state(self._load(tag), round_)
            if state == SUMMING:
                done = self._load(entry + 2)
                return f"round {round_} is being summed: {done} of {quorum} blocks done" + self._unsummed(round_)
            arrived = arrival_index(self._load(entry), round_, self.depth, self.size)
            return f"round {round_} incomplete: {max(arrived, 0)} of {self.size} ranks arrived, {quorum=}" + self._late(
                round_
            )

        self._poll(probe, describe)
        record = self._load_many(entry + 3, 2 + self.size)
        mean = torch.empty(self.numel, dtype=self.dtype)
        target = ((round_ % self.depth) * self.numel, self.numel, self._mpi_t)
        self.win_ring.Get([mean.numpy(), self._mpi_t], self.host, target=target)
        self.win_ring.Flush(self.host)
        if tag_state(self._load(tag), round_) != READY:
            raise RuntimeError(self._overwritten(round_) + " (while it was being read)")
        if int(record[0]) != quorum:
            raise ValueError(
                f"{self._who}: partial allreduce: round {round_} ran with quorum={int(record[0])}, "
                f"this rank asked for {quorum=}: every rank must pass the same quorum"
            )
        contributors, dropped = split([int(r) for r in record[2 : 2 + int(record[1])]], self.size)
        self._store(self._read + self.rank, round_ + 1)
        self.round = round_ + 1
        return PartialResult(mean, round_, quorum, contributors, dropped)

    def _collect_ready(self, tag: int, round_: int) -> bool | None:
        """After summing a block: the round may be complete already (this was its last block)."""
        self._backoff.reset()  # the others' blocks are as fast as this one: poll promptly again
        return True if tag_state(self._load(tag), round_) == READY else None

    def _overwritten(self, round_: int) -> str:
        return (
            f"{self._who}: partial allreduce: the mean of round {round_} was overwritten by a later round "
            f"(ring depth={self.depth}); the gate should have prevented this: do all ranks use the same depth?"
        )


def _posted_for(posted: np.ndarray, round_: int, quorum: int) -> list[int] | None:
    """The ranks whose slot holds round `round_`, once `quorum` of them do (sorted: the summation order)."""
    ranks = [r for r, p in enumerate(posted.tolist()) if p == round_]
    if len(ranks) > quorum:
        raise RuntimeError(
            f"partial allreduce: round {round_} has {len(ranks)} contributions for {quorum=}: "
            f"ranks {ranks} disagree on the quorum"
        )
    return ranks if len(ranks) == quorum else None


def _check_args(numel: int, dtype: torch.dtype, depth: int, host: int, size: int, timeout: float | None) -> None:
    if numel < 1:
        raise ValueError(f"partial allreduce: {numel=} must be >= 1")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"partial allreduce: dtype={dtype} must be torch.float32 or torch.float64")
    if depth < 1:
        raise ValueError(f"partial allreduce: {depth=} must be >= 1")
    if not 0 <= host < size:
        raise ValueError(f"partial allreduce: {host=} must be a rank in 0..{size - 1}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"partial allreduce: {timeout=} must be > 0 seconds (or None)")
