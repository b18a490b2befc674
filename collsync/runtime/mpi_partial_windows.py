"""The windows and control words of the k-of-n partial allreduce (`mpi_partial`, whose docstring gives the
protocol): their layout and encodings (pure helpers, no MPI; the tag and record stamps in `mpi_partial_tags`), the
atomics that read and write control words, the waits with their timeout messages, and the gate that frees a ring
entry. `mpi_partial.PartialAllreduce` runs the rounds over them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from collsync import keepalive
from collsync.margin import Margin, check_margin
from collsync.runtime.mpi_partial_deliver import Deliveries
from collsync.runtime.mpi_partial_direct import PROTOCOLS, direct_protocol
from collsync.runtime.mpi_partial_lost import LostRanks
from collsync.runtime.mpi_partial_messages import LARGE_MESSAGE, Messages
from collsync.runtime.mpi_partial_tags import EMPTY, PENDING, READY, SUMMING, TagState, stamp, tag_state, unstamp
from collsync.runtime.mpi_windows import Backoff, Windows, Words, poll_cap
from collsync.runtime.mpi_world import RankLost, gate, rank_prefix
from collsync.types import Flat

T = TypeVar("T")

_ENTRY_HEAD = 5  # tickets, tag, blocks, quorum, count (then ranks[n])
# Added to an entry's ticket counter by the rank that closes a round (once per round with tickets): a ticket drawn
# after it carries it, so that rank knows it came after the close. Far above any world size, far below int64's
# range over any run (2**63 / 2**24 rounds per entry).
CLOSED = 1 << 24


# -- pure helpers (no MPI): the encodings the protocol relies on (the tag and record stamps: mpi_partial_tags) --
def block(index: int, parts: int, numel: int) -> tuple[int, int]:
    """[start, stop) of block `index` of `parts` nearly equal contiguous blocks of 0..numel-1 (some empty when
    numel < parts)."""
    return index * numel // parts, (index + 1) * numel // parts


def ticket_state(word: int, uses: int, size: int, direct: bool) -> tuple[int, bool, int]:
    """(arrival order, whether the round was closed before it, the mask of the ranks before it) from a ring entry's
    cumulative ticket word, of which `uses` earlier rounds (all before this one: the gate) each took every rank's
    ticket and one close. Direct exchange: a ticket adds 1 << rank and the close 1 << size (the mask is what came
    before, its size the order); host-summed: a ticket adds 1, the close `CLOSED` (the mask is 0)."""
    closed_flag = 1 << size if direct else CLOSED
    value = word - uses * ((1 << size) - 1 + closed_flag if direct else size + CLOSED)
    closed = value >= closed_flag
    value -= closed_flag if closed else 0
    return (value.bit_count(), closed, value) if direct else (value, closed, 0)


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


class PartialWindows(LostRanks, Windows):
    """The windows of a partial allreduce over `comm` and this rank's view of them (collective constructor; see
    `mpi_partial.PartialAllreduce` for the arguments). `free()` (collective) releases them."""

    def __init__(
        self,
        comm: MPI.Comm,
        numel: int,
        *,
        dtype: torch.dtype = torch.float32,
        depth: int = 8,
        host: int = 0,
        timeout: float | None = None,
        margin: float | str | None = None,
        tolerate: int = 0,
        protocol: str = "auto",
        watch: bool = False,
    ) -> None:
        from mpi4py import MPI  # lazily: collsync's modules import without an MPI library

        size, rank = comm.Get_size(), comm.Get_rank()
        _check_args(numel, dtype, depth, host, size, timeout)
        check_margin(margin)
        if protocol not in PROTOCOLS:
            raise ValueError(f"partial allreduce: {protocol=} must be one of {', '.join(PROTOCOLS)}")
        if not 0 <= tolerate < size:
            raise ValueError(f"partial allreduce: {tolerate=} lost ranks must be in 0..{size - 1}")
        if timeout is not None:
            # Window creation and Dup wait for every rank and cannot be bounded themselves: once every rank has
            # passed this gate they complete; a rank that never comes is named within `timeout`.
            gate(comm, timeout, "partial allreduce: the window set-up")
        self.MPI, self.comm = MPI, comm
        self.numel, self.dtype, self.depth, self.host, self.timeout = numel, dtype, depth, host, timeout
        self.size, self.rank = size, rank
        self.round = 0  # the next round this rank reads
        self.margin = margin
        self.tolerate, self.lost, self._proxied = tolerate, {}, {}  # `mpi_partial_lost`
        self._margin = Margin()  # the adaptive margin's running estimate (rounds this rank closes)
        self._arrived_before = time.monotonic()  # this rank's last arrival in a round: the period of its rounds
        self._read_at = time.monotonic()  # when it last read a round's mean: its step is from there to its arrival
        self._parts: Flat | None = None  # a contributor's block of each counted slot (see `_sum_block`), kept
        self._who = rank_prefix(comm)
        self._hosts: list[str] = comm.allgather(socket.gethostname())  # so a timeout names a late rank's host
        self._np = np.float32 if dtype == torch.float32 else np.float64
        self._mpi_t = MPI.FLOAT if dtype == torch.float32 else MPI.DOUBLE
        self._entry = _ENTRY_HEAD + size
        self._posted = depth * self._entry
        self._read = self._posted + size
        self._summed = self._read + size
        self._waited = self._summed + size
        self._lost_at = self._waited + size
        self._left = self._lost_at + size
        # The ticket word's encoding (`ticket_state`): a bit per rank (direct exchange), or a count (host-summed).
        self.direct = direct_protocol(protocol, self._hosts)
        self._closed = (1 << size) if self.direct else CLOSED
        self._wins = self._allocate(rank == host)
        self._full_comm = comm.Dup()  # full-quorum rounds' allreduce: never interleaved with the caller's collectives
        self.win_slots, self.win_ring, self.win_ctrl = self._wins
        self._floor = 0  # a lower bound on every rank's read counter (saves polling the gate)
        self._stored_read = 0  # the value of read[rank] on the host (full rounds leave it behind: `_publish_read`)
        # The buffers of read[] writes: one word (`_store_read`), and every word (a direct round's writer marks its
        # contributors' reads in one write: `DirectRounds._mark_read`).
        self._read_word = np.zeros(1, dtype=np.int64)
        self._reads = np.full(size, -1, dtype=np.int64)
        self._full_rounds = [0] * depth  # per ring entry: the full-quorum rounds that took no ticket
        self._stranded: int | None = None  # the full round whose allreduce timed out (nothing can follow it)
        self._words = Words(self.win_ctrl, host)  # the control words' atomics, as the mailbox's
        check = self._watching(comm, watch)  # ULFM's failure detector, checked at every pause (`mpi_partial_lost`)
        self._backoff = Backoff(cap=poll_cap(comm), check=check)
        backoff = Backoff(cap=self._backoff.cap, check=check)
        deliveries = Deliveries(comm, numel, dtype, size) if self.direct else None
        self.msgs = Messages(comm, self._mpi_t, backoff, deliveries) if self.direct else None
        # The exchange's phases yield between tests, not sleep, for a vector past MPI's eager sizes (it moves only
        # while both sides call MPI), and across hosts whatever its size: every peer is inside the exchange, and a
        # pause of up to `poll_cap` per phase, three phases a round, was a third of a digits MLP's backup round with
        # a host behind a 5 ms link (benchmarks/README.md, "Backup's read counters"). On one host small phases sleep:
        # ranks share cores there, and a yielding rank takes turns from the one it waits for.
        self._spin = numel * np.dtype(self._np).itemsize > LARGE_MESSAGE or len(set(self._hosts)) > 1

    # -- set-up and tear-down --------------------------------------------------------------------------------------
    def _allocate(self, hosting: bool) -> tuple[Any, Any, Any]:
        MPI, item = self.MPI, np.dtype(self._np).itemsize
        words = self._left + self.size
        # The direct exchange keeps no contributions on the host: its slots window is empty.
        slots = MPI.Win.Allocate(
            self.size * self.numel * item if hosting and not self.direct else 0, item, comm=self.comm
        )
        ring = MPI.Win.Allocate(self.depth * self.numel * item if hosting else 0, item, comm=self.comm)
        ctrl = MPI.Win.Allocate(words * 8 if hosting else 0, 8, comm=self.comm)
        if hosting:
            # Before the epoch opens, the host may write its memory directly: no one can access it yet.
            for win in (slots, ring):
                np.frombuffer(win.tomemory(), dtype=np.uint8)[:] = 0
            words_ = np.frombuffer(ctrl.tomemory(), dtype=np.int64)
            words_[:] = 0
            words_[1 : self._posted : self._entry] = EMPTY  # every entry's tag
            words_[self._posted : self._read] = -1  # no rank has posted any round
            words_[self._summed :] = -1  # nor summed a block of one, nor waited in vain in a full round, nor is lost
            words_[self._left :] = 0  # no rank has come to the end (`leave_live`)
        self.comm.Barrier()  # initialised memory is in place before anyone reads it
        for win in (slots, ring, ctrl):
            win.Lock_all()
        return slots, ring, ctrl

    # -- control words (atomics, each completed by a Flush) --------------------------------------------------------
    def _fetch(self, disp: int, value: int, op: Any) -> int:
        return self._words.fetch(disp, value, op)

    def _load(self, disp: int) -> int:
        return self._words.load(disp)

    def _store(self, disp: int, value: int) -> None:
        self._words.store(disp, value)

    def _load_many(self, disp: int, count: int) -> np.ndarray:
        """`count` words, each read atomically, in one Get_accumulate (not `count` round trips)."""
        return self._words.load_many(disp, np.empty(count, dtype=np.int64))

    def _store_many(self, disp: int, values: np.ndarray) -> None:
        self._words.store_many(disp, values)

    def _store_read(self, rank: int, value: int) -> None:
        """read[rank] <- max(read[rank], value), flushed: several ranks write it (the rank itself, a direct round's
        writer for its contributors, the reader for a lost rank), in no order MPI keeps across origins, and it only
        moves on. (A write left to a later `Flush` keeps a buffer of its own: `DirectRounds._flush_deferred`.)"""
        self._read_word[0] = value
        self._words.store_many(self._read + rank, self._read_word, op=self.MPI.MAX)

    def _entry_at(self, round_: int) -> int:
        return (round_ % self.depth) * self._entry

    def _entry_state(self, round_: int) -> tuple[TagState, np.ndarray | None]:
        """The tag of `round_`'s entry and its record, in one `Get_accumulate` (one round trip): (SUMMING or READY,
        [blocks, quorum, count, ranks[n]]) once the record written for `round_` is there in full; else (the tag's
        state, None), PENDING too while the tag has landed before all of its record (they are written together)."""
        words = self._load_many(self._entry_at(round_) + 1, _ENTRY_HEAD - 1 + self.size)
        state = tag_state(int(words[0]), round_)
        if state not in (SUMMING, READY):
            return state, None
        record = unstamp(words[1:], round_)
        return (state, record) if record is not None else (PENDING, None)

    def _publish_ready(self, round_: int, record: np.ndarray) -> None:
        """Tag `round_`'s entry 'ready' with its record ([blocks, quorum, count, ranks[n]]), in one write."""
        words = np.concatenate((np.array([round_], dtype=np.int64), stamp(round_, record.astype(np.int64))))
        self._store_many(self._entry_at(round_) + 1, words)

    def _ticket(self, round_: int) -> tuple[int, bool, int]:
        """Step 2: this rank's arrival order in `round_` (every rank takes exactly one ticket per round), whether
        the round was closed before it, and (direct exchange) the mask of the ranks that came before it."""
        return self._state(self._fetch(self._entry_at(round_), self._bit(self.rank), self.MPI.SUM), round_)

    def _close_tickets(self, round_: int) -> tuple[int, int]:
        """Step 4's close: add the closed flag to the round's ticket word; how many tickets were drawn before it
        (and, direct exchange, the mask of their ranks)."""
        index, _, mask = self._state(self._fetch(self._entry_at(round_), self._closed, self.MPI.SUM), round_)
        return index, mask

    def _arrived(self, round_: int) -> int:
        """How many ranks have drawn a ticket in `round_` so far."""
        return self._state(self._load(self._entry_at(round_)), round_)[0]

    def _bit(self, rank: int) -> int:  # what rank `rank`'s ticket adds to the word
        return 1 << rank if self.direct else 1

    def _state(self, word: int, round_: int) -> tuple[int, bool, int]:
        """`ticket_state` of `round_`'s ticket word: the entry's full rounds took no tickets."""
        uses = round_ // self.depth - self._full_rounds[round_ % self.depth]
        return ticket_state(word, uses, self.size, self.direct)

    def _publish_read(self) -> None:
        """Bring read[rank] up to date after full rounds, before this rank's partial call can wait on anyone."""
        if self._stored_read < self.round:
            self._store_read(self.rank, self.round)
            self._stored_read = self.round

    def _check_not_stranded(self) -> None:
        if self._stranded is not None:
            raise RuntimeError(
                f"{self._who}: partial allreduce: round {self._stranded}'s allreduce timed out and is still posted; "
                "this PartialAllreduce cannot go on (free it, and make a new one if the ranks recover)"
            )

    def free(self) -> None:
        """Collective: close the epochs, free the windows and the full-quorum communicator. With a `timeout`, a
        rank that never comes to it is named (`gate`) instead of held for in the windows' barrier."""
        if self.timeout is not None and self._wins:
            gate(self.comm, self.timeout, "partial allreduce: freeing the windows", startup=False)
        super().free()
        self._free_comms()

    def latest(self) -> int:
        """The highest round whose mean is complete in the ring (-1 if none; full-quorum rounds never use the
        ring): for monitoring and tests."""
        tags = [self._load(s * self._entry + 1) for s in range(self.depth)]
        return max([t for t in tags if t >= 0], default=-1)

    # -- waiting ---------------------------------------------------------------------------------------------------
    def _poll(self, probe: Callable[[], T | None], describe: Callable[[], str]) -> T:
        """Poll with backoff (ranks share cores) until `probe` answers; after `timeout` s, fail naming the cause."""
        backoff = self._backoff
        backoff.reset()
        start = time.monotonic()
        while True:
            got = probe()
            if got is not None:
                return got
            timeout = keepalive.patience(self.timeout)  # shorter once the launcher said that a rank died
            if timeout is not None and time.monotonic() - start >= timeout:
                # RankLost (a TimeoutError): uncaught in a collsync.torch script, one line and the job ends.
                raise RankLost(f"{self._who}: partial allreduce: {describe()} after timeout={timeout}s")
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
            behind = ", ".join(f"rank {r} on {self._hosts[r]} has read up to round {int(read[r]) - 1}" for r in late)
            return (
                f"round {round_} waits for ranks {late} to read round {round_ - self.depth} ({behind}; {self.depth=})"
            )

        while True:
            try:
                self._poll(probe, describe)
                return
            except RankLost:
                late = lagging(read.tolist(), round_, self.depth)
                if not (self.tolerate and self._lose(late, read.tolist(), round_)):
                    raise

    def _late(self, round_: int) -> str:
        """'; waiting on rank 2 on node17': the ranks that have not posted `round_` (direct exchange: not drawn a
        ticket in it), for a timeout's message."""
        if self.direct:
            mask = self._state(self._load(self._entry_at(round_)), round_)[2]
            missing = [r for r in range(self.size) if not mask >> r & 1]
        else:
            posted = self._load_many(self._posted, self.size)
            missing = [r for r in range(self.size) if int(posted[r]) < round_]
        late = ", ".join(f"rank {r} on {self._hosts[r]}" for r in missing)
        return f"; waiting on {late}" if late else ""

    def _unsummed(self, round_: int) -> str:
        """'; waiting on rank 2 on node17 (its block)': the contributors of `round_` whose block is not summed."""
        record = unstamp(self._load_many(self._entry_at(round_) + 2, _ENTRY_HEAD - 2 + self.size), round_)
        if record is None:
            return ""
        summed = self._load_many(self._summed, self.size)
        ranks = [int(r) for r in record[3 : 3 + int(record[2])]]
        late = ", ".join(f"rank {r} on {self._hosts[r]}" for r in ranks if int(summed[r]) < round_)
        return f"; waiting on {late} (its block of the sum)" if late else ""

    def _overwritten(self, round_: int) -> str:
        return (
            f"{self._who}: partial allreduce: the mean of round {round_} was overwritten by a later round "
            f"(ring depth={self.depth}); the gate should have prevented this: do all ranks use the same depth?"
        )


def check_out(out: Flat, numel: int, dtype: torch.dtype) -> None:
    """`out`, the buffer a round's mean is written into, must hold exactly the windows' vector."""
    if out.numel() != numel or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"partial allreduce: out must be a contiguous {dtype} tensor of {numel} elements")


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
