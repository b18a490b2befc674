"""The server's side of a parameter-server mailbox on one MPI window (`runtime.mpi_rma` describes the protocol):
the window's layout and control words, and what the server rank does with them (receive, publish, close).
`WindowMailbox` adds the workers' side."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from mpi4py import MPI

    from collsync.policy import Sent

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from collsync.runtime.mpi_channel import Channel
from collsync.runtime.mpi_sent import TAGS, Inbox, Outbox, as_int
from collsync.runtime.mpi_windows import Backoff, Windows, Words, poll_cap
from collsync.runtime.placement import named_rank
from collsync.types import Arrival, Flat, Stamp

_HDR = 4  # seq, version, done, signal (float64 bits)
_SLOT = 4  # full, version, clock, finished
# The slot's last word, written by its worker only: 0 pushing, 1 finished (left, or read `done`: for good), 2 away
# (waiting in another collective of its script, until its next push; PSP's rounds then count the others).
FINISHED, AWAY = 1, 2


class ServedWindow(Windows):
    """Collective constructor over `comm`: `server_rank` hosts the windows; `workers` lists the worker ranks in
    worker order (default: every other rank). Ranks that are neither (other shards' servers) expose nothing and
    may only `snapshot` the published parameters. `sends` (`SyncPolicy.sent()`: round policies and async, given on every
    rank alike): the server sends each worker the versions it reads (`runtime.mpi_sent`), and a push is a message;
    None: workers poll and Get, and push by `Put` and a flag word."""

    def __init__(
        self,
        comm: MPI.Comm,
        numel: int,
        *,
        server_rank: int = 0,
        workers: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
        sends: Sent | None = None,
    ) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        self.MPI = MPI
        self.comm = comm
        self.numel = numel
        self.server = server_rank
        self.dtype = dtype
        size, rank = comm.Get_size(), comm.Get_rank()
        self.is_server = rank == server_rank
        ranks = [r for r in range(size) if r != server_rank] if workers is None else list(workers)
        if server_rank in ranks or not 0 <= server_rank < size:
            raise ValueError(f"mpi: server rank {server_rank} must be a rank of the world and not a worker")
        self.workers = len(ranks)
        self.worker = ranks.index(rank) if rank in ranks else -1
        self.worker_ranks = ranks
        self.hosts: list[str] | None = None  # every rank's host name, where the opener gathered them (Shards)
        self._np = np.float32 if dtype == torch.float32 else np.float64
        self._mpi_t = MPI.FLOAT if dtype == torch.float32 else MPI.DOUBLE
        item = np.dtype(self._np).itemsize
        host = self.is_server
        intra = cast("MPI.Intracomm", comm)  # windows need an intracommunicator: every communicator here is one
        self._block = -(-numel * item // 8)  # one block of floats in words, rounded up: each starts on a word
        self._params_at = _HDR + _SLOT * self.workers
        self._slots_at = self._params_at + self._block
        # Server-sent parameters: pushes come as messages (`runtime.mpi_sent`), so the window has no slots for them.
        words = self._slots_at + (0 if sends is not None else self.workers * self._block)
        self.win_box = MPI.Win.Allocate(words * 8 if host else 0, 8, comm=intra)
        self._wins = (self.win_box,)
        if host:
            for win in self._wins:
                mem = np.frombuffer(cast(Any, win.tomemory()), dtype=np.uint8)  # mpi4py types its buffer loosely
                mem[:] = 0
        comm.Barrier()  # the zeroed memory is in place before anyone reads it
        for win in self._wins:
            win.Lock_all()
        self._ctrl = Words(self.win_box, server_rank)
        # Server-sent parameters: their own communicator and tags, so that no other protocol's message, nor one an
        # earlier mailbox left unreceived (a lost worker's push), is matched with them (`mpi_channel`).
        self._msgs = Channel(comm, tags=TAGS) if sends is not None else None
        self.outbox: Outbox | None = None
        self.outbox_streams = sends is not None and sends.streams  # every rank alike: see `policy.Sent`
        self.inbox: Inbox | None = None
        if self._msgs is not None and sends is not None:
            if host:
                self.outbox = Outbox(self._msgs, ranks, sends, numel, self._np, self._mpi_t)
            elif rank in ranks:
                self.inbox = Inbox(self._msgs, server_rank, numel, self._np, self._mpi_t)
        self._posts = 0  # worker: pushes posted (a delivery counting fewer predates the last one)
        self._read_once = False  # worker: a first read done (the server owes every worker the first publish)
        # Worker: the `done` stamp once any read saw it. Seeing it stores FINISHED, after which the server's `close`
        # may end before its `done` delivery went out, so no later read may wait for that delivery.
        self._finished: Stamp | None = None
        self._clocks = [0] * self.workers  # server: the round of each worker's push last taken
        self._hdr = np.zeros(_HDR, dtype=np.int64)
        self._pair = np.zeros(2, dtype=np.int64)  # a slot's (version, clock)
        self._full = np.zeros(1, dtype=np.int64)  # worker: its slot's flag, read and written with other words
        self._free = True  # worker: its slot is known to be free (a read saw it freed since the last push)
        self._seq = 0
        self._next = 0
        self._taken: list[int] = []  # server: slots read but not yet freed (see _release)
        self._spare: list[torch.Tensor] = []  # server: receive buffers handed back by `recycle`
        self._sent = False  # worker: a push whose slot the server has not freed yet
        self.poll_cap = poll_cap(comm)  # the longest pause between two polls (seconds)
        self._backoff = Backoff(cap=self.poll_cap)
        # Worker: give up once the server has shown no sign of life (no publish, our push not taken) for this long.
        self.silence: float | None = None
        self._heard = (-1, time.monotonic())  # (the last header seq seen, when it was first seen)
        # When a round trip to the server last completed (a control word read): a worker's watchdog thread reads it
        # to tell a worker blocked inside MPI towards an unreachable server (`collsync.runtime.watchdog`).
        self.answered = time.monotonic()
        self.bytes_pushed = 0
        self.bytes_fetched = 0

    # -- control words (atomics) -------------------------------------------------------------------------------
    def _load(self, disp: int) -> int:
        value = self._ctrl.load(disp)
        self.answered = time.monotonic()
        return value

    def _load_header(self) -> np.ndarray:
        """seq, version, done, signal in one atomic-per-word read, not four round trips."""
        header = self._ctrl.load_many(0, self._hdr)
        self.answered = time.monotonic()
        return header

    def _poll(self) -> np.ndarray:
        """The header and, after a push, this worker's `full` into `_full`: one round trip (one Flush for both reads,
        and for the push's flag where `send` left it posted)."""
        self._ctrl.load_many(0, self._hdr, flush=False)
        if self._sent:
            self._ctrl.load_many(self._slot(self.worker), self._full, flush=False)
        self.win_box.Flush(self.server)
        self.answered = time.monotonic()
        return self._hdr

    def _store(self, disp: int, value: int) -> None:
        self._ctrl.store(disp, value)

    def _slot(self, worker: int) -> int:
        return _HDR + _SLOT * worker

    def target(self, worker: int | None = None) -> tuple[int, int, Any]:
        """Where the published parameters (None) or `worker`'s gradient slot lie in the window: an RMA target."""
        at = self._params_at if worker is None else self._slots_at + worker * self._block
        return (at, self.numel, self._mpi_t)

    # -- server side -------------------------------------------------------------------------------------------
    def describe(self, workers: list[int]) -> str:
        """'worker 1 (rank 2 on node17)', ...: how errors name workers, by rank and host."""
        named = []
        for w in workers:
            rank = self.worker_ranks[w]
            host = f" on {self.hosts[rank]}" if self.hosts is not None else ""
            named.append(f"worker {w} (rank {named_rank(self.comm, rank)}{host})")
        return ", ".join(named)

    def departed(self) -> list[int]:
        """Server: the workers that left (or read the final `done`)."""
        return [w for w in range(self.workers) if self._load(self._slot(w) + 3) == FINISHED]

    def away(self) -> list[int]:
        """Server: the workers that said they push nothing for now (`WindowMailbox.mark_away`)."""
        return [w for w in range(self.workers) if self._load(self._slot(w) + 3) == AWAY]

    def _take(self, w: int, defer: bool = False) -> Arrival | None:
        if self.outbox is not None:
            return self._take_message(w, defer)
        slot = self._slot(w)
        full = self._load(slot)
        if full == 0:
            return None
        grad = None
        if full == 1:
            grad = self._buffer()
            self.win_box.Get([grad.numpy(), self._mpi_t], self.server, target=self.target(w))
        self._ctrl.load_many(slot + 1, self._pair, flush=False)
        self.win_box.Flush(self.server)
        return self._took(Arrival(w, int(self._pair[0]), grad, int(self._pair[1])), defer)

    def _take_message(self, w: int, defer: bool) -> Arrival | None:
        """`_take` where pushes are messages (server-sent parameters): a local test, no round trip."""
        assert self.outbox is not None
        pushed = self.outbox.pushed(w, lambda: self._buffer().numpy())
        if pushed is None:
            return None
        _, version, clock, grad = pushed
        return self._took(Arrival(w, version, None if grad is None else torch.from_numpy(grad), clock), defer)

    def _buffer(self) -> torch.Tensor:
        """A received gradient's buffer: a recycled one (`recycle`), else a new one."""
        return self._spare.pop() if self._spare else torch.empty(self.numel, dtype=self.dtype)

    def _took(self, arrival: Arrival, defer: bool) -> Arrival:
        """A push taken: its slot freed now, or at the next publish or recv (`defer`, see `_release`)."""
        self._clocks[arrival.worker] = arrival.clock
        if defer:
            self._taken.append(arrival.worker)
        else:
            self._free_slot(arrival.worker)
        return arrival

    def _free_slot(self, w: int) -> None:
        """The server dealt with worker w's push: its slot's word says so (0, or with server-sent parameters the
        pushes dealt with), and reading its own writes it is owed the version it waits for."""
        if self.outbox is None:
            self._store(self._slot(w), 0)
            return
        self.outbox.released(w, self._clocks[w])
        self._store(self._slot(w), self.outbox.dealt[w])

    def recycle(self, grad: Flat | None) -> None:
        """Server: a received gradient the server no longer holds (`Server.holds`): its buffer takes the next
        receive instead of a fresh allocation. Two are kept: one in use and one being filled."""
        if grad is not None and len(self._spare) < 2 and grad.numel() == self.numel and grad.dtype == self.dtype:
            self._spare.append(grad)

    def _release(self) -> None:
        """Free the slots taken since the last publish or recv: the server has dealt with those gradients (and
        published what they changed), so their workers may read."""
        for w in self._taken:
            self._free_slot(w)
        self._taken.clear()
        if self.outbox is not None:
            self.outbox.send()

    def recv(self, timeout: float | None = None) -> Arrival | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._release()  # the previous arrival was accepted (and published, if it changed the parameters)
        backoff = self._backoff
        backoff.reset()
        while True:
            for i in range(self.workers):
                w = (self._next + i) % self.workers
                arrival = self._take(w, defer=True)
                if arrival is not None:
                    self._next = (w + 1) % self.workers
                    return arrival
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if self.outbox is not None:
                self.outbox.pump()
                if self.outbox.hurry():
                    os.sched_yield()  # the delivery moves only while we call MPI (`mpi_sent.HURRY_S`)
                    continue
            backoff.wait()

    def publish(self, params: Flat, stamp: Stamp) -> None:
        self._seq += 1
        self._store(0, self._seq)
        buf = params.detach().to(self.dtype).contiguous().numpy()
        self.win_box.Put([buf, self._mpi_t], self.server, target=self.target())
        self.win_box.Flush(self.server)
        self._ctrl.store_many(1, np.array([stamp.version, int(stamp.done), as_int(stamp.signal)], dtype=np.int64))
        self._seq += 1
        self._store(0, self._seq)
        if self.outbox is not None:
            self.outbox.publish(buf, stamp)
        self._release()

    def lose(self, worker: int) -> None:
        """Server: the server lost this worker (`Server.lose`): with server-sent parameters it is sent no version
        more, only `done` (`mpi_sent.Outbox.mute`); pushes it still sends are taken as before (and dropped)."""
        if self.outbox is not None:
            self.outbox.mute(worker)

    def locate(self, worker: int) -> tuple[int | None, str | None]:
        """Server: this worker's rank (as the launcher numbers it: `placement.named_rank`) and host (None where the
        hosts were not gathered)."""
        rank = self.worker_ranks[worker]
        return named_rank(self.comm, rank), None if self.hosts is None else self.hosts[rank]

    def close(self, timeout: float | None = None, lost: Sequence[int] = ()) -> list[Arrival]:
        # The last arrival `recv` returned was accepted: free its slot now, or it would be taken a second time here.
        self._release()
        left: list[Arrival] = []
        backoff = self._backoff
        backoff.reset()
        end = None if timeout is None else time.monotonic() + timeout
        for w in lost:
            if self.outbox is not None:
                self.outbox.forget(w)
        while True:
            # A lost worker is not waited for (it may never run again); what it has in its slot is taken all the same.
            out = [w for w in range(self.workers) if w not in lost and self._load(self._slot(w) + 3) != FINISHED]
            for w in range(self.workers):
                arrival = self._take(w)
                if arrival is not None:
                    left.append(arrival)
            if self.outbox is not None:
                self.outbox.pump()  # `done` to the workers whose last delivery was still in flight
            if not out:
                return left
            if end is not None and time.monotonic() > end:
                raise TimeoutError(
                    f"training is over but {self.describe(out)} did not stop within deadline={timeout}s "
                    "(stopped, stuck or gone)"
                )
            backoff.wait()

    def free(self) -> None:
        """Collective: the messages' receives cancelled (`runtime.mpi_sent`), then the windows freed."""
        for box in (self.inbox, self.outbox):
            if box is not None:
                box.free()
        if self._msgs is not None:
            self._msgs.free()  # takes what came here unreceived; deliveries sent to a lost worker stay with it
            self._msgs = None
        super().free()
