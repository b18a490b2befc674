"""Server-sent parameters for the round policies and async: the server sends each worker the version it reads, so
that the worker's pull is a local test of a posted receive instead of three round trips to the server's window.

A worker reads right after each push (`loops.push(pull_next=True)`) and waits for a version it
can compute its next round on (`Worker.ready`: `SyncPolicy.least_version(c)` after a push of round c). How the
server sends it (`policy.Sent`):

* read your own writes (bsp, backup, psp, async): once the server has dealt with worker w's push
  (`WindowMailbox._release`) it owes w the first published version >= that bound, and sends it (with the number of
  w's pushes it has dealt with) as soon as it is published; a delivery that counts fewer of w's pushes than w made
  is older than its last push and is skipped, as with the window's slot flag. Under BSP that version is the one w's
  push completes; under async (bound 0) the newest, which includes w's push: one delivery a push, the traffic of the
  pull it replaces.
* streams (SSP, bound s >= 1): every publish goes to every live worker as it comes, and w takes the first version
  its bound allows, whether or not its own push has landed: the version its next round needs was published
  before its push arrived (the round before's), so push and pull cross on the way instead of following each
  other, and a worker behind a slow link computes on instead of waiting a round trip a round. A version already
  held serves again where the bound allows it. With `policy.patience` (ssp's default) the worker first holds out
  for the version its push makes (`loops.Worker.holds_out`; with `policy.usual`, as long as that version usually
  takes): its reads poll, so a held version becomes `ready`
  once the wait is over, with nothing asked of the server.

On the worker's side the receive is posted beforehand into one of two buffers (a newer version may come while the
caller copies the last one), and `take` hands over the newest.

Messages, not one-sided `Put`s into a window the worker exposes: across hosts a `Put` completes (`Flush`) only
once its target enters MPI, so a server putting to a worker that computes, is stopped or died would wait for it;
an `Isend` never blocks the server, and a message is received whole or not at all (no torn copy). At most one
delivery is in flight per worker (a newer one waits for it, and the newest is sent then), so a lost worker holds
one send and one parameter buffer, never the server. In flight is not all: a small delivery's send completes once
MPI buffered it, received or not, and the buffers of one host's ranks are few and shared by every destination
(MPICH's shared memory: 64 cells a sender). So a worker the server lost is sent `done` only (`Outbox.mute`), and a
streaming worker is sent at most `policy.Sent.ahead` deliveries beyond those it had received when it last pushed
(each push says how many): never fewer than one it is waited on needs, but a worker that stopped or is left behind
no longer takes every publish into buffers the other workers' deliveries need.

The push goes the same way: one message holding its header (flag, version, clock, deliveries received) and the
gradient, into a receive the server keeps posted for each worker (pushes of one worker arrive in order; one sent
before the last was taken waits in MPI's queue until the receive is posted again). A `Put` of the gradient needed a
`Flush` (a round trip, waiting for the server to enter MPI) before the flag could follow it, and the worker waited
for that round trip before computing on. A message needs no completion before the worker moves on, and its header
and data arrive together, so the server never sees one without the other.

Async reads by delivery for a reason of its own: the window's read is a seqlock (Get the parameters, re-read the
sequence word, retry if a publish moved it), and a worker whose two round trips take longer than the server takes
between two publishes never reads a clean copy. Across a 5 ms link, with three fast workers making the server
publish every few ms, the worker behind it made 1 step in 8 epochs; a delivery is one message, whole or not at all.
B-FASGD stays on the windows (a fetch it skips leaves a push with no read after it, and the delivery owed would wait
for the next one), and so does SpecSync (it re-syncs with reads no push precedes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from collsync.runtime.mpi_channel import Channel
from collsync.runtime.mpi_windows import RmaCounts
from collsync.types import Stamp

if TYPE_CHECKING:
    from collsync.policy import Sent

_HDR = 5  # version, done, signal (float64 bits), pushes dealt with, closer (`Stamp.closer`)
_DATA, _STAMP, _PUSH = 0, 1, 3  # a mailbox's tags (`Channel.tag`): parameters, their stamp, a push
TAGS = _PUSH + 1  # the mailbox's channel holds tags 0 to the highest above
# A push's header: flag (1: a gradient follows, 2: the header only), version, clock, and the deliveries its worker
# had received when it pushed (`Outbox.send` bounds those it is sent beyond them).
_PUSH_HDR = 4
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

    def __init__(self, channel: Channel, ranks: list[int], sent: Sent, numel: int, np_t: Any, mpi_t: Any) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        self.MPI, self.comm, self.tag = MPI, channel.comm, channel.tag
        self.ranks, self.np_t, self.mpi_t = ranks, np_t, mpi_t
        self.need, self.streams, self.ahead = sent.least, sent.streams, sent.ahead
        n = len(ranks)
        self.owed: dict[int, int] = dict.fromkeys(range(n), 0)  # worker -> least version it reads next
        self.delivered = [-1] * n  # the last version sent to each worker
        self.deliveries = [0] * n  # deliveries sent to each worker
        self.received = [0] * n  # of those, how many it had received at its last push taken (its header says)
        self.live = set(range(n))  # not lost: told when training is over
        self.dealt = [0] * n  # each worker's pushes dealt with (freed)
        self.flying: dict[int, tuple[list[Any], int]] = {}  # worker -> (its delivery's requests, buffer index)
        self.stamps = [np.zeros(_HDR, dtype=np.int64) for _ in range(n)]
        self.buffers: list[np.ndarray] = []
        self.current = -1  # the buffer of the last publish
        self.stamp = Stamp(-1, False)
        self.numel = numel
        self.lost: set[int] = set()  # forgotten at the end: sent nothing more
        self.muted: set[int] = set()  # lost during the run: sent `done` only
        # One receive posted per worker: its pushes come in order (MPI does not overtake between two ranks), and
        # one that comes before the last was taken waits in MPI's queue until the receive is posted again.
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
        flag, version, clock, received = (int(x) for x in message[:_PUSH_HDR])
        self.received[w] = max(self.received[w], received)
        grad = None
        if flag == 1:
            grad = out()
            grad[:] = gradient_of(message, self.numel, grad.dtype)
        self.push_reqs[w] = self._post_push(w)
        return flag, version, clock, grad

    def publish(self, params: np.ndarray, stamp: Stamp) -> None:
        """A new version: into a buffer no delivery in flight reads (one copy a publish), then sent to every worker
        with none in flight (the others get the newest once theirs completed)."""
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
        """The server dealt with worker w's push of round `clock`: reading its own writes, w waits for the version
        the policy lets it compute its next round on, and is sent it (now, if published); streaming, it is sent
        every version anyway."""
        self.dealt[w] += 1
        if not self.streams:
            self.owed[w] = self.need(clock)

    def mute(self, w: int) -> None:
        """The server lost worker w during the run: it is sent no version more, only `done` (should it come back,
        it ends). Each delivery to a worker that stopped stays in MPI: a small one is buffered at the server's
        side (MPICH's shared-memory cells, 64 per process, taken from the sender's pool), and streaming one
        every publish to a stopped worker took them all, after which no send to any worker went out."""
        self.owed.pop(w, None)
        self.muted.add(w)

    def forget(self, w: int) -> None:
        """A lost worker is sent nothing more (a delivery in flight to it stays so, holding one buffer)."""
        self.owed.pop(w, None)
        self.live.discard(w)
        self.lost.add(w)

    def pump(self) -> None:
        """Retire the deliveries that completed, and send the newest version in their place."""
        done = [w for w, (reqs, _) in self.flying.items() if self.MPI.Request.Testall(reqs)]
        for w in done:
            del self.flying[w]
        if done:
            self.send()

    def send(self) -> None:
        """Every delivery due now, to each live worker with none in flight: the version a worker is owed once it
        is published, or (`streams`) every version it has not had, at most `ahead` deliveries beyond those it had
        received at its last push; training over, `done` to every live worker.

        "In flight" alone does not bound what waits at a worker: a small message's send completes once MPI
        buffered it, received or not. A worker the rounds wait on never has `ahead` deliveries it had not received
        at its last push (`policy.Sent`); one that stopped, or that rounds go on without (a collection timeout), is
        sent no more until its next push says it received them, so its unreceived deliveries stay few and MPI's
        buffers serve the others."""
        stamp = self.stamp
        if self.current < 0:
            return
        for w in sorted(self.live):
            if w in self.flying:
                continue
            if not stamp.done:
                if w in self.muted:
                    continue
                if self.streams and self.deliveries[w] - self.received[w] >= self.ahead:
                    continue
            owed = w in self.owed and stamp.version >= self.owed[w]
            if not (stamp.done or owed or (self.streams and stamp.version > self.delivered[w])):
                continue
            head = self.stamps[w]
            head[:] = (stamp.version, int(stamp.done), as_int(stamp.signal), self.dealt[w], stamp.closer)
            rank, buf = self.ranks[w], self.buffers[self.current]
            reqs = [
                self.comm.Isend([head, self.MPI.INT64_T], rank, self.tag(_STAMP)),
                self.comm.Isend([buf, self.mpi_t], rank, self.tag(_DATA)),
            ]
            self.flying[w] = (reqs, self.current)
            self.sent += 1
            self.deliveries[w] += 1
            self.sent_at = time.monotonic()
            self.delivered[w] = stamp.version
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
        # Two parameter buffers: `data` holds the delivery last taken while the posted receive fills the other (a
        # newer version may come at any time).
        self.data = np.empty(numel, dtype=np_t)
        self._filling = np.empty(numel, dtype=np_t)
        self.last: Stamp | None = None  # the stamp of the delivery in `data`
        self.received = 0  # deliveries received (each push tells the server: `Outbox.send` bounds those ahead)
        self.numel = numel
        # Two push buffers, used in turn: the gradient is copied in (the caller's buffer is free at once), and a push
        # may go while the one before is still on its way.
        self._pushes = [push_buffer(numel, np_t) for _ in range(2)]
        self._push_reqs: list[Any] = [None, None]
        self._next_push = 0
        self.counts: RmaCounts | None = None
        self.reqs = self._post()

    def count_into(self, counts: RmaCounts) -> None:
        """`Windows.count`: each message an operation and its bytes, each receive tested in vain one local test."""
        self.counts = counts

    def _post(self) -> list[Any]:
        reqs = [
            self.comm.Irecv([self.head, self.MPI.INT64_T], self.server, self.tag(_STAMP)),
            self.comm.Irecv([self._filling, self.mpi_t], self.server, self.tag(_DATA)),
        ]
        if self.counts is not None:
            self.counts.ops["Irecv"] += 2
        return reqs

    def take(self, pushes: int | None) -> Stamp | None:
        """The newest delivery that came since the last `take` (older ones are passed over) and, unless `pushes` is
        None (a streaming policy), counts all `pushes` of this worker; its parameters in `data` until the next
        `take`; None while none came (a local test: no round trip)."""
        if self.reqs and not self.MPI.Request.Testall(self.reqs) and self.reqs[0].Test():
            # The stamp came and its parameters are on their way: they move only while this rank calls MPI.
            end = time.monotonic() + HURRY_S
            while not self.reqs[1].Test() and time.monotonic() < end:
                os.sched_yield()
        got = None
        while self.reqs and self.MPI.Request.Testall(self.reqs):
            version, done, signal, dealt, closer = (int(x) for x in self.head)
            if self.counts is not None:
                self.counts.data_bytes += int(self.head.nbytes + self.data.nbytes)
            self.data, self._filling = self._filling, self.data
            self.received += 1
            self.last = Stamp(version, bool(done), as_float(signal), closer)
            if done or pushes is None or dealt >= pushes:
                got = self.last
            self.reqs = self._post() if not done else []
        if got is None and self.counts is not None:
            self.counts.tests += 1
        return got

    def push(self, grad: np.ndarray | None, version: int, clock: int) -> None:
        """The push, one message: header (flag, version, clock, deliveries received) and the gradient (None: the
        header only). The worker computes on at once; the server has it whole or not at all."""
        i = self._next_push
        self._next_push = 1 - i
        if self._push_reqs[i] is not None:
            self._push_reqs[i].Wait()  # the push before last: the server has long taken it (the policy's bound)
        message = self._pushes[i]
        message[:_PUSH_HDR] = (1 if grad is not None else 2, version, clock, self.received)
        if grad is not None:
            gradient_of(message, self.numel, grad.dtype)[:] = grad
        body = message if grad is not None else message[:_PUSH_HDR]
        self._push_reqs[i] = self.comm.Isend([body, self.MPI.BYTE], self.server, self.tag(_PUSH))
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
