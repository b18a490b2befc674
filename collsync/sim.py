"""The deterministic discrete-event simulator: many workers in one process, on a seeded virtual clock.

It drives the very `Worker` and `Server` objects the MPI runtimes drive (`collsync.loops`), so an algorithm studied
here is the algorithm deployed. What it adds is time: each gradient takes a compute time and a message delay drawn
from a seeded straggler model (`collsync.stragglers`), and events are processed in (time, sequence) order.

The gradient itself is computed, for real, when a worker starts (on the parameters it read then); only its arrival
waits for the virtual clock. Same seed, same config -> bit-identical parameters and trace (the FRED idea of 002_...).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from collsync.loops import GradFn, Worker
from collsync.server import Server
from collsync.trace import Trace
from collsync.types import Arrival, Flat

_PUSH, _TIMEOUT, _WAKE = 0, 1, 2


class Deadlock(RuntimeError):
    """The simulated server waits for gradients that can never come (e.g. BSP with a frozen worker)."""


class Simulator:
    """Runs `workers` simulated workers against one `Server` on a virtual clock.

    `stragglers` is a `collsync.stragglers.Stragglers` (or None for a constant compute time of 1 s per batch).
    """

    def __init__(self, workers: int = 8, stragglers: Any = None, seed: int = 0) -> None:
        if workers < 1:
            raise ValueError(f"runtime: {workers=} must be >= 1")
        self.workers = workers
        self.seed = seed
        self.sampler = stragglers.sampler(workers, seed) if stragglers is not None else None
        self.now = 0.0
        self._frozen_clock: float | None = None
        self.trace = Trace(clock=lambda: self.now if self._frozen_clock is None else self._frozen_clock)
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0

    def _schedule(self, t: float, kind: int, worker: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, worker, payload))
        self._seq += 1

    def _compute_time(self, worker: int, index: int) -> float:
        if self.sampler is None:
            return 1.0
        return self.sampler.compute_time(worker, index) + self.sampler.message_delay(worker, index)

    def _frozen(self, worker: int) -> bool:
        return self.sampler is not None and self.sampler.is_frozen(worker, self.now)

    def run(self, server: Server, grads: GradFn, on_update: Callable[[Server], None] | None = None) -> Server:
        """Simulate until the server is done; gradients in flight at the end are dropped (and traced)."""
        if server.workers != self.workers:
            raise ValueError(f"runtime: simulator has {self.workers} workers, server expects {server.workers}")
        if server.trace is not self.trace:
            raise ValueError("runtime: build the Server with trace=simulator.trace so events carry simulated time")
        workers = [Worker(w, server.policy, seed=self.seed) for w in range(self.workers)]
        # What each worker computes on; B-FASGD workers that skip a fetch keep their own copy.
        held: list[Flat | None] = [None] * self.workers
        keep_copy = server.policy.c_fetch is not None
        waiting: set[int] = set()
        frozen: set[int] = set()

        def try_start(w: int) -> None:
            worker, stamp = workers[w], server.stamp()
            if stamp.done:
                return
            if not worker.ready(stamp):
                waiting.add(w)
                return
            if self._frozen(w):
                frozen.add(w)
                return
            fetch = worker.will_fetch()
            clock = worker.begin(stamp, fetched=fetch)
            if fetch:
                held[w] = server.view().clone() if keep_copy else server.view()
            extra = {"fetched": fetch} if server.policy.bandwidth_aware else {}
            self.trace.record("start", worker=w, clock=clock, version=worker.version, **extra)
            index = worker.steps
            params = held[w]
            assert params is not None  # a worker's first opportunity always fetches
            arrival = worker.arrival(grads(params, w, index))
            self._schedule(self.now + self._compute_time(w, index), _PUSH, w, arrival)

        for w in range(self.workers):
            try_start(w)
        slow = self.sampler.model.slow_server if self.sampler is not None else 0.0
        busy_until = 0.0
        while self._heap:
            t, _, kind, w, payload = heapq.heappop(self._heap)
            self.now = t
            if kind == _PUSH and t < busy_until:
                # A slow server is still busy with its last update: the gradient waits for it, in arrival order.
                self._schedule(busy_until, _PUSH, w, payload)
                continue
            before = server.version
            if kind == _WAKE:
                for v in payload:
                    try_start(v)
                continue
            if kind == _PUSH:
                arrival: Arrival = payload
                server.accept(arrival)
            elif kind == _TIMEOUT:
                server.expire(payload)
            woken = {w} if kind == _PUSH else set()
            if server.version != before:
                if on_update is not None:
                    on_update(server)
                woken |= waiting
                waiting.clear()
            self._arm_timeout(server)
            if slow > 0 and server.version != before and not server.done:
                # Workers see the new version only once the slow server is done with it.
                busy_until = self.now + slow
                self._schedule(busy_until, _WAKE, -1, sorted(woken))
                woken = set()
            for v in sorted(woken):
                try_start(v)
            if server.done and self._frozen_clock is None:
                # Gradients still in flight are dropped "at" the end of training, not when they would have landed.
                self._frozen_clock = self.now
        if not server.done:
            raise Deadlock(
                f"sync={server.policy.name}: the simulated server stopped at version {server.version} of "
                f"{server.steps}: no gradient can arrive (frozen worker(s) {sorted(frozen)}, waiting "
                f"worker(s) {sorted(waiting)}); a round that needs a frozen worker never completes: use a policy "
                "that goes on without it (sync=backup, sync=async, sync=psp, or sync=ssp with sync.timeout)"
            )
        server.drain()
        return server

    def _arm_timeout(self, server: Server) -> None:
        fires = server.arm(self.now)
        if fires is not None:
            self._schedule(fires, _TIMEOUT, -1, server.version)
