"""A parameter-server `Mailbox` on MPI one-sided windows: workers pull with MPI_Get and push with MPI_Put.

One window, hosted by the server rank (workers expose zero bytes), in 8-byte words:

    ctrl    int64[4 + 4 * workers]   [seq, version, done, signal] then per worker [full, version, clock, finished]
    params  float[numel]             the published parameters (from a word boundary)
    slots   float[workers * numel]   one gradient slot per worker (each from a word boundary)

One window, so that whatever a worker posts to the server in one go is completed by one `Flush`: one round trip.
Every access is an RMA call inside one `Lock_all` epoch, completed with `Flush`, and control words are touched only
by atomics (`collsync.runtime.mpi_windows`), so neither side ever waits for the other to call MPI and a flag is
never read half-written. A worker's round is four round trips when nothing has to be waited for (push 1, pull 3),
a poll one (`benchmarks/mpi_rounds.py` counts them); MPI orders no two operations of one `Flush` but those on the
same word, which is what the seqlock's and the flag's extra round trips are for.

* publish (server): seq <- seq + 1 (odd: writing); Put params; version, done, signal; seq <- seq + 1 (even). The
  signal (`Stamp.signal`, a float64's bits in an int64 word) is whatever scalar the server's optimizer publishes.
* read (worker): poll the header (seq, version, done, signal) and, after a push, this worker's `full` in one
  round trip, until the slot is free (the server dealt with the push: read your own writes) and the stamp `ready`;
  Get params (a round trip); re-read seq (a round trip); retry if seq was odd or moved: a seqlock, so a worker never
  keeps a torn mix of two versions (and never parameters published before the push it waited for: that publish
  precedes the freed slot, so the re-read seq moved).
* send (worker): its slot is free (its read saw it so; else it waits); Put gradient and (version, clock) by one
  `Accumulate(REPLACE)`, one Flush for both (a round trip); then `full` <- 1, posted without a Flush when the
  worker reads next (`read_next`): the first poll of that read completes it, so the flag and the poll for version
  v + 1 are one round trip. The Flush before the flag is what guarantees the server never sees the flag before the
  data (each round trip, off shared memory, waits for the server to enter MPI).
* recv (server): round-robin over slots from the last one served (fairness); full = 1 -> Get gradient and
  header under one Flush. `full` <- 0 only once the server has dealt with it: at the next publish or recv. So
  when a worker sees its slot free, any version its gradient produced is published, and its next read includes
  its own push, as when a parameter server answers a push with the new parameters (001_... Alg. 1-2) and as in
  the simulator.
* close (server): after the final publish (done), wait until every worker set `finished`; gradients still in slots
  are returned so the server can drop them (every push is applied or dropped exactly once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from mpi4py import MPI

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from collsync.runtime.mpi_windows import Backoff, Windows, Words, poll_cap
from collsync.types import Arrival, Flat, Stamp

_HDR = 4  # seq, version, done, signal (float64 bits)
_SLOT = 4  # full, version, clock, finished


def _as_int(x: float) -> int:
    """A float64's bits as an int64 (the control window holds int64 words; the stamp's signal rides in one)."""
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


def _as_float(bits: int) -> float:
    return float(np.array([bits], dtype=np.int64).view(np.float64)[0])


class WindowMailbox(Windows):
    """Collective constructor over `comm`: `server_rank` hosts the windows; `workers` lists the worker ranks in
    worker order (default: every other rank). Ranks that are neither (other shards' servers) expose nothing and
    may only `snapshot` the published parameters."""

    def __init__(
        self,
        comm: MPI.Comm,
        numel: int,
        *,
        server_rank: int = 0,
        workers: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
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
        words = self._slots_at + self.workers * self._block
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

    # -- worker side -------------------------------------------------------------------------------------------
    def read(self, out: Flat, ready: Callable[[Stamp], bool], fetch: bool = True) -> Stamp:
        backoff = self._backoff
        backoff.reset()
        while True:
            stamp = self.try_read(out, ready, fetch)
            if stamp is not None:
                return stamp
            self.check_alive()
            backoff.wait()

    def check_alive(self) -> None:
        """Worker: raise TimeoutError, naming the server's rank and host, once it has published nothing for
        `silence` seconds. The server's own deadline ends a run stuck on a worker well before that (`silence` is
        more than twice it), so this fires only when the server itself stopped, hangs or died."""
        if self.silence is None:
            return
        seq, since = self._heard
        if time.monotonic() - since >= self.silence:
            host = f" on {self.hosts[self.server]}" if self.hosts is not None else ""
            raise TimeoutError(
                f"worker {self.worker}: no word from the server, rank {self.server}{host}, for {self.silence:g}s "
                f"(it stopped, hangs or died; at last seen step {int(self._hdr[1])})"
            )

    def _saw(self, seq: int) -> None:
        if seq != self._heard[0]:
            self._heard = (seq, time.monotonic())

    def try_read(self, out: Flat, ready: Callable[[Stamp], bool], fetch: bool = True) -> Stamp | None:
        """One look: None if nothing is published or the stamp is not `ready` (then `out` is untouched); else the
        stamp, with the parameters copied into `out` (a copy torn by a concurrent publish is retried until clean:
        versions only grow, so the newer one is ready too)."""
        buf = out.detach().numpy()
        torn = False  # `out` holds a copy torn by a publish: retry until it is clean, never hand it back as is
        while True:
            seq, version, done, signal = (int(x) for x in self._poll())
            self._saw(seq)
            if seq % 2 and torn:
                self._backoff.wait()
                continue
            if seq == 0 or seq % 2:  # 0: nothing published yet; odd: a publish is under way
                return None
            stamp = Stamp(version, bool(done), _as_float(signal))
            if stamp.done:
                if self.worker >= 0:
                    self._store(self._slot(self.worker) + 3, 1)  # finished: close() stops waiting for us
                return stamp
            if self._sent:
                # Read your own writes, as a parameter server answers a push with the parameters it produced
                # (001_... Alg. 1-2) and as the simulator does: wait until the server dealt with our last push.
                if int(self._full[0]) != 0:
                    return None
                self._sent, self._free = False, True
                # The header came in the same round trip, perhaps read before the publish that freed the slot: a
                # stamp taken without the parameters is read again now; with them, the seqlock's re-read of seq
                # (after the Get) tells a header older than that publish, and one not ready is polled again.
                if not fetch:
                    continue
            if not ready(stamp):
                return None
            if not fetch:
                return stamp
            if self._get_params(buf, seq):
                self.bytes_fetched += buf.nbytes
                return stamp
            torn = True

    def snapshot(self, out: Flat) -> Stamp:
        """The parameters last published, copied into `out` (any rank, e.g. an evaluator; never marks finished)."""
        backoff = self._backoff
        backoff.reset()
        while True:
            seq, version, done, signal = (int(x) for x in self._load_header())
            if seq > 0 and seq % 2 == 0 and self._get_params(out.detach().numpy(), seq):
                return Stamp(version, bool(done), _as_float(signal))
            backoff.wait()

    def _get_params(self, buf: np.ndarray, seq: int) -> bool:
        """Get the published parameters into `buf`; False if a publish moved `seq` meanwhile (the copy is torn)."""
        self.win_box.Get([buf, self._mpi_t], self.server, target=self.target())
        self.win_box.Flush(self.server)
        return self._load(0) == seq

    def peek(self) -> Stamp:
        """The stamp last published (possibly mid-publish: for polling only, never to read parameters by)."""
        _, version, done, signal = (int(x) for x in self._load_header())
        return Stamp(version, bool(done), _as_float(signal))

    def send(self, arrival: Arrival, *, read_next: bool = False) -> None:
        """Hand the gradient to the server: `post` and `complete` (a `ShardedMailbox` posts to every shard first)."""
        self.post(arrival)
        self.complete(read_next=read_next)

    def post(self, arrival: Arrival) -> None:
        """The first half of `send`: once the slot is free, the gradient and its (version, clock) posted, not
        completed."""
        slot = self._slot(self.worker)
        self._backoff.reset()
        while not self._free and self._load(slot) != 0:
            self._saw(int(self._load_header()[0]))
            self.check_alive()
            self._backoff.wait()
        if arrival.grad is not None:
            grad = arrival.grad.detach().to(self.dtype).contiguous().numpy()
            self.win_box.Put([grad, self._mpi_t], self.server, target=self.target(self.worker))
            self.bytes_pushed += grad.nbytes
        self._pair[:] = (arrival.version, arrival.clock)  # in one atomic-per-word write
        self._ctrl.store_many(slot + 1, self._pair, flush=False)
        self._full[0] = 1 if arrival.grad is not None else 2  # 2 = header only
        self._free = False

    def complete(self, *, read_next: bool = False) -> None:
        """The second half of `send`: one Flush for the gradient and its header (a round trip, and off shared memory
        one that waits for the server to enter MPI), then the flag. With `read_next` (the caller reads right
        after) the flag is only posted: the read's first poll completes it in its own round trip."""
        self.win_box.Flush(self.server)
        # Last: the data and header are complete at the target before the flag says so.
        self._ctrl.store_many(self._slot(self.worker), self._full, flush=not read_next)
        self._sent = True

    def leave(self) -> None:
        """Worker: training is over for this worker (its script's loop ended). A server running `until_left`
        stops once the policy can go on without it; `close()` stops waiting for it."""
        if self.worker >= 0:
            self._store(self._slot(self.worker) + 3, 1)

    # -- server side -------------------------------------------------------------------------------------------
    def describe(self, workers: list[int]) -> str:
        """'worker 1 (rank 2 on node17)', ...: how errors name workers, by rank and host."""
        named = []
        for w in workers:
            rank = self.worker_ranks[w]
            host = f" on {self.hosts[rank]}" if self.hosts is not None else ""
            named.append(f"worker {w} (rank {rank}{host})")
        return ", ".join(named)

    def departed(self) -> list[int]:
        """Server: the workers that left (or read the final `done`)."""
        return [w for w in range(self.workers) if self._load(self._slot(w) + 3)]

    def _take(self, w: int, defer: bool = False) -> Arrival | None:
        slot = self._slot(w)
        full = self._load(slot)
        if full == 0:
            return None
        grad = None
        if full == 1:
            grad = self._spare.pop() if self._spare else torch.empty(self.numel, dtype=self.dtype)
            self.win_box.Get([grad.numpy(), self._mpi_t], self.server, target=self.target(w))
        self._ctrl.load_many(slot + 1, self._pair, flush=False)
        self.win_box.Flush(self.server)
        version, clock = int(self._pair[0]), int(self._pair[1])
        if defer:
            self._taken.append(w)
        else:
            self._store(slot, 0)
        return Arrival(w, version, grad, clock)

    def recycle(self, grad: Flat | None) -> None:
        """Server: a received gradient the server no longer holds (`Server.holds`): its buffer takes the next
        receive instead of a fresh allocation. Two are kept: one in use and one being filled."""
        if grad is not None and len(self._spare) < 2 and grad.numel() == self.numel and grad.dtype == self.dtype:
            self._spare.append(grad)

    def _release(self) -> None:
        """Free the slots taken since the last publish or recv: the server has dealt with those gradients (and
        published what they changed), so their workers may read."""
        for w in self._taken:
            self._store(self._slot(w), 0)
        self._taken.clear()

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
            backoff.wait()

    def publish(self, params: Flat, stamp: Stamp) -> None:
        self._seq += 1
        self._store(0, self._seq)
        buf = params.detach().to(self.dtype).contiguous().numpy()
        self.win_box.Put([buf, self._mpi_t], self.server, target=self.target())
        self.win_box.Flush(self.server)
        self._ctrl.store_many(1, np.array([stamp.version, int(stamp.done), _as_int(stamp.signal)], dtype=np.int64))
        self._seq += 1
        self._store(0, self._seq)
        self._release()

    def locate(self, worker: int) -> tuple[int | None, str | None]:
        """Server: this worker's rank and host (None where the hosts were not gathered)."""
        rank = self.worker_ranks[worker]
        return rank, None if self.hosts is None else self.hosts[rank]

    def close(self, timeout: float | None = None, lost: Sequence[int] = ()) -> list[Arrival]:
        # The last arrival `recv` returned was accepted: free its slot now, or it would be taken a second time here.
        self._release()
        left: list[Arrival] = []
        backoff = self._backoff
        backoff.reset()
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            # A lost worker is not waited for (it may never run again); what it has in its slot is taken all the same.
            out = [w for w in range(self.workers) if w not in lost and not self._load(self._slot(w) + 3)]
            for w in range(self.workers):
                arrival = self._take(w)
                if arrival is not None:
                    left.append(arrival)
            if not out:
                return left
            if end is not None and time.monotonic() > end:
                raise TimeoutError(
                    f"training is over but {self.describe(out)} did not stop within deadline={timeout}s "
                    "(stopped, stuck or gone)"
                )
            backoff.wait()
