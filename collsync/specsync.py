"""SpecSync: speculative synchronization (004_..., Zhang et al., *Stay Fresh*, Algorithms 1-2, eqs. 3-7).

Workers compute on the parameters they pulled, as under ASP or SSP, but after each push they `notify` a central
scheduler (Alg. 2, worker line 10). The scheduler keeps the push history and, per worker, a push counter and a timer
of ABORT_TIME started at that worker's notify; when the timer expires with more than m x ABORT_RATE pushes counted
(pushes of the others in the speculation period), it sends the worker a `re-sync`: the worker aborts the gradient it
is computing, pulls fresh parameters and starts that batch over (Alg. 2, worker lines 5-7). Servers stay agnostic.

Three variants share this module:

* naive waiting (§III-B): every pull but the first is deferred by `wait` seconds, nothing is aborted;
* SpecSync-Cherrypick: ABORT_TIME and ABORT_RATE fixed by the config (`abort_time`, `abort_rate`);
* SpecSync-Adaptive (Alg. 1): both recomputed at the start of each scheduler epoch from the previous epoch's push
  log by maximising the closed-form estimate of eq. 7; ABORT_RATE = Delta* (m - 1) / (T m) (eq. 6 divided by m).

Everything here is plain Python on a clock the caller passes in (`now`): the simulator passes its virtual clock,
the MPI runtime `time.monotonic()`. Choices where the paper leaves room (docs/ARCHITECTURE.md, "SpecSync"):

* a scheduler *epoch* (§II-B: "when all workers finish an iteration") ends at the notify that makes every worker
  have notified at least once since the epoch began; adaptive tuning runs there, on the log so far;
* u~_i(Delta) (eq. 5) counts the other workers' notifies in (s_i, s_i + Delta], where s_i is the start of worker
  i's last complete iteration (its second-to-last notify); a worker with no complete iteration yet adds no gain;
* T_i (eq. 6) is worker i's mean time between notifies so far; T in Alg. 1 line 8 is the mean of the T_i;
* the candidates of Alg. 1 line 3 are the right-aligned ones, t_k - s_i (pushes after s_i; every such value is a
  difference of two pushes, since s_i is a notify), capped at T: a speculation period as long as an iteration
  would end after the gradient it is meant to abort. Ties go to the shortest Delta;
* before the first tuning (the first epoch) Adaptive does not speculate;
* a timer counts a notify that arrives at its very expiry time (the period is (start, start + ABORT_TIME]);
* a worker's notify restarts its own timer (its last one belonged to the gradient it just pushed).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

# Bytes of one notify (sender, iteration) and one re-sync (iteration) message as int64 words: the accounting of the
# paper's Fig. 13 ("notifications"). The MPI runtime sends exactly these.
NOTIFY_BYTES = 16
RESYNC_BYTES = 8


class Aborted(Exception):
    """Raised at a worker's safe point when a re-sync aborts the gradient under way (caught by `loops.run_worker`,
    which pulls fresh parameters and starts the batch over)."""


@dataclass(frozen=True)
class Speculation:
    """What a SpecSync policy adds to ASP / SSP: naive waiting and / or a scheduler's re-syncs.

    `abort_time` (seconds, ABORT_TIME) and `abort_rate` (ABORT_RATE, Gamma) fixed: SpecSync-Cherrypick. `adaptive`:
    SpecSync-Adaptive (both tuned per epoch, so neither may be set). `wait`: naive waiting's delay before each pull.
    `scheduler`: where the scheduler runs over MPI (the simulator runs the same scheduler wherever this says).
    Times are model seconds, as the straggler models draw them (real runs scale them by `runtime.time_scale`).
    """

    abort_time: float | None = None
    abort_rate: float | None = None
    adaptive: bool = False
    wait: float = 0.0
    scheduler: str = "server"  # over MPI: in server rank 0's loop ("server") or on a rank of its own ("rank")

    def __post_init__(self) -> None:
        if self.scheduler not in ("server", "rank"):
            raise ValueError(f"specsync: scheduler={self.scheduler!r} must be 'server' (co-located) or 'rank'")
        if not (math.isfinite(self.wait) and self.wait >= 0):
            raise ValueError(f"specsync: wait={self.wait!r} must be >= 0 seconds")
        if self.abort_time is not None and not (math.isfinite(self.abort_time) and self.abort_time > 0):
            raise ValueError(f"specsync: abort_time={self.abort_time!r} must be > 0 seconds")
        if self.abort_rate is not None and not (math.isfinite(self.abort_rate) and self.abort_rate > 0):
            raise ValueError(f"specsync: abort_rate={self.abort_rate!r} must be in (0, inf)")
        if self.adaptive and (self.abort_time is not None or self.abort_rate is not None):
            set_ = "abort_time" if self.abort_time is not None else "abort_rate"
            raise ValueError(
                f"specsync: adaptive=true tunes abort_time and abort_rate itself; {set_}="
                f"{getattr(self, set_)} must be null with it (or set adaptive=false for Cherrypick)"
            )
        if (self.abort_time is None) != (self.abort_rate is None):
            missing = "abort_rate" if self.abort_rate is None else "abort_time"
            raise ValueError(f"specsync: {missing}=null; Cherrypick needs both abort_time and abort_rate")

    @property
    def speculates(self) -> bool:
        """Whether a scheduler times speculation periods (Cherrypick or Adaptive; not naive waiting alone)."""
        return self.adaptive or self.abort_time is not None


@dataclass(frozen=True)
class Tuning:
    """One result of Algorithm 1: the speculation period, the rate, and the estimate F~ (eq. 7) it maximised."""

    abort_time: float
    abort_rate: float
    gain: float


def tune(
    log: list[tuple[float, int]], starts: dict[int, float], spans: dict[int, float], workers: int
) -> Tuning | None:
    """Algorithm 1 (TUNEPARAM): the Delta that maximises eq. 7 on a push log, and ABORT_RATE = Delta (m-1) / (T m).

    `log`: (time, worker) of the notifies (pushes) known, in time order. `starts[i]`: s_i, the start of worker i's
    last complete iteration (eq. 5: the gain u~_i(Delta) is the number of other workers' pushes in (s_i, s_i +
    Delta]). `spans[i]`: T_i, worker i's iteration span (eq. 6: loss (m-1) Delta / T_i; a worker without one takes
    the mean). Returns None when there is nothing to tune on (no span yet, or no push after any s_i).

    F~(Delta) = sum_i u~_i(Delta) - Delta (m-1) sum_i 1/T_i is a step function minus a line, so its maximum is at a
    Delta that right-aligns some s_i with a push: those candidates, sorted, have F~ = (their rank) - c Delta.
    """
    if not spans or workers < 2:
        return None
    mean_span = sum(spans.values()) / len(spans)
    slope = (workers - 1) * sum(1.0 / spans.get(i, mean_span) for i in range(workers))
    candidates = sorted(t - s for i, s in starts.items() for t, w in log if w != i and t > s and t - s <= mean_span)
    if not candidates:
        return None
    best: Tuning | None = None
    for j, delta in enumerate(candidates):
        # The gain at delta counts every candidate <= delta: with ties, only the last of equal values is whole.
        if j + 1 < len(candidates) and candidates[j + 1] == delta:
            continue
        gain = (j + 1) - slope * delta
        if best is None or gain > best.gain:
            best = Tuning(delta, delta * (workers - 1) / (mean_span * workers), gain)
    return best


@dataclass
class SpecWorker:
    """A worker's side of SpecSync's abort and restart (Alg. 2, worker lines 5-10), on any clock: the one state
    machine the simulator (one per simulated worker) and both MPI fronts (`runtime.mpi_specsync.Speculator`, which
    carries its messages) run.

    A gradient starts on a version (`start`) after the worker's notify (`notify`: its iteration tags the scheduler's
    re-sync); it ends pushed (`finish`) or aborted (`aborted`). A re-sync is decided once, when the worker sees it
    (`resync`): it aborts the gradient under way only if it answers that gradient's notify and the server already
    holds a newer version than the gradient's (restarting on the same parameters gains nothing); else it is ignored
    and counted. The aborted batch then starts over on the newest parameters (`loops.Worker.restart`).
    """

    iteration: int = 0  # notifies sent
    computing: int = -1  # the version of the gradient under way (-1: none)
    aborts: int = 0
    wasted_s: float = 0.0  # the seconds (model seconds in the simulator) the aborted gradients had taken
    ignored: int = 0  # re-syncs seen and not acted on

    def notify(self) -> int:
        """After a push and its pull (Alg. 2 line 10): the iteration the scheduler's re-sync will name."""
        self.iteration += 1
        return self.iteration

    def start(self, version: int) -> None:
        self.computing = version

    def finish(self) -> None:
        self.computing = -1

    def resync(self, iteration: int, newest: int) -> bool:
        """A re-sync for notify `iteration` is seen while the server's newest version is `newest`: whether the
        gradient under way aborts."""
        if iteration != self.iteration or self.computing < 0 or newest <= self.computing:
            self.ignored += 1
            return False
        return True

    def aborted(self, wasted: float) -> None:
        self.computing = -1
        self.aborts += 1
        self.wasted_s += wasted


