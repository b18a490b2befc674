"""Server-sent parameters for round policies: the server sends a worker the parameters it waits for, so that the
worker's pull is a local test of a posted receive instead of three round trips to the server's window.

A round policy's worker reads right after each push (`loops.push(pull_next=True)`) and waits for a version it
can compute its next round on; the server knows which: `SyncPolicy.least_version(c)` for a push of round c. So
once the server has dealt with worker w's push (`WindowMailbox._release`) it owes w the first published version
>= that bound, and sends it (with the stamp and the number of w's pushes it has dealt with) as soon as it is
published. On the worker's side the receive is posted beforehand; a delivery that counts fewer of its pushes than
it made is older than its last push and is skipped (read your own writes, as with the window's slot flag).

Messages, not one-sided `Put`s into a window the worker exposes: across hosts a `Put` completes (`Flush`) only
once its target enters MPI, so a server putting to a worker that computes, is stopped or died would wait for it;
an `Isend` never blocks the server, and a message is received whole or not at all (no torn copy). At most one
delivery is in flight per worker (a newer one waits for it, and the newest is sent then), so a lost worker holds
one send and one parameter buffer, never the server.

The push goes the same way: one message holding its header (flag, version, clock) and the gradient, into a receive
the server keeps posted for each worker (a worker pushes again only once the server dealt with its last push, so
one is enough). A `Put` of the gradient needed a `Flush` (a round trip, waiting for the server to enter MPI) before
the flag could follow it, and the worker waited for that round trip before computing on: across a slow link a
round was two round trips (the push's, then the flag and the delivery). A message needs no completion before the
worker moves on, and its header and data arrive together, so the server never sees one without the other: a
round is the push one way and the delivery back, and the worker computes meanwhile.

Async and B-FASGD stay on the windows: each update would be a delivery to every worker (n times the traffic), and
SpecSync re-syncs with reads no push precedes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from collsync.runtime.mpi_channel import Channel
from collsync.runtime.mpi_windows import RmaCounts
from collsync.types import Stamp

_HDR = 4  # version, done, signal (float64 bits), pushes dealt with
_DATA, _STAMP, _PUSH = 0, 1, 3  # a mailbox's tags (`Channel.tag`): parameters, their stamp, a push
TAGS = _PUSH + 1  # the mailbox's channel holds tags 0 to the highest above
_PUSH_HDR = 3  # a push's header: flag (1: a gradient follows, 2: the header only), version, clock
# How long after a delivery went out the server, and after its stamp came the worker, yield the core between tests
# rather than sleep: a large message moves only while both sides call into MPI (over TCP, and through shared memory
# without a single-copy transfer), and the pollers' pauses are up to 1 ms. Not while a worker waits for the
# delivery itself: yielding for it on a host whose ranks outnumber its cores took cores from the others (rounds
# 1.4-1.7x longer on one host, `benchmarks/mpi_rounds.py`).
HURRY_S = 0.05


def as_int(x: float) -> int:
    """A float64's bits as an int64 (control words and stamps are int64; the stamp's signal rides in one)."""
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


def as_float(bits: int) -> float:
    return float(np.array([bits], dtype=np.int64).view(np.float64)[0])


def push_buffer(numel: int, np_t: Any) -> np.ndarray:
    """A push's message: its header's int64 words, then the gradient's bytes (rounded up to a word)."""
    return np.zeros(_PUSH_HDR + -(-numel * np.dtype(np_t).itemsize // 8), dtype=np.int64)


def gradient_of(message: np.ndarray, numel: int, np_t: Any) -> np.ndarray:
    """The gradient's part of a push's message, as its own dtype (a view)."""
    view: np.ndarray = message[_PUSH_HDR:].view(np_t)[:numel]
    return view


class Outbox:
    """The server's side: what it owes each worker and the deliveries in flight (`channel`: the mailbox's, so these
    messages never meet another protocol's nor an earlier mailbox's; `ranks[w]`: worker w's rank in it)."""

    def __init__(
        self, channel: Channel, ranks: list[int], need: Callable[[int], int], numel: int, np_t: Any, mpi_t: Any
    ) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        self.MPI, self.comm, self.tag = MPI, channel.comm, channel.tag
        self.ranks, self.need, self.np_t, self.mpi_t = ranks, need, np_t, mpi_t
        n = len(ranks)
        self.owed: dict[int, int] = dict.fromkeys(range(n), 0)  # worker -> least version it reads next
        self.live = set(range(n))  # not lost: told when training is over
        self.dealt = [0] * n  # each worker's pushes dealt with (freed)
        self.flying: dict[int, tuple[list[Any], int]] = {}  # worker -> (its delivery's requests, buffer index)
        self.stamps = [np.zeros(_HDR, dtype=np.int64) for _ in range(n)]
        self.buffers: list[np.ndarray] = []
        self.current = -1  # the buffer of the last publish
        self.stamp = Stamp(-1, False)
        self.numel = numel
        self.lost: set[int] = set()
        # One push in flight per worker (it pushes again once this one was dealt with): one receive each, posted.
        self.pushes = [push_buffer(numel, np_t) for _ in range(n)]
        self.push_reqs = [self._post_push(w) for w in range(n)]
        self.sent = 0
        self.sent_at = 0.0  # when the last delivery went out

    def hurry(self) -> bool:
        """A delivery is in flight and went out within `HURRY_S`: yield between polls, not sleep."""
        return bool(self.flying) and time.monotonic() - self.sent_at < HURRY_S

    def _post_push(self, w: int) -> Any:
        return self.comm.Irecv([self.pushes[w], self.MPI.BYTE], self.ranks[w], self.tag(_PUSH))

    def pushed(self, w: int, out: Callable[[], np.ndarray]) -> tuple[int, int, int, np.ndarray | None] | None:
        """Worker w's next push, if it came (a local test): its flag (1: a gradient, 2: a header only), version and
        clock, and its gradient copied into `out()`; the receive for the one after is posted at once."""
        if not self.push_reqs[w].Test():
            return None
        message = self.pushes[w]
        flag, version, clock = (int(x) for x in message[:_PUSH_HDR])
        grad = None
        if flag == 1:
            grad = out()
            grad[:] = gradient_of(message, self.numel, grad.dtype)
        self.push_reqs[w] = self._post_push(w)
        return flag, version, clock, grad

    def publish(self, params: np.ndarray, stamp: Stamp) -> None:
        """A new version: into a buffer no delivery in flight reads (one copy a publish), then sent where owed."""
        self.pump()
        busy = {i for _, i in self.flying.values()}
        free = [i for i in range(len(self.buffers)) if i not in busy and i != self.current]
        if not free:
            self.buffers.append(np.empty_like(params))
            free = [len(self.buffers) - 1]
        self.current = free[0]
        self.buffers[self.current][:] = params
        self.stamp = stamp
        self.send()

    def released(self, w: int, clock: int) -> None:
        """The server dealt with worker w's push of round `clock`: w waits for the version the policy lets it
        compute its next round on, and is sent it (now, if published)."""
        self.dealt[w] += 1
        self.owed[w] = self.need(clock)

    def forget(self, w: int) -> None:
        """A lost worker is owed nothing more (a delivery in flight to it stays so, holding one buffer)."""
        self.owed.pop(w, None)
        self.live.discard(w)
        self.lost.add(w)

    def pump(self) -> None:
        """Retire the deliveries that completed, and send what is owed in their place."""
        done = [w for w, (reqs, _) in self.flying.items() if self.MPI.Request.Testall(reqs)]
        for w in done:
            del self.flying[w]
        if done:
            self.send()

    def send(self) -> None:
        """Every delivery owed and due now (the published version is the one the worker waits for, or training
        is over), to each worker with none in flight."""
        stamp = self.stamp
        if self.current < 0:
            return
        due = dict.fromkeys(self.live, 0) if stamp.done else dict(self.owed)  # training over: every live worker
        for w, least in due.items():
            if w in self.flying or stamp.version < least:
                continue
            head = self.stamps[w]
            head[:] = (stamp.version, int(stamp.done), as_int(stamp.signal), self.dealt[w])
            rank, buf = self.ranks[w], self.buffers[self.current]
            reqs = [
                self.comm.Isend([head, self.MPI.INT64_T], rank, self.tag(_STAMP)),
                self.comm.Isend([buf, self.mpi_t], rank, self.tag(_DATA)),
            ]
            self.flying[w] = (reqs, self.current)
            self.sent += 1
            self.sent_at = time.monotonic()
            self.owed.pop(w, None)
            if stamp.done:
                self.live.discard(w)

    def free(self) -> None:
        """At the end: the pushes' receives cancelled; deliveries no worker took are left to the exit, and so is a
        receive a lost worker's push had begun to fill (it may never complete)."""
        for w, req in enumerate(self.push_reqs):
            req.Cancel()
            if w not in self.lost:
                req.Wait()


class Inbox:
    """A worker's side: the delivery receive posted towards server rank `server`, and the push's message."""

    def __init__(self, channel: Channel, server: int, numel: int, np_t: Any, mpi_t: Any) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        self.MPI, self.comm, self.tag, self.server, self.mpi_t = MPI, channel.comm, channel.tag, server, mpi_t
        self.head = np.zeros(_HDR, dtype=np.int64)
        self.data = np.empty(numel, dtype=np_t)
        self.numel = numel
        self.push_buf = push_buffer(numel, np_t)  # the gradient is copied in: the caller's buffer is free at once
        self.push_req: Any = None
        self.counts: RmaCounts | None = None
        self.reqs = self._post()

    def count_into(self, counts: RmaCounts) -> None:
        """`Windows.count`: each message an operation and its bytes, each receive tested in vain one local test."""
        self.counts = counts

    def _post(self) -> list[Any]:
        reqs = [
            self.comm.Irecv([self.head, self.MPI.INT64_T], self.server, self.tag(_STAMP)),
            self.comm.Irecv([self.data, self.mpi_t], self.server, self.tag(_DATA)),
        ]
        if self.counts is not None:
            self.counts.ops["Irecv"] += 2
        return reqs

    def take(self, pushes: int) -> Stamp | None:
        """The next delivery that counts all `pushes` of this worker (older ones are skipped), its parameters in
        `data` until the next `take`; None while none came (a local test: no round trip)."""
        if self.reqs and not self.MPI.Request.Testall(self.reqs) and self.reqs[0].Test():
            # The stamp came and its parameters are on their way: they move only while this rank calls MPI.
            end = time.monotonic() + HURRY_S
            while not self.reqs[1].Test() and time.monotonic() < end:
                os.sched_yield()
        while self.MPI.Request.Testall(self.reqs):
            version, done, signal, dealt = (int(x) for x in self.head)
            if self.counts is not None:
                self.counts.data_bytes += int(self.head.nbytes + self.data.nbytes)
            self.reqs = self._post() if not done else []
            if done or dealt >= pushes:
                return Stamp(version, bool(done), as_float(signal))
        if self.counts is not None:
            self.counts.tests += 1
        return None

    def push(self, grad: np.ndarray | None, version: int, clock: int) -> None:
        """The push, one message: header (flag, version, clock) and the gradient (None: the header only). The
        worker computes on at once; the server has it whole or not at all."""
        if self.push_req is not None:
            self.push_req.Wait()  # the last push's buffer is free (long since: the server dealt with that push)
        message = self.push_buf
        message[:_PUSH_HDR] = (1 if grad is not None else 2, version, clock)
        if grad is not None:
            gradient_of(message, self.numel, grad.dtype)[:] = grad
        body = message if grad is not None else message[:_PUSH_HDR]
        self.push_req = self.comm.Isend([body, self.MPI.BYTE], self.server, self.tag(_PUSH))
        if self.counts is not None:
            self.counts.ops["Isend"] += 1
            self.counts.data_bytes += int(body.nbytes)

    def free(self) -> None:
        """At the end: the posted receive cancelled (the server sends nothing after `done`). The last push is left
        to the exit, as a delivery nobody took is: a server that stopped waiting for it never matches it."""
        for req in self.reqs:
            req.Cancel()
            req.Wait()
        self.reqs = []
