"""A parameter-server `Mailbox` on MPI one-sided windows: workers pull with MPI_Get and push with MPI_Put.

One window, hosted by the server rank (workers expose zero bytes), in 8-byte words:

    ctrl    int64[4 + 4 * workers]   [seq, version, done, signal] then per worker [full, version, clock, finished]
    params  float[numel]             the published parameters (from a word boundary)
    slots   float[workers * numel]   one gradient slot per worker (each from a word boundary; none where pushes
                                     are messages, below)

One window, so that whatever a worker posts to the server in one go is completed by one `Flush`: one round trip.
Every access is an RMA call inside one `Lock_all` epoch, completed with `Flush`, and control words are touched only
by atomics (`collsync.runtime.mpi_windows`), so neither side ever waits for the other to call MPI and a flag is
never read half-written. A worker's round is four round trips when nothing has to be waited for (push 1, pull 3),
a poll one (`benchmarks/mpi_rounds.py` counts them); MPI orders no two operations of one `Flush` but those on the
same word, which is what the seqlock's and the flag's extra round trips are for. Under a round policy or async
(`sends`) the server sends each worker the parameters it waits for instead, and the push is one message holding its
header and gradient (`runtime.mpi_sent`): a round is no round trip at all, the push one way and the delivery back,
the pull a local test; the window still holds every publish (the first read's fallback, evaluators' `snapshot`,
PSP's stale blocks) and the slot word then counts the pushes dealt with.

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
* away (worker): `finished` <- 2 while its script waits in another collective, 0 before its next push (PSP's
  rounds count the others meanwhile, `Server.pushing`); `finished` <- 1 is for good.
* close (server): after the final publish (done), wait until every worker set `finished` (1); gradients still in
  slots are returned so the server can drop them (every push is applied or dropped exactly once).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from collsync.runtime.mpi_rma_serve import AWAY, FINISHED, ServedWindow
from collsync.runtime.mpi_sent import as_float
from collsync.runtime.placement import named_rank
from collsync.types import Arrival, Flat, Stamp


class WindowMailbox(ServedWindow):
    """The server's window (`ServedWindow`: its constructor, collective over `comm`, and the server's side) with
    the workers' side: `read`, `send` and `leave`."""

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
                f"worker {self.worker}: no word from the server, rank {named_rank(self.comm, self.server)}{host}, for "
                f"{self.silence:g}s "
                f"(it stopped, hangs or died; at last seen step {int(self._hdr[1])})"
            )

    def _saw(self, seq: int) -> None:
        if seq != self._heard[0]:
            self._heard = (seq, time.monotonic())

    def try_read(
        self, out: Flat, ready: Callable[[Stamp], bool], fetch: bool = True, *, window: bool = False
    ) -> Stamp | None:
        """One look: None if nothing is published or the stamp is not `ready` (then `out` is untouched); else the
        stamp, with the parameters copied into `out` (a copy torn by a concurrent publish is retried until clean:
        versions only grow, so the newer one is ready too). With server-sent parameters, the first read and each
        read after a push look at the delivery instead (no round trip); `window`: the window all the same."""
        if self._finished is not None:
            return self._finished
        buf = out.detach().numpy()
        # Streaming, every read looks at the deliveries (each publish comes; the last is `done`, which must be taken
        # from its message, not left in MPI's queues at the end).
        if self.inbox is not None and not window and (self._sent or not self._read_once or self.outbox_streams):
            return self._try_inbox(buf, ready, fetch)
        self._read_once = True
        torn = False  # `out` holds a copy torn by a publish: retry until it is clean, never hand it back as is
        while True:
            seq, version, done, signal = (int(x) for x in self._poll())
            self._saw(seq)
            if seq % 2 and torn:
                self._backoff.wait()
                continue
            if seq == 0 or seq % 2:  # 0: nothing published yet; odd: a publish is under way
                return None
            stamp = Stamp(version, bool(done), as_float(signal))
            if stamp.done:
                return self._finish(stamp)
            if self._sent:
                # Read your own writes, as a parameter server answers a push with the parameters it produced
                # (001_... Alg. 1-2) and as the simulator does: wait until the server dealt with our last push.
                if not self._freed(int(self._full[0])):
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

    def _freed(self, full: int) -> bool:
        """Worker: the slot's word says the server dealt with our last push (0; with server-sent parameters, the
        word counts the pushes dealt with)."""
        return full >= self._posts if self.inbox is not None else full == 0

    def _try_inbox(self, buf: np.ndarray, ready: Callable[[Stamp], bool], fetch: bool) -> Stamp | None:
        """The newest delivery, if one came (a local test) and is `ready`; a quiet server's header is looked at once
        a second, for `check_alive`. Reading its own writes, the delivery that follows this worker's last push;
        streaming (`policy.Sent.streams`), the first version the policy lets it compute on, whether or not its own
        last push has landed (every publish is delivered, so one not ready is followed by a newer one)."""
        assert self.inbox is not None
        self.answered = now = time.monotonic()  # not blocked in MPI: the watchdog has nothing to see
        streams = self.outbox_streams
        stamp = self.inbox.take(None if streams else self._posts)
        if stamp is None:
            # Streaming (SSP), the version already held may be one the next round may use.
            last = self.inbox.last if streams else None
            if last is None or last.done or not ready(last):
                if now - self._heard[1] >= 1.0:
                    self._saw(int(self._load_header()[0]))
                return None
            stamp = last
        self._heard = (-1, now)
        self._read_once = True
        if stamp.done:
            return self._finish(stamp)
        if not ready(stamp):
            return None
        self._sent, self._free = False, True
        if fetch:
            buf[:] = self.inbox.data
            self.bytes_fetched += buf.nbytes
        return stamp

    def _finish(self, stamp: Stamp) -> Stamp:
        """Worker: training is over on this server. FINISHED tells `close` to stop waiting for us; from now on
        every read returns this stamp, whatever path it takes: a read of the window (a partial pull's stale one
        included) can see `done` first, and `close` may then end before `done` went out as a delivery."""
        if self.worker >= 0:
            self.leave()
            self._finished = stamp
        return stamp

    def snapshot(self, out: Flat) -> Stamp:
        """The parameters last published, copied into `out` (any rank, e.g. an evaluator; never marks finished)."""
        backoff = self._backoff
        backoff.reset()
        while True:
            seq, version, done, signal = (int(x) for x in self._load_header())
            if seq > 0 and seq % 2 == 0 and self._get_params(out.detach().numpy(), seq):
                return Stamp(version, bool(done), as_float(signal))
            backoff.wait()

    def _get_params(self, buf: np.ndarray, seq: int) -> bool:
        """Get the published parameters into `buf`; False if a publish moved `seq` meanwhile (the copy is torn)."""
        self.win_box.Get([buf, self._mpi_t], self.server, target=self.target())
        self.win_box.Flush(self.server)
        return self._load(0) == seq

    def peek(self) -> Stamp:
        """The stamp last published (possibly mid-publish: for polling only, never to read parameters by)."""
        _, version, done, signal = (int(x) for x in self._load_header())
        return Stamp(version, bool(done), as_float(signal))

    def send(self, arrival: Arrival, *, read_next: bool = False) -> None:
        """Hand the gradient to the server: `post` and `complete` (a `ShardedMailbox` posts to every shard first)."""
        self.post(arrival)
        self.complete(read_next=read_next)

    def post(self, arrival: Arrival) -> None:
        """The first half of `send`: once the slot is free, the gradient and its (version, clock) posted, not
        completed."""
        slot = self._slot(self.worker)
        self._backoff.reset()
        # A push by message need not wait for the last one to be dealt with: MPI queues it in order at the server.
        while self.inbox is None and not self._free and not self._freed(self._load(slot)):
            self._saw(int(self._load_header()[0]))
            self.check_alive()
            self._backoff.wait()
        grad = None if arrival.grad is None else arrival.grad.detach().to(self.dtype).contiguous().numpy()
        if self.inbox is not None:
            self.inbox.push(grad, arrival.version, arrival.clock)  # one message, complete at the server as a whole
        else:
            if grad is not None:
                self.win_box.Put([grad, self._mpi_t], self.server, target=self.target(self.worker))
            self._pair[:] = (arrival.version, arrival.clock)  # in one atomic-per-word write
            self._ctrl.store_many(slot + 1, self._pair, flush=False)
        self.bytes_pushed += 0 if grad is None else grad.nbytes
        self._full[0] = 1 if arrival.grad is not None else 2  # 2 = header only
        self._free = False
        self._posts += 1

    def complete(self, *, read_next: bool = False) -> None:
        """The second half of `send`: one Flush for the gradient and its header (a round trip, and off shared memory
        one that waits for the server to enter MPI), then the flag. With `read_next` (the caller reads right
        after) the flag is only posted: the read's first poll completes it in its own round trip. A push by
        message (server-sent parameters) has nothing to complete: no round trip at all."""
        if self.inbox is None:
            self.win_box.Flush(self.server)
            # Last: the data and header are complete at the target before the flag says so.
            self._ctrl.store_many(self._slot(self.worker), self._full, flush=not read_next)
        self._sent = True

    def mark_away(self, away: bool) -> None:
        """Worker: `True` while this worker pushes nothing for a while (its script waits in another collective),
        `False` before its next push; a PSP server's rounds count only the others meanwhile (`Server.pushing`).
        Never after `leave` or the final `done`: the word says finished for good."""
        if self.worker >= 0:
            self._store(self._slot(self.worker) + 3, AWAY if away else 0)

    def leave(self) -> None:
        """Worker: training is over for this worker (its script's loop ended). A server running `until_left`
        stops once the policy can go on without it; `close()` stops waiting for it."""
        if self.worker >= 0:
            self._store(self._slot(self.worker) + 3, FINISHED)
