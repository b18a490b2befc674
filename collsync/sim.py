"""The deterministic discrete-event simulator: many workers in one process, on a seeded virtual clock.

It drives the very `Worker` and `Server` objects the MPI runtimes drive (`collsync.loops`), so an algorithm studied
here is the algorithm deployed. What it adds is time: each gradient takes a compute time and a message delay drawn
from a seeded straggler model (`collsync.stragglers`), and events are processed in (time, sequence) order.

The gradient itself is computed, for real, when a worker starts (on the parameters it read then); only its arrival
waits for the virtual clock. Same seed, same config -> bit-identical parameters and trace (the FRED idea of 002_...).

SpecSync (`policy.speculation`, 004_... Alg. 2) runs on the same clock: a worker's start after a push is its
notify to the `collsync.specsync.Scheduler`; the scheduler's timers are events; a re-sync reaches the worker at
once, and if it is still computing and the server has a newer version, its gradient is aborted (its push event
cancelled, an `abort` event traced with the compute thrown away) and the same batch restarts on fresh parameters,
taking its whole compute time again. Naive waiting defers every start after a push by `wait` seconds.

Backup rounds (`sync=backup`) are modelled as `collsync.rounds` runs them between real ranks, with the same keys:
a `margin` lets a round take every gradient within that many model seconds of its quorum-th (`Server.wait_after_
quorum`; "auto": `margin.Margin` fed by `margin.RoundTimes` on this clock), and `catch_up` has a late worker
join the current round, each worker computing the batch `ledger.Ledger` hands it (a dropped gradient's batch goes
to a worker in time); compute times are drawn for the worker and its batch's index, as `runs.delays.injected` does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from collsync.ledger import Ledger
from collsync.loops import GradFn, Worker
from collsync.margin import Margin, RoundTimes, check_margin
from collsync.policy import SyncPolicy
from collsync.server import Server
from collsync.specsync import Scheduler, SpecWorker
from collsync.trace import Trace
from collsync.types import Arrival, Flat

_PUSH, _TIMEOUT, _WAKE, _TIMER, _PULL, _FREE = 0, 1, 2, 3, 4, 5  # _TIMER: SpecSync's scheduler; _PULL: naive waiting
# _FREE: a streaming policy's worker done computing while its push is still on its way (`policy.Sent.streams`)


def backup_rounds(policy: SyncPolicy) -> bool:
    """Rounds that drop backups (`sync=backup`): a margin and catch-up apply to them."""
    return policy.rounds and policy.backups > 0 and not policy.max_lead and policy.timeout is None


class Deadlock(RuntimeError):
    """The simulated server waits for gradients that can never come (e.g. BSP with a frozen worker)."""


class Simulator:
    """Runs `workers` simulated workers against one `Server` on a virtual clock.

    `stragglers` is a `collsync.stragglers.Stragglers` (or None for a constant compute time of 1 s per batch).
    """

    def __init__(
        self,
        workers: int = 8,
        stragglers: Any = None,
        seed: int = 0,
        margin: float | str | None = None,
        catch_up: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"runtime: {workers=} must be >= 1")
        check_margin(margin)
        self.workers, self.seed = workers, seed
        # Backup rounds (`policy.backups`), as `collsync.rounds` runs them between real ranks (module docstring).
        self.margin, self.catch_up = margin, catch_up
        self._times: RoundTimes | None = None
        self.ledger: Ledger | None = None  # backup rounds with catch-up: which batch each worker computes
        self._began = [0.0] * workers  # when each worker's gradient under way started
        self.sampler = stragglers.sampler(workers, seed) if stragglers is not None else None
        self.now = 0.0
        self._frozen_clock: float | None = None
        self.trace = Trace(clock=lambda: self.now if self._frozen_clock is None else self._frozen_clock)
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        # The run's state between events (set up by the first `run`, or by `load_state_dict`).
        self._workers: list[Worker] = []  # none until the first `run` or `load_state_dict`
        self._held: list[Flat | None] = [None] * workers  # what each worker computes on
        self._waiting: set[int] = set()  # held back by the policy until the next update
        self._frozen_set: set[int] = set()  # frozen by the straggler model
        self._busy_until = 0.0  # a slow server's end of its last update
        # SpecSync (set up by `run` or `load_state_dict` when the policy speculates or waits).
        self.scheduler: Scheduler | None = None
        self._current: list[list[float] | None] = [None] * workers  # computing: [start time, push event's seq]
        self._streams = False  # the policy streams its versions (`policy.Sent`): set by `run`
        self._spec = [SpecWorker() for _ in range(workers)]  # each worker's side of abort and restart
        self._cancelled: set[int] = set()  # seqs of the push events of aborted gradients
        self._pull_at = [0.0] * workers  # naive waiting: no pull before this time
        self._deferred: set[int] = set()  # workers with a _PULL event pending

    def _clock(self) -> float:
        """The simulated time (a `Worker`'s clock, for `policy.patience`)."""
        return self.now

    def _schedule(self, t: float, kind: int, worker: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, worker, payload))
        self._seq += 1

    def _compute_time(self, worker: int, index: int) -> tuple[float, float]:
        """The gradient's compute time and its push's message delay."""
        if self.sampler is None:
            return 1.0, 0.0
        return float(self.sampler.compute_time(worker, index)), float(self.sampler.message_delay(worker, index))

    def run(
        self,
        server: Server,
        grads: GradFn,
        on_update: Callable[[Server], None] | None = None,
        between: Callable[[], None] | None = None,
    ) -> Server:
        """Simulate until the server is done; gradients in flight at the end are dropped (and traced).

        `between()` is called between two events, where `state_dict()` is complete (a checkpoint is taken there);
        it may raise to end the run. A simulator restored with `load_state_dict` goes on from that point.
        """
        if server.workers != self.workers:
            raise ValueError(f"runtime: simulator has {self.workers} workers, server expects {server.workers}")
        if server.trace is not self.trace:
            raise ValueError("runtime: build the Server with trace=simulator.trace so events carry simulated time")
        self._server, self._grads = server, grads
        sent = server.policy.sent()
        self._streams = sent is not None and sent.streams
        self._backup_rounds(server)
        if not self._workers:
            self._speculate(server.policy)
            self._workers = [Worker(w, server.policy, seed=self.seed, now=self._clock) for w in range(self.workers)]
            for w in range(self.workers):
                self._try_start(w)
        slow = self.sampler.model.slow_server if self.sampler is not None else 0.0
        while self._heap:
            if between is not None and not server.done:
                between()
            t, seq, kind, w, payload = heapq.heappop(self._heap)
            self.now = t
            if kind == _PUSH and seq in self._cancelled:
                self._cancelled.discard(seq)  # an aborted gradient: it never leaves its worker
                continue
            current = self._current[w] if kind == _PUSH else None
            if current is not None and current[1] == seq:
                self._current[w] = None  # its computation is over: a re-sync now comes too late to abort it
                self._spec[w].finish()
                if self.scheduler is not None:
                    self._pull_at[w] = t + self.scheduler.speculation.wait
            if kind == _TIMER:
                if not server.done:
                    self._resync(server)
                continue
            if kind == _PULL:
                self._deferred.discard(w)
                self._try_start(w)
                continue
            if kind == _FREE:
                self._current[w] = None
                self._try_start(w)
                continue
            if kind == _PUSH and t < self._busy_until:
                # A slow server is still busy with its last update: the gradient waits for it, in arrival order.
                self._schedule(self._busy_until, _PUSH, w, payload)
                continue
            if kind == _WAKE:
                for v in payload:
                    self._try_start(v)
                continue
            self._deliver(server, kind, w, payload, slow, on_update)
        if not server.done:
            raise Deadlock(
                f"sync={server.policy.name}: the simulated server stopped at version {server.version} of "
                f"{server.steps}: no gradient can arrive (frozen worker(s) {sorted(self._frozen_set)}, waiting "
                f"worker(s) {sorted(self._waiting)}); a round that needs a frozen worker never completes: use a policy "
                "that goes on without it (sync=backup, sync=async, sync=psp, or sync=ssp with sync.timeout)"
            )
        server.drain()
        return server

    def _deliver(
        self,
        server: Server,
        kind: int,
        w: int,
        payload: Any,
        slow: float,
        on_update: Callable[[Server], None] | None,
    ) -> None:
        """A gradient (`_PUSH` from worker `w`) or a collection timeout (`_TIMEOUT`) reaches the server; then start
        the pusher and every worker the policy held back, if an update let them go (after a slow server's pause)."""
        before, limit = server.version, None
        if kind == _PUSH:
            arrival: Arrival = payload
            times = self._times
            if times is not None:
                times.quorum = server.quorum  # fewer once a worker is lost
            if server.accept(arrival) and times is not None and arrival.clock == before and times.arrived(self.now):
                # The round's quorum-th gradient: its margin from the period and this worker's step (its compute).
                limit = times.limit(self.now, self.now - self._began[w])
        else:
            server.expire(payload)
        if self._times is not None and server.version != before:
            self._times.applied(complete=self._times.count >= server.full)
        if self.ledger is not None and server.version != before:  # one round an event: its contributors its last
            self.ledger.settle([v for v in range(self.workers) if server.contributed[v] == server.version])
        woken = {w} if kind == _PUSH else set()
        if server.version != before:
            if on_update is not None:
                on_update(server)
            woken |= self._waiting
            self._waiting.clear()
        self._arm_timeout(server, limit)
        if slow > 0 and server.version != before and not server.done:
            # Workers see the new version only once the slow server is done with it.
            self._busy_until = self.now + slow
            self._schedule(self._busy_until, _WAKE, -1, sorted(woken))
            woken = set()
        for v in sorted(woken):
            self._try_start(v)
        if server.done and self._frozen_clock is None:
            # Gradients still in flight are dropped "at" the end of training, not when they would have landed.
            self._frozen_clock = self.now

    def _try_start(self, w: int) -> None:
        server, worker = self._server, self._workers[w]
        stamp = server.stamp()
        if stamp.done or self._current[w] is not None:
            return
        if self._pull_at[w] > self.now:
            # Naive waiting (004_... §III-B): the pull after a push is deferred by `wait`.
            if w not in self._deferred:
                self._deferred.add(w)
                self._schedule(self._pull_at[w], _PULL, w, None)
            return
        if not worker.ready(stamp):
            self._waiting.add(w)
            until = worker.holds_out(stamp)
            if until is not None:
                # Streaming with patience: it takes what its bound allows once it held out long enough.
                self._schedule(until, _WAKE, -1, [w])
            return
        if self.sampler is not None and self.sampler.is_frozen(w, self.now):
            self._frozen_set.add(w)
            return
        fetch = worker.will_fetch()
        clock = worker.begin(stamp, fetched=fetch)
        if fetch:
            # Workers that may skip a fetch (B-FASGD) keep computing on their own copy.
            self._held[w] = server.view().clone() if server.policy.bandwidth_aware else server.view()
        extra = {"fetched": fetch} if server.policy.bandwidth_aware else {}
        self.trace.record("start", worker=w, clock=clock, version=worker.version, **extra)
        if self.scheduler is not None and worker.steps > 0:
            # Alg. 2, worker lines 8-10: push, pull, then notify; the scheduler opens this worker's period.
            self.scheduler.notify(w, self.now)
            self._spec[w].notify()  # the scheduler's iteration for this worker: its re-sync names it
            due = self.scheduler.timers[w]
            if due is not None:
                self._schedule(due, _TIMER, w, None)
        self._compute(w)

    def _compute(self, w: int) -> None:
        """Compute worker w's next gradient on what it holds; its push lands after the drawn compute time."""
        worker, shard, index = self._workers[w], w, self._workers[w].steps
        if self.ledger is not None:  # catch-up: the chunk handed out for the round it computes for
            shard, index = self.ledger.batch(w)
        self._began[w] = self.now
        params = self._held[w]
        assert params is not None  # a worker's first opportunity always fetches
        compute, delay = self._compute_time(w, index)
        arrival = worker.arrival(self._grads(params, shard, index), done_at=self.now + compute)
        self._current[w] = [self.now, self._seq]
        self._spec[w].start(worker.version)
        self._schedule(self.now + compute + delay, _PUSH, w, arrival)
        if delay > 0 and self._streams:
            # Its next round may start on a version its bound allows before this push lands, as the servers' MPI
            # front sends every version as it is published (`runtime.mpi_sent`).
            self._schedule(self.now + compute, _FREE, w, None)

    def _speculate(self, policy: SyncPolicy) -> None:
        """A scheduler for a policy that speculates or waits (SpecSync), none otherwise."""
        spec = policy.speculation
        self.scheduler = Scheduler(self.workers, spec) if spec is not None else None

    def _resync(self, server: Server) -> None:
        """Fire the scheduler's timers due now; each re-sync aborts a gradient still under way on a version older
        than the server's (a re-sync that would restart on the same parameters gains nothing: it is ignored)."""
        assert self.scheduler is not None
        for w, iteration in self.scheduler.expire(self.now):
            spec, worker, current = self._spec[w], self._workers[w], self._current[w]
            if not spec.resync(iteration, server.stamp().version):
                continue
            assert current is not None  # a gradient under way (`SpecWorker.computing`) has its push event
            started, seq = current
            self._cancelled.add(int(seq))
            self._current[w] = None
            worker.steps -= 1  # the aborted gradient was never sent: its batch is computed again
            wasted = self.now - started
            spec.aborted(wasted)
            self.trace.record("abort", worker=w, clock=worker.clock, version=worker.version, wasted=wasted)
            clock = worker.restart(server.stamp())
            self._held[w] = server.view()
            self.trace.record("start", worker=w, clock=clock, version=worker.version, restart=True)
            self._compute(w)

    @property
    def spec_stats(self) -> dict[str, float]:
        """SpecSync's worker-side counts, summed over the workers: aborts, the model seconds they threw away, and
        the re-syncs ignored (for a gradient already pushed, or with no newer version to restart on)."""
        return {
            "aborts": sum(spec.aborts for spec in self._spec),
            "wasted_s": math.fsum(spec.wasted_s for spec in self._spec),
            "resyncs_ignored": sum(spec.ignored for spec in self._spec),
        }

    def state_dict(self) -> dict[str, Any]:
        """The simulation between two events, in plain types (for a checkpoint; the server's state is its own)."""
        assert self._workers, "state_dict() of a simulator that never ran"
        heap = [
            [t, seq, kind, w, payload._asdict() if kind == _PUSH else payload]
            for t, seq, kind, w, payload in self._heap
        ]
        return {
            "now": self.now,
            "frozen_clock": self._frozen_clock,
            "heap": heap,
            "seq": self._seq,
            "workers": [w.state_dict() for w in self._workers],
            "held": [h.clone() if h is not None else None for h in self._held],
            "waiting": sorted(self._waiting),
            "frozen": sorted(self._frozen_set),
            "busy_until": self._busy_until,
            "backup": {"began": list(self._began), "times": None if self._times is None else asdict(self._times)},
            "ledger": None if self.ledger is None else self.ledger.state_dict(),
            "specsync": None
            if self.scheduler is None
            else {
                "scheduler": self.scheduler.state_dict(),
                "current": [list(c) if c is not None else None for c in self._current],
                "workers": [asdict(spec) for spec in self._spec],
                "cancelled": sorted(self._cancelled),
                "pull_at": list(self._pull_at),
                "deferred": sorted(self._deferred),
            },
        }

    def load_state_dict(self, state: dict[str, Any], policy: SyncPolicy) -> None:
        """Go on from `state_dict()` (before `run`, with the server restored from the same checkpoint)."""
        if len(state["workers"]) != self.workers:
            raise ValueError(f"checkpoint: a simulation of {len(state['workers'])} workers, not {self.workers}")
        self.now, self._frozen_clock, self._seq = float(state["now"]), state["frozen_clock"], int(state["seq"])
        self._heap = [
            (t, seq, kind, w, Arrival(**payload) if kind == _PUSH else payload)
            for t, seq, kind, w, payload in state["heap"]
        ]
        heapq.heapify(self._heap)
        self._workers = [Worker(w, policy, seed=self.seed, now=self._clock) for w in range(self.workers)]
        for worker, saved in zip(self._workers, state["workers"], strict=True):
            worker.load_state_dict(saved)
        self._held = list(state["held"])
        self._waiting, self._frozen_set = set(state["waiting"]), set(state["frozen"])
        self._busy_until = float(state["busy_until"])
        backup = state.get("backup") or {}
        self._began = list(backup.get("began", self._began))
        if backup.get("times") is not None:
            times = dict(backup["times"])
            self._times = RoundTimes(**{**times, "margin": Margin(**times["margin"])})
        if state.get("ledger") is not None:
            self.ledger = Ledger.from_state(self.workers, state["ledger"])
        self._speculate(policy)
        spec = state.get("specsync")
        if self.scheduler is not None and spec is not None:
            self.scheduler.load_state_dict(spec["scheduler"])
            self._current = [list(c) if c is not None else None for c in spec["current"]]
            self._spec = [SpecWorker(**saved) for saved in spec["workers"]]
            self._cancelled = set(spec["cancelled"])
            self._pull_at, self._deferred = list(spec["pull_at"]), set(spec["deferred"])

    def _backup_rounds(self, server: Server) -> None:
        """Backup rounds with a margin: the server collects past its quorum (`Server.wait_after_quorum`)."""
        backup = backup_rounds(server.policy)
        if backup and self.catch_up and self.ledger is None:
            self.ledger = Ledger(self.workers, first=server.version * self.workers)
        if not backup or self.margin is None:
            return
        auto = self.margin == "auto"
        server.wait_after_quorum(float("inf") if auto else float(self.margin))
        if auto and self._times is None:
            self._times = RoundTimes(Margin(), server.quorum)

    def _arm_timeout(self, server: Server, limit: float | None = None) -> None:
        fires = server.arm(self.now, limit)
        if fires is not None and fires < math.inf:  # an adaptive margin is set by `limit` (inf: none yet)
            self._schedule(fires, _TIMEOUT, -1, server.version)