class Scheduler:
    """The central scheduler of Alg. 2 for `workers` workers, on a clock the caller passes (`now`).

    `notify(w, now)` after each of worker w's pushes; `due()` the earliest timer; `expire(now)` fires the timers
    due, returning (worker, iteration) for each re-sync to send (the iteration tags it, so a worker ignores a re-sync
    meant for a gradient it already pushed). The state is plain values (`state_dict`) for checkpoints.
    """

    def __init__(self, workers: int, speculation: Speculation) -> None:
        if workers < 1:
            raise ValueError(f"specsync: {workers=} must be >= 1")
        self.workers, self.speculation = workers, speculation
        self.abort_time: float | None = speculation.abort_time
        self.abort_rate: float | None = speculation.abort_rate
        self.counts = [0] * workers  # pushes of the others since the worker's notify (its speculation period)
        self.timers: list[float | None] = [None] * workers  # when each worker's period ends
        self.iteration = [0] * workers  # notifies received from each worker (tags its re-syncs)
        self.last: list[float | None] = [None] * workers  # each worker's last notify
        self.previous: list[float | None] = [None] * workers  # ... and the one before (s_i of eq. 5)
        self.first: list[float | None] = [None] * workers  # each worker's first notify (for T_i)
        self.log: list[tuple[float, int]] = []  # notifies since the oldest s_i still needed
        self.seen: set[int] = set()  # workers that notified in this epoch
        self.epoch = 0
        self.tunings: list[dict[str, float]] = []  # Adaptive: each epoch's result (for reports and tests)
        self.notifies = 0
        self.resyncs = 0

    def spans(self) -> dict[int, float]:
        """T_i: each worker's mean time between notifies so far (workers with two notifies or more)."""
        return {
            i: (self.last[i] - self.first[i]) / (self.iteration[i] - 1)  # type: ignore[operator]
            for i in range(self.workers)
            if self.iteration[i] >= 2 and self.last[i] > self.first[i]  # type: ignore[operator]
        }

    def notify(self, worker: int, now: float) -> None:
        """Worker `worker` pushed and pulled (Alg. 2, scheduler HANDLENOTIFICATION): log it, count it in the other
        workers' open periods, close the epoch if it was the last worker missing, and start its own period."""
        self.notifies += 1
        for j, ends in enumerate(self.timers):
            if j != worker and ends is not None and now <= ends:
                self.counts[j] += 1
        self.log.append((now, worker))
        self.previous[worker], self.last[worker] = self.last[worker], now
        if self.first[worker] is None:
            self.first[worker] = now
        self.iteration[worker] += 1
        self.seen.add(worker)
        if len(self.seen) == self.workers:
            self._end_epoch(now)
        self.counts[worker] = 0
        self.timers[worker] = None if self.abort_time is None else now + self.abort_time

    def _end_epoch(self, now: float) -> None:
        self.epoch += 1
        self.seen = set()
        if self.speculation.adaptive:
            starts = {i: s for i, s in enumerate(self.previous) if s is not None}
            result = tune(self.log, starts, self.spans(), self.workers)
            if result is not None:
                self.abort_time, self.abort_rate = result.abort_time, result.abort_rate
                self.tunings.append(
                    {"t": now, "epoch": self.epoch, "abort_time": result.abort_time, "abort_rate": result.abort_rate}
                )
        # The next tuning's s_i are at or after each worker's last notify now: older entries are never read again.
        oldest = min(t for t in self.last if t is not None)
        self.log = [entry for entry in self.log if entry[0] >= oldest]

    def due(self) -> float | None:
        """The earliest time a timer expires (None: no period open)."""
        return min((t for t in self.timers if t is not None), default=None)

    def expire(self, now: float) -> list[tuple[int, int]]:
        """Fire every timer due by `now` (Alg. 2, CHECKRESYNC): a worker whose period saw more than m x ABORT_RATE
        pushes gets a re-sync. Returns (worker, iteration) per re-sync, in worker order."""
        resync = []
        for w, ends in enumerate(self.timers):
            if ends is not None and ends <= now:
                self.timers[w] = None
                if self.abort_rate is not None and self.counts[w] > self.workers * self.abort_rate:
                    resync.append((w, self.iteration[w]))
        self.resyncs += len(resync)
        return resync

    def state_dict(self) -> dict[str, Any]:
        """The scheduler in plain types (for a checkpoint)."""
        return {
            key: (sorted(value) if isinstance(value, set) else copy.deepcopy(value))
            for key, value in vars(self).items()
            if key not in ("workers", "speculation")
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, copy.deepcopy(value))
        self.seen = set(state["seen"])
        self.log = [(float(t), int(w)) for t, w in state["log"]]
