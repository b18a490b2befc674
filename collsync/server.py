"""The parameter server: the only place the parameters change.

`Server.accept(arrival)` applies the policy (rounds or stream, quorum, drops), the per-gradient penalty and the
optimizer:

    g'_i  = penalty(g_i, ctx_i)                 ctx_i.staleness = version - a_i.version        (per arrival)
    g_bar = (1/Q) sum_i g'_i                    Q = quorum, summed in worker order             (per update)
    theta <- theta + optimizer(g_bar);  version <- version + 1;  theta_ema <- a theta_ema + (1 - a) theta

The rules report their own statistics (`Rule.stats`): the server records them on each `apply` event (one value
per gradient) and publishes the optimizer's `SIGNAL` to the workers with every version (`Stamp.signal`).

Summing in worker order (not arrival order) makes an update independent of message timing, so a simulated run and
an MPI run of the same config agree bit for bit where the arrivals agree.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from collsync.guard import GUARDS, Diverged, finite, first_bad
from collsync.policy import SyncPolicy
from collsync.rules.base import SIGNAL, Rule, identity
from collsync.server_state import load_into, state_of
from collsync.trace import Trace, recorded
from collsync.types import Arrival, Context, Flat, Stamp

__all__ = ["GUARDS", "Diverged", "Lost", "Server", "replay"]


class Lost(RuntimeError):
    """A worker was lost (silent for the deadline) and the policy cannot go on without it (`SyncPolicy.tolerates`)."""


class Server:
    """Holds theta, the rule states and the round buffers of one parameter shard (or of the whole model)."""

    def __init__(
        self,
        params: Flat,
        optimizer: Rule,
        policy: SyncPolicy,
        workers: int,
        *,
        penalty: Rule | None = None,
        steps: int | None = None,
        ema_decay: float | None = None,
        trace: Trace | None = None,
        guard: str = "off",
    ) -> None:
        policy.check(workers)
        if guard not in GUARDS:
            raise ValueError(f"server: guard={guard!r} must be one of {', '.join(GUARDS)}")
        self.guard = guard
        if ema_decay is not None and not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"server: {ema_decay=} must be in [0, 1)")
        self.params = params.detach().clone()
        self.optimizer = optimizer
        self.penalty = penalty or identity()
        self.policy = policy
        self.workers = workers
        self.quorum = policy.quorum_for(workers)
        self.full = policy.full_for(workers)
        # Seconds a round (or stream update) collects after its quorum before it is applied: the policy's timeout,
        # or serverless backup's margin where a driver sets one (`wait_after_quorum`).
        self.collect = policy.timeout
        self.steps = steps
        self.ema_decay = ema_decay
        self.ema = self.params.clone() if ema_decay is not None else None
        self.trace = trace
        self.version = 0
        self.opt_state = optimizer.init(self.params)
        self.pen_state = self.penalty.init(self.params)
        self.needs_read = optimizer.needs_read or self.penalty.needs_read
        self.pending: dict[int, list[Arrival]] = {}
        self.applied = 0
        self.dropped = 0
        self._view: Flat | None = None
        self._scratch: Flat | None = None  # the buffer an in-place optimizer works in (see `_owned`)
        # Versions some worker may still send a gradient for, with the view it read (Gap-Aware's theta_{k-tau}).
        self._history: dict[int, Flat] = {}
        # B-FASGD: each worker's last gradient, re-applied when it skips a push.
        self._last: dict[int, Flat] = {}
        stats = self._optimizer_stats()
        self.signal = stats.get(SIGNAL, 0.0)  # what `stamp` publishes (`Stamp.signal`)
        if policy.bandwidth_aware and SIGNAL not in stats:
            raise ValueError(
                f"sync={policy.name}: workers decide to push and fetch from the optimizer's signal, and this optimizer "
                "publishes none; B-FASGD needs optimizer=fasgd"
            )
        self._oldest = [0] * workers
        self._armed: int | None = None  # the version whose collection timeout is running (see `arm`)
        # What each worker has sent (gradients received, its last round): where a resumed worker picks up.
        self.received = [0] * workers
        self.clocks = [-1] * workers
        self.contributed = [0] * workers  # the last update each worker's gradient was part of (0: none yet)
        self.lost: list[int] = []  # workers lost (`lose`), in the order they were
        self.away: frozenset[int] = frozenset()  # PSP: workers in another collective of their script (`pushing`)
        # The worker whose push completed the last update (`Stamp.closer`); -1 where a timeout, a loss or a change
        # of the quorum did.
        self.closer = -1
        if self.needs_read:
            self._history[0] = self.view().clone()

    @property
    def done(self) -> bool:
        return self.steps is not None and self.version >= self.steps

    def stop(self) -> None:
        """End training at the current version (the workers left: a script's loop, not `steps`, decides when it
        ends); `done` from now on, and gradients still buffered are dropped."""
        self.steps = self.version
        self.drain()

    def stamp(self) -> Stamp:
        return Stamp(self.version, self.done, self.signal, self.closer)

    def _optimizer_stats(self) -> dict[str, float]:
        return self.optimizer.stats(self.opt_state) if self.optimizer.stats is not None else {}

    def view(self) -> Flat:
        """The parameters workers read: theta itself, or a rule's look-ahead (DANA)."""
        if self._view is None:
            self._view = self.optimizer.view(self.penalty.view(self.params, self.pen_state), self.opt_state)
        return self._view

    def accept(self, arrival: Arrival) -> bool:
        """Take one gradient; apply every update it completes. False if it was dropped."""
        if not 0 <= arrival.worker < self.workers:
            raise ValueError(f"server: arrival from worker {arrival.worker} outside 0..{self.workers - 1}")
        self.received[arrival.worker] += 1
        self.clocks[arrival.worker] = max(self.clocks[arrival.worker], arrival.clock)
        grad = arrival.grad
        repeat = grad is None
        if grad is None:
            grad = self._last.get(arrival.worker)
            if grad is None:
                raise ValueError(f"server: worker {arrival.worker} skipped a push before it ever pushed")
            arrival = arrival._replace(grad=grad)
        elif self.policy.bandwidth_aware:
            self._last[arrival.worker] = grad
        self._note(
            "push",
            worker=arrival.worker,
            clock=arrival.clock,
            version=arrival.version,
            staleness=self.version - arrival.version,
            **({"repeat": True} if repeat else {}),
        )
        if arrival.worker in self.away:
            self.pushing(self.away - {arrival.worker})  # back from its collective before the next look says so
        if self.done or (self.policy.rounds and arrival.clock < self.version) or arrival.worker in self.lost:
            self._drop(arrival, "finished" if self.done else "lost" if arrival.worker in self.lost else "late")
            return False
        if self.guard != "off" and not finite(grad):
            if self.guard == "skip":
                self._drop(arrival, "nonfinite")
                return False
            raise Diverged(
                f"guard: worker {arrival.worker} sent a non-finite gradient ({first_bad(grad)}) at server "
                f"step {self.version} (guard=skip drops such gradients, guard=off lets them through)"
            )
        key = arrival.clock if self.policy.rounds else -1
        self.pending.setdefault(key, []).append(arrival)
        self._advance(arrival.worker)
        return True

    def lose(self, worker: int, rank: int | None = None, host: str | None = None) -> bool:
        """`worker` is lost: silent for the policy's deadline (stopped, partitioned, dead). A `lost` event records
        it (its `rank` and `host` where the runtime knows them, and `last_update`, the last update its gradient was
        part of); its buffered and later gradients are dropped (reason "lost"), and every update counts only the
        live workers: quorum Q and full F become min(Q, n - lost), min(F, n - lost), so a round waiting only on it
        is applied now. False, with nothing changed, where the policy cannot go on (`SyncPolicy.tolerates`)."""
        if worker in self.lost:
            return True
        if not self.policy.tolerates(len(self.lost) + 1, self.workers):
            return False
        self.lost.append(worker)
        self._note("lost", worker=worker, rank=rank, host=host, last_update=self.contributed[worker])
        live = self.workers - len(self.lost)
        self.quorum, self.full = min(self.quorum, live), min(self.full, live)
        for key in list(self.pending):
            for a in (a for a in self.pending[key] if a.worker == worker):
                self._drop(a, "lost")
            self.pending[key] = [a for a in self.pending[key] if a.worker != worker]
        self._advance()
        return True

    def pushing(self, away: Collection[int]) -> None:
        """PSP (`SyncPolicy.partial_push`): workers `away` push nothing for now (their scripts wait in another
        collective), so a round takes Q = min(c, n - lost - away) gradients, F likewise (at least 1), traced `away`:
        a worker that ran ahead is not held for rounds only it pushes to. Other policies: nothing changes."""
        away = frozenset(away) - set(self.lost)
        if self.policy.partial_push and away != self.away:
            self.away, live = away, max(1, self.workers - len(self.lost) - len(away))
            self._note("away", workers=sorted(away))
            self.quorum, self.full = (
                min(self.policy.quorum_for(self.workers), live),
                min(self.policy.full_for(self.workers), live),
            )
            self._advance()

    def holds(self, grad: Flat | None) -> bool:
        """Whether the server still keeps `grad` (buffered for a later update, or B-FASGD's last gradient of a
        worker): if not, the runtime may reuse its buffer for the next receive."""
        return grad is not None and (
            any(a.grad is grad for batch in self.pending.values() for a in batch)
            or any(g is grad for g in self._last.values())
        )

    def wait_after_quorum(self, seconds: float) -> None:
        """Backup rounds with a margin (`collsync.margin`): a round takes every gradient that comes within
        `seconds` of its quorum-th, up to one from each live worker, and drops only later ones (the simulator's model
        of `collsync.rounds`' partial allreduce; `arm(now, timeout)` sets a round's own margin)."""
        if not (self.policy.rounds and seconds > 0):
            raise ValueError(f"server: a margin of {seconds} s needs a round policy and a positive number")
        self.collect = seconds
        self.full = self.workers - len(self.lost)

    def collecting(self) -> bool:
        """Whether the collection timeout should be running for the current update: a stream with a gradient
        waiting, or a round that has its `quorum` but not yet every worker (003_... tau1, a backup margin)."""
        if self.collect is None or self.done:
            return False
        waiting = len(self.pending.get(self.version if self.policy.rounds else -1, ()))
        return waiting >= (self.quorum if self.policy.rounds else 1)

    def arm(self, now: float, timeout: float | None = None) -> float | None:
        """When the collection timeout of the current update fires, if it starts now: the first time the server is
        `collecting()` for this version (000_... §6, 003_... tau1); else None (not collecting, or already armed).
        Both drivers use it: `loops.run_server` on the wall clock, `sim.Simulator` on its virtual clock. `timeout`:
        this update's own (an adaptive margin), instead of `collect`."""
        collect = self.collect
        if collect is None or not self.collecting() or self._armed == self.version:
            return None
        self._armed = self.version
        return now + (collect if timeout is None else timeout)

    def expire(self, version: int) -> bool:
        """The collection timeout armed at `version` fired: flush if the server is still at that update."""
        return version == self.version and not self.done and self.flush()

    def flush(self) -> bool:
        """The collection timeout fired: apply what has arrived for the current update (a stream: anything; a
        round: at least `quorum`) although not every gradient the update could take came."""
        key = self.version if self.policy.rounds else -1
        batch = self.pending.pop(key, [])
        if not batch or self.done or (self.policy.rounds and len(batch) < self.quorum):
            self.pending.update({key: batch} if batch else {})
            return False
        self.closer = -1
        self._apply(batch)
        self._advance()
        return True

    def drain(self) -> None:
        """At shutdown: every gradient still buffered is dropped, so each push ends applied or dropped once."""
        for batch in self.pending.values():
            for arrival in batch:
                self._drop(arrival, "finished")
        self.pending.clear()

    def _key(self) -> int:
        """The buffer the current update collects into: its round, or -1 for a stream's one buffer."""
        return self.version if self.policy.rounds else -1

    def _advance(self, closer: int = -1) -> None:
        """Apply every update whose gradients are in; `closer`: the worker whose push came last (`Stamp.closer`)."""
        full = self.full
        while not self.done and len(self.pending.get(self._key(), ())) >= full:
            batch = self.pending.pop(self._key())
            self.closer = closer
            self._apply(batch[:full])
            if batch[full:]:
                self.pending[self._key()] = batch[full:]
        if self.done:
            # Gradients buffered for later rounds (SSP) can never be applied now.
            self.drain()

    def _drop(self, arrival: Arrival, reason: str) -> None:
        self.dropped += 1
        self._note(
            "drop",
            worker=arrival.worker,
            clock=arrival.clock,
            version=arrival.version,
            server=self.version,
            reason=reason,
        )

    def _apply(self, batch: list[Arrival]) -> None:
        batch = sorted(batch, key=lambda a: (a.worker, a.clock))
        total: Flat | None = None
        stats: dict[str, list[float]] = {}  # the penalty's statistics, one per gradient
        for a in batch:
            ctx = Context(
                step=self.version,
                worker=a.worker,
                staleness=self.version - a.version,
                workers=self.workers,
                read=self._history.get(a.version) if self.needs_read else None,
                aggregated=len(batch),
            )
            assert a.grad is not None  # `accept` put the worker's last gradient in place of a skipped push
            g, self.pen_state = self.penalty.update(a.grad, self.pen_state, self.params, ctx)
            if self.penalty.stats is not None:
                for key, value in self.penalty.stats(self.pen_state).items():
                    stats.setdefault(key, []).append(value)
            total = self._owned(g) if total is None else total.add_(g)
        assert total is not None  # a batch is never empty: _advance and flush check
        if len(batch) > 1:  # x / 1 is x exactly: one pass saved on every asynchronous update
            total.div_(len(batch))
        self._step(total, batch, stats)

    def apply_mean(self, mean: Flat, batch: list[Arrival]) -> None:
        """Apply an already averaged gradient (serverless allreduce: every rank's replica does this)."""
        for a in batch:
            self._note("push", worker=a.worker, clock=a.clock, version=a.version, staleness=self.version - a.version)
        self.closer = -1
        # Copied only for an in-place optimizer; a pure one reads `mean` and leaves it alone.
        owned = mean if self.optimizer.update_ is None else self._owned(mean)
        self._step(owned, sorted(batch, key=lambda a: (a.worker, a.clock)))

    def _owned(self, g: Flat) -> Flat:
        """`g` copied into the server's own buffer, which the optimizer's in-place `update_` may then overwrite
        (the buffer is reused: no allocation per update). Without `update_`, a fresh copy as before."""
        if self.optimizer.update_ is None:
            return g.clone()
        if self._scratch is None:
            self._scratch = torch.empty_like(self.params)
        return self._scratch.copy_(g)

    def _step(self, mean: Flat, batch: list[Arrival], stats: dict[str, list[float]] | None = None) -> None:
        first = batch[0]
        ages = [self.version - a.version for a in batch]
        ctx = Context(
            step=self.version,
            worker=first.worker if len(batch) == 1 else -1,
            staleness=max(ages),
            workers=self.workers,
            read=self._history.get(first.version) if self.needs_read and len(batch) == 1 else None,
            aggregated=len(batch),
            mean_staleness=sum(ages) / len(ages),
        )
        # `mean` is the server's own (see `_owned`): an in-place optimizer writes the delta over it.
        update = self.optimizer.update_ or self.optimizer.update
        delta, self.opt_state = update(mean, self.opt_state, self.params, ctx)
        if self.guard != "off" and not finite(delta):
            raise Diverged(
                f"guard: the update of server step {self.version} is non-finite ({first_bad(delta)}), from "
                f"worker(s) {[a.worker for a in batch]}: lower optimizer.lr, or add warm-up or a penalty"
            )
        self.params.add_(delta)
        staleness = [self.version - a.version for a in batch]
        self.version += 1
        self.applied += len(batch)
        for a in batch:
            self.contributed[a.worker] = self.version
        self._view = None
        if self.ema is not None and self.ema_decay is not None:
            self.ema.mul_(self.ema_decay).add_(self.params, alpha=1.0 - self.ema_decay)
        if self.needs_read:
            self._remember(batch)
        opt = self._optimizer_stats()
        self.signal = opt.pop(SIGNAL, 0.0)  # published with the new version (`stamp`), not recorded
        self._note(
            "apply",
            version=self.version,
            workers=[a.worker for a in batch],
            clocks=[a.clock for a in batch],
            staleness=staleness,
            **recorded(stats or {}, opt, len(batch)),
        )

    def _remember(self, batch: list[Arrival]) -> None:
        # A worker's next gradient is computed on a version no older than its last one, so versions older than
        # every worker's last known one can be forgotten.
        for a in batch:
            self._oldest[a.worker] = max(self._oldest[a.worker], a.version)
        self._history[self.version] = self.view().clone()
        floor = min(self._oldest)
        for v in [v for v in self._history if v < floor]:
            del self._history[v]

    def state_dict(self) -> dict[str, Any]:
        """Everything `load_state_dict` needs to go on exactly from here, in types `torch.load(weights_only=True)`
        reads back (see `server_state.state_of`)."""
        return state_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` of a server built with the same config (see `server_state.load_into`)."""
        load_into(self, state)

    def _note(self, ev: str, **fields: object) -> None:
        if self.trace is not None:
            self.trace.record(ev, **fields)


def replay(
    params: Flat, optimizer: Rule, policy: SyncPolicy, workers: int, arrivals: list[Arrival], **kwargs: object
) -> Server:
    """A fresh server fed `arrivals` in order: what a trace's accepted gradients do to the parameters."""
    server = Server(params, optimizer, policy, workers, **kwargs)  # type: ignore[arg-type]
    for a in arrivals:
        server.accept(a)
    return server
