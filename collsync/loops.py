"""Where a runtime, the server and a policy meet: the worker step, the server loop, the allreduce loop and the
partial-allreduce loop (serverless backup workers, below `run_allreduce`).

The simulator drives the same `Worker` and `Server` from its event queue; MPI runtimes drive them from
`run_worker` / `run_server` / `run_allreduce` below. A user's own script can drive a `Worker` step by step:

    stamp = mailbox.read(model.params, worker.ready); worker.begin(stamp)
    ... loss.backward() ...;  mailbox.send(worker.arrival(model.grads.clone()))
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from collsync.flat import FlatModel
from collsync.lost import LOST_POLL_S, close_serving, lose_silent, stuck_message, until_silent
from collsync.policy import USUAL_FROM, USUAL_OF, SyncPolicy
from collsync.runtime import Collective, ServingMailbox, WorkerMailbox
from collsync.server import Server
from collsync.specsync import Aborted
from collsync.types import Arrival, Flat, Stamp

GradFn = Callable[[Flat, int, int], Flat]
"""(params, worker, batch index) -> gradient: the computation every runtime times and moves."""


class Gradients:
    """The gradient of the mean cross-entropy on worker `w`'s `j`-th batch, at the given parameters."""

    def __init__(self, flat: FlatModel, batches: object) -> None:
        self.flat = flat
        self.batches = batches

    def __call__(self, params: Flat, worker: int, index: int) -> Flat:
        x, y = self.batches.batch(worker, index)  # type: ignore[attr-defined]
        return self.at(params, x, y)

    def at(self, params: Flat, x: torch.Tensor, y: torch.Tensor) -> Flat:
        self.flat.load(params)
        self.flat.zero_grad()
        F.cross_entropy(self.flat.module(x), y).backward()
        return self.flat.grads.clone()


@dataclass
class Worker:
    """One worker's side of a policy: which round it computes and on which version, one gradient at a time."""

    rank: int
    policy: SyncPolicy
    clock: int = -1
    version: int = 0
    steps: int = 0
    seed: int = 0
    signal: float = 0.0  # the server's last published `Stamp.signal` (B-FASGD's v)
    fetches: int = 0
    # The clock `patience` is measured by: wall time under MPI, the simulator's virtual time there.
    now: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The policy's `Transmit` coin flips (B-FASGD): a private stream per worker, so runs are reproducible and
        # runtimes agree.
        self._rng = random.Random(self.seed * 1_000_003 + self.rank)
        self._began = 0.0  # when the gradient under way was started (`begin`)
        self._fresh_by: float | None = None  # until when it holds out for the version its last push makes
        self._pushed_at: float | None = None  # when its last push went (the wait for that version counts from it)
        self._waits: list[float] = []  # the waits for the fresh version over its last `USUAL_OF` pushes (`usual`)
        # Of the last `USUAL_OF` versions it read, whether its own push completed the round (`Stamp.closer`), and the
        # newest version counted.
        self._closed: list[bool] = []
        self._seen = -1

    def state_dict(self) -> dict[str, Any]:
        """Where this worker is (plain types, for a checkpoint): its round, version, count and coin stream."""
        rng = self._rng.getstate()
        return {
            "clock": self.clock,
            "version": self.version,
            "steps": self.steps,
            "signal": self.signal,
            "fetches": self.fetches,
            "rng": [rng[0], list(rng[1]), rng[2]],
            "began": self._began,
            "fresh_by": self._fresh_by,
            "pushed_at": self._pushed_at,
            "waits": list(self._waits),
            "closed": list(self._closed),
            "seen": self._seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock, self.version, self.steps = int(state["clock"]), int(state["version"]), int(state["steps"])
        self.signal, self.fetches = float(state["signal"]), int(state["fetches"])
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._began, self._fresh_by = float(state.get("began", 0.0)), state.get("fresh_by")
        self._pushed_at, self._waits = state.get("pushed_at"), [float(w) for w in state.get("waits", [])]
        self._closed, self._seen = [bool(c) for c in state.get("closed", [])], int(state.get("seen", -1))

    def will_fetch(self) -> bool:
        """Fetch at this opportunity? The policy's `transmit` decides (B-FASGD); always without one, and for a
        worker that has nothing yet."""
        t = self.policy.transmit
        return t is None or self.steps == 0 or t.fetch(self._rng, self.signal)

    def will_push(self) -> bool:
        """Push this gradient? The policy's `transmit` decides (B-FASGD); always without one, and the first one
        always goes: the server has nothing to repeat yet."""
        t = self.policy.transmit
        return t is None or self.steps == 0 or t.push(self._rng, self.signal)

    def ready(self, stamp: Stamp) -> bool:
        """May this worker start its next gradient on parameters at `stamp`? (SSP bound, BSP barrier; streaming with
        `patience`, not on an older version than its last push makes until `holds_out` says so.)"""
        if stamp.done:
            return True
        return self.policy.may_start(self.clock + 1, stamp.version) and self.holds_out(stamp) is None

    def holds_out(self, stamp: Stamp) -> float | None:
        """Until when (on `now`'s clock) this worker waits for a fresher version than `stamp`, or None.

        SSP streaming (`policy.Sent.streams`) lets a worker that pushed round c compute round c + 1 on the version
        round c - s made, without waiting for its own push to land: a round trip saved behind a slow link, but a
        round `max_lead` stale also where the version its push completes was a moment away (on one host, where the
        workers push within a fraction of a round of each other). With `policy.patience` p it holds out for that
        version (>= c + 1) at most p times the seconds its gradient took, then takes the newest its bound allows:
        behind a slow link the wait is a fraction of a round, never a round trip, and on one host most rounds are
        fresh (ssp's default rule, `rules.lookahead`, steps a round lr / max(1, its staleness): a stale round moves
        the parameters less, and eager streaming cost the Fashion-MNIST CNN 4.8 points; benchmarks/README.md).
        With `policy.usual` u it holds out at least u times the median of its last waits for that version (`_waited`):
        a lag every round has, such as a round trip behind a slow link, is waited for, and only an unusual one is not.
        Not by the worker the rounds wait on (`closes`): its wait is its own push's way to the server and the
        version's way back, which every round would then take on top of its compute; it holds out `patience` alone
        and computes on the version before, one worker's gradient a round stale instead of every round slower.
        """
        if self._fresh_by is None or stamp.version > self.clock or self.now() >= self._fresh_by:
            return None
        return self._fresh_by

    def begin(self, stamp: Stamp, fetched: bool = True) -> int:
        """Start a gradient on parameters at `stamp` (or, a fetch skipped, on those it had); returns its round."""
        now = self.now()
        self._waited(stamp, now)
        if stamp.version > self._seen and stamp.closer >= 0:
            self._seen = stamp.version
            self._closed.append(stamp.closer == self.rank)
            del self._closed[:-USUAL_OF]
        self._began, self._fresh_by, self._pushed_at = now, None, None
        self.signal = stamp.signal
        if fetched:
            self.clock = self.policy.next_clock(self.clock, stamp.version)
            self.version = stamp.version
            self.fetches += 1
        return self.clock

    def _waited(self, stamp: Stamp, now: float) -> None:
        """Remember how long the version its last push makes took to come (`usual`): the wait, where it came in
        time (a newer version than its round), else twice what it held out (it came later: the next hold doubles
        until a lag every round has is covered, while a lag of a few rounds in `USUAL_OF` leaves the median alone)."""
        if self.policy.usual is None or self._pushed_at is None or self._fresh_by is None:
            return
        came = stamp.version > self.clock
        # max(0, ...): a wall clock restarted with the process (a resume) must not make a wait negative.
        self._waits.append(max(0.0, now - self._pushed_at if came else 2.0 * (self._fresh_by - self._pushed_at)))
        del self._waits[:-USUAL_OF]

    def closes(self) -> bool:
        """Whether the rounds wait on this worker: its push completed more than half of the last versions it read
        (of `USUAL_OF`, from `USUAL_FROM` on). Behind a slow link that worker's push is the last to come every
        round; on one host the slowest worker's, whose wait for the version is then a moment."""
        return len(self._closed) >= USUAL_FROM and 2 * sum(self._closed) > len(self._closed)

    def restart(self, stamp: Stamp) -> int:
        """SpecSync (004_... Alg. 2, worker lines 5-7): the gradient under way was aborted on a re-sync; start the
        same batch over on the fresher parameters at `stamp`. Its round stays (a round policy's gradient is still for
        the round it was started for, unless that round was already applied); returns the round."""
        self.version = stamp.version
        self.fetches += 1
        self.clock = max(self.clock, stamp.version) if self.policy.rounds else stamp.version
        return self.clock

    def arrival(self, grad: Flat, done_at: float | None = None) -> Arrival:
        """Wrap the finished gradient for the server (without it, when B-FASGD skips the push). `done_at`: when it
        is finished, if not now (the simulator wraps it when it starts computing); the policy's `patience` counts
        from there (`holds_out`)."""
        patience = self.policy.patience
        if patience is not None:
            end = self.now() if done_at is None else done_at
            hold = patience * max(0.0, end - self._began)
            if self.policy.usual is not None and len(self._waits) >= USUAL_FROM and not self.closes():
                hold = max(hold, self.policy.usual * statistics.median(self._waits))
            self._fresh_by, self._pushed_at = end + hold, end
        push = self.will_push()
        self.steps += 1
        return Arrival(self.rank, self.version, grad if push else None, self.clock)


def pull(worker: Worker, mailbox: WorkerMailbox, params: Flat) -> Stamp:
    """One worker's read: wait until the policy lets it start, copy the parameters into `params` (unless B-FASGD
    skips this fetch) and begin the next gradient. A `done` stamp means training is over (`params` untouched)."""
    fetch = worker.will_fetch()
    stamp = mailbox.read(params, worker.ready, fetch=fetch)
    if not stamp.done:
        worker.begin(stamp, fetched=fetch)
    return stamp


def push(worker: Worker, mailbox: WorkerMailbox, grad: Flat, *, pull_next: bool = False) -> None:
    """One worker's send: the gradient it computed since its last `pull`, tagged with that version and round.
    `pull_next`: a `pull` follows at once (no naive wait between), so the mailbox may finish the push with the
    pull's first round trip (`WorkerMailbox.send`'s `read_next`)."""
    mailbox.send(worker.arrival(grad), read_next=pull_next)


def run_worker(
    worker: Worker, mailbox: WorkerMailbox, grads: GradFn, params: Flat, speculator: Any = None, wait: float = 0.0
) -> int:
    """Pull, compute, push until the server says done. Returns the number of gradients sent. (`collsync.torch`
    runs the same `pull` and `push` around a user's own backward pass.)

    SpecSync (004_... Alg. 2, worker side), with a `speculator` (`runtime.mpi_specsync.Speculator`): each pull
    after a push is deferred by `wait` seconds (naive waiting) and followed by a notify; a re-sync seen at a safe
    point of the computation raises `Aborted` there, and the batch starts over on fresh parameters.
    """
    while True:
        if wait > 0 and worker.steps > 0:
            time.sleep(wait)
        if pull(worker, mailbox, params).done:
            break
        if speculator is None:
            push(worker, mailbox, grads(params, worker.rank, worker.steps), pull_next=wait <= 0)
            continue
        if worker.steps > 0:
            speculator.notify()  # Alg. 2 lines 8-10: push, pull, notify
        grad = _speculative(worker, mailbox, grads, params, speculator)
        if grad is None:
            break
        push(worker, mailbox, grad, pull_next=wait <= 0)
    return worker.steps


def _speculative(worker: Worker, mailbox: WorkerMailbox, grads: GradFn, params: Flat, speculator: Any) -> Flat | None:
    """Compute the next gradient, starting it over on fresh parameters each time a re-sync aborts it (the abort,
    with the model seconds thrown away, reported to the scheduler's rank). None: training ended meanwhile."""
    started = time.monotonic()
    while True:
        speculator.state.start(worker.version)
        try:
            grad = grads(params, worker.rank, worker.steps)
        except Aborted:
            wasted = (time.monotonic() - started) / speculator.scale
            if speculator.resync(worker, mailbox, params, wasted).done:
                return None
            started = time.monotonic()
            continue
        speculator.state.finish()
        return grad


# How often a server whose workers decide when training ends (`until_left`) looks for workers that left.
_LEFT_POLL_S = 0.02
# How long a server with a `between` hook (checkpoints, signals) waits at most before calling it again.
_BETWEEN_POLL_S = 0.25


def _shorter(wait: float | None, bound: float | None) -> float | None:
    """The shorter of two waits, None being no bound."""
    return wait if bound is None else bound if wait is None else min(wait, bound)


def run_server(
    server: Server,
    mailbox: ServingMailbox,
    on_update: Callable[[Server], None] | None = None,
    *,
    until_left: bool = False,
    publish_delay: float = 0.0,
    between: Callable[[Server], None] | None = None,
    poll: Callable[[], float] | None = None,
    waiting: Callable[[list[int]], None] | None = None,
) -> Server:
    """Receive, accept, publish until `server.done`; then drop what is still in flight.

    Two clocks run here, as in the simulator: the policy's collection `timeout` starts once per update when the
    server starts collecting (`Server.collecting`) and flushes the update when it fires; the `deadline` is the
    longest the server waits on a worker: one that owes a gradient (none of its gradients is buffered) and sent
    nothing for `deadline` seconds is lost (`Server.lose`: the others go on without it where the policy allows,
    else the run stops naming the workers it waits on). At the end, lost workers are not waited for.

    `until_left`: the workers' own loops decide when training ends (`collsync.torch`), not `server.steps`. The
    server stops (`Server.stop`) once every worker left a stream policy, or once any worker left a round policy
    (the rounds it would have joined can no longer complete); the others then read `done` (`departed()` names
    the workers that left). Under PSP, the workers that wait in another collective of their script (`away()`)
    push nothing meanwhile, and a round counts only the others (`Server.pushing`).

    The hooks: `publish_delay`, a slow server (`stragglers=slow_server`) busy that many seconds after each update
    before workers see the new version, as the simulator models it; `between(server)`, after each message (or quiet
    `_BETWEEN_POLL_S`), where the server's state is whole (a checkpoint is written there, a stop asked for by a
    signal raised); `poll()`, on every turn (SpecSync's scheduler co-located here), returning the monotonic time by
    which it must be called again (a bound on the wait for the next gradient); `waiting(out)`, once, when training
    is over but workers `out` are still out after a short wait (`lost.close_serving`), before the rest of the wait.
    """
    policy = server.policy
    mailbox.publish(server.view(), server.stamp())
    flush_at: float | None = None
    last = time.monotonic()  # the last time anything arrived (the deadline counts from it)
    looked = looked_lost = last
    heard = [last] * server.workers  # the last time each worker sent anything
    while not server.done:
        fires = server.arm(time.monotonic())  # a collection timeout armed now, else the one running (if any)
        flush_at = fires if fires is not None else flush_at
        wait = policy.deadline if flush_at is None else max(0.0, flush_at - time.monotonic())
        if wait is not None and policy.deadline is not None:
            wait = min(wait, until_silent(server, heard, last))  # the quietest live worker may be lost then
        wait = _shorter(wait, _LEFT_POLL_S if until_left else None)
        wait = _shorter(wait, _BETWEEN_POLL_S if between is not None else None)
        wait = _shorter(wait, max(0.0, poll() - time.monotonic()) if poll is not None else None)
        arrival = mailbox.recv(timeout=wait)
        now = time.monotonic()
        before = server.version
        if arrival is not None:
            last = heard[arrival.worker] = now
            server.accept(arrival)
            if not server.holds(arrival.grad):
                mailbox.recycle(arrival.grad)  # no allocation per receive: its buffer takes the next gradient
        elif flush_at is not None and now >= flush_at:
            server.expire(server.version)
        if policy.deadline is not None and now - looked_lost >= LOST_POLL_S:
            looked_lost = now
            if lose_silent(server, mailbox, heard, now):
                last = now  # the update may have been waiting on it alone: the deadline starts over
            elif arrival is None and flush_at is None and now - last >= policy.deadline:
                raise TimeoutError(stuck_message(server, mailbox.describe))
        if until_left and (arrival is None or now - looked >= _LEFT_POLL_S):
            looked = now
            left = mailbox.departed()
            if left and (policy.rounds or len(set(left) | set(server.lost)) == server.workers):  # every live one
                server.stop()
            elif policy.partial_push:
                server.pushing(mailbox.away())  # PSP: a round counts the workers not in another collective
        if server.version != before or server.done:
            flush_at, last = None, now
            if publish_delay and server.version != before:
                time.sleep(publish_delay)
            mailbox.publish(server.view(), server.stamp())
            if on_update is not None:
                on_update(server)
        if between is not None and not server.done:
            between(server)
    for arrival in close_serving(server, mailbox, waiting):
        server.accept(arrival)
    return server


def run_allreduce(
    server: Server,
    collective: Collective,
    grads: GradFn,
    on_update: Callable[[Server], None] | None = None,
    *,
    averaged: bool = False,
) -> Server:
    """Serverless BSP: every rank holds a replica of the server; the mean gradient comes from an allreduce.

    Each replica applies the same mean with the same rule, so replicas stay identical without a broadcast.
    `averaged=True`: `grads` returns the mean over ranks already (`mpi_buckets.BucketReducer.averaged` reduces it in
    buckets during the backward pass), so no allreduce is added here.
    """
    # Every round every rank computes one gradient: its batch index is the version (also after a resume).
    worker = Worker(collective.rank, server.policy, steps=server.version)
    while not server.done:
        stamp = server.stamp()
        worker.begin(stamp)
        # The gradient function copies the view into the model itself: no copy of our own here.
        g = grads(server.view(), collective.rank, worker.steps)
        if not averaged:
            g = collective.allreduce_mean(g)
        worker.steps += 1
        server.apply_mean(g, [Arrival(r, stamp.version, g, stamp.version) for r in range(collective.size)])
        if on_update is not None:
            on_update(server)
    return server


# -- serverless backup workers ---------------------------------------------------------------------------
# Serverless backup workers: every rank holds a `Server` replica and averages through a k-of-n partial allreduce.
#
# Each round t (000_..., Chen et al., Alg. 3-4 with the parameter server replicated on every worker):
#
#     mean, contributors, dropped = pa(grad L(theta_t), quorum=N, round=t)     # the first N of the N + b gradients
#     server.apply_mean(mean, contributors)                                      # theta_{t+1}, identical everywhere
#     server.accept(late) for each dropped rank                                  # the b late ones: dropped, traced
#
# `quorum` = n (`sync=bsp`) is serverless BSP: the partial allreduce's full rounds are one MPI allreduce, so the
# parameters equal `run_allreduce`'s to float tolerance, and bit for bit wherever the sum is exact (on float64 small
# integers always); partial rounds sum in rank order. A rank whose round is already complete when it gets there reads
# the mean without computing a gradient that would be dropped (`PartialAllreduce.try_read`: the serverless form of a
# backup worker skipping to the server's round, `policy.next_clock`). A rank up to `depth` rounds behind catches up by
# reading the means it missed, in order; further behind, the fast ranks wait for it (see
# `collsync.runtime.mpi_partial`).
#
# `runtime=partial` runs it from `collsync.train` (`sync=bsp` or `sync=backup`). A frozen worker stalls the others
# once it is `depth` rounds behind; with `sync.deadline` as the partial allreduce's `timeout`, the run then fails naming
# what it waited for instead of hanging.


def check_policy(policy: SyncPolicy) -> None:
    """A partial allreduce completes rounds in order with a fixed quorum: BSP and backup workers, nothing else."""
    if not policy.rounds or policy.max_lead or policy.timeout is not None:
        raise ValueError(
            f"runtime=partial runs sync=bsp or sync=backup (rounds, no lead, no timeout); got sync={policy.name} "
            f"(rounds={policy.rounds}, max_lead={policy.max_lead}, timeout={policy.timeout})"
        )
