"""The adaptive margin of serverless backup workers: how long a round waits, after its quorum-th gradient, for
the others. Plain arithmetic on measured times, below the transport that measures them (`runtime/mpi_partial`) and
the fronts that choose it (`margin="auto"`); `collsync.backups` holds the offline choice of b."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Margin:
    """How long a round of backup workers waits, after its quorum-th gradient, for the others (`margin="auto"`).

    000_... (§3.1) fixes b for a run: each round averages the first N = n - b gradients and drops the rest, also
    when nobody straggles, so the same epochs apply fewer gradients (`backups.predict` chooses that b offline, for
    the most applied gradients per second N / round time). Here a round takes every gradient that comes within a
    margin m of its N-th one, and drops only later ones; m is set per round from the arrivals measured before:

        m = clamp(mean_gap + 4 dev_gap,  T / N,  T)

    mean_gap and dev_gap: a running mean and mean deviation (Jacobson's estimator, as TCP's retransmission timer
    uses it: gains 1/8 and 1/4) of the time from the N-th arrival to the last, over the rounds in which all n came
    within the margin; a round whose margin ran out with ranks missing halves the estimate instead (a rank that
    stays slow stops costing waits; the next complete round sets it again). T: the period of the rounds, as the
    rank that closes this one (the N-th arrival) measured it: from its arrival in the round before to this one
    (its compute, and the last round's communication and waiting, so T scales with the machine's load as the
    jitter does). The bounds: a gradient that comes within T / N keeps the gradients per second, 000_...'s
    measure, at least N / T ((N + 1) / (T + T / N) = N / T), so that much waiting is always worth trying; a round
    never more than doubles for a late one. Before any complete round the margin is T (wait, and measure).

    T holds the waits, so a worker that is late in every round by more than a step (one persistently 3x slower)
    would be waited for every round and set everyone's pace: T grows by its own lateness. So when the rounds that
    waited for everyone waited longer, on average, than one step S of the closing rank (from reading the last
    round's mean to its arrival in this one: its compute), m is only the T / N that is always worth trying, and that
    worker is dropped (with `catch_up`, it then skips to the current round). Not S as the upper bound itself: where a
    rank's one-sided operations progress only while the host is inside MPI (off shared memory without a progress
    thread), a worker dropped once lags by the host's whole step, and only a wait of about T brings it back in step;
    for the same reason the bound is T / N, not S / N: with a quorum of 1 (2 workers, 1 backup) T / N is the whole
    period, and such a worker is still waited for.

    And waiting is weighed against closing at the quorum at once (with `workers` given): the period T of the rounds
    this rank closed is kept, as a running mean (gain 1/8), apart for those that waited and took every worker
    (T_all) and those closed at once (T_now), and the rounds close at once where n / T_all < N / T_now (fewer
    gradients a second when they wait), else wait as above; every `EXPLORE`-th round takes the other choice, so that
    both means follow the run (a worker that got faster, or slower). The arrival gap alone does not see what a late
    worker costs once it is in: across hosts a worker behind a slow link arrives within the margin, but every
    message of its round's exchange crosses that link; and a margin that runs out for nobody costs its whole
    length. The period shows both (benchmarks/README.md, "A late host's rounds by message").
    """

    mean: float | None = None
    dev: float = 0.0
    estimate: float | None = None
    period_all: float | None = None  # T_all: the running mean period of the rounds that waited and took everyone
    period_now: float | None = None  # T_now: of the rounds closed at their quorum at once
    decided: int = 0  # the rounds decided by weighing (every EXPLORE-th takes the other choice)
    now: bool = False  # the last round decided was closed at once

    def paced(self, period: float, complete: bool) -> None:
        """The last round decided (`limit`) took `period` seconds (from the closing rank's arrival in it to its
        arrival in the next); `complete`: every worker's gradient was in it. A round that waited and missed some
        is not counted (its wait was spent for nothing: neither choice's period)."""
        if not (self.now or complete):
            return
        last = self.period_now if self.now else self.period_all
        value = period if last is None else last + (period - last) / 8
        if self.now:
            self.period_now = value
        else:
            self.period_all = value

    def waiting_pays(self, quorum: int, workers: int) -> bool:
        """Whether rounds that waited for all `workers` gave at least as many gradients a second as those closed at
        `quorum` at once (True until both were seen)."""
        if self.period_all is None or self.period_now is None:
            return True
        return workers / max(self.period_all, 1e-9) >= quorum / max(self.period_now, 1e-9)

    def limit(self, period: float, quorum: int, step: float | None = None, workers: int | None = None) -> float:
        """The margin in seconds for a round of `quorum` gradients at `period` seconds a round (T above), `step`
        seconds the closing rank's own step (S above; None: not known), of `workers` in all (None: not known,
        waiting is not weighed against closing at the quorum)."""
        self.now = False
        if workers is not None and quorum < workers:
            self.decided += 1
            self.now = self.waiting_pays(quorum, workers) == (self.decided % EXPLORE == 0)
            if self.now:
                return 0.0
        high = max(period, 0.0)
        if step is not None and self.mean is not None and self.mean > step:
            return high / quorum  # the late ones come more than a step late: only what is always worth trying
        guess = high if self.estimate is None else self.estimate
        return min(high, max(high / quorum, guess))

    def observe(self, gap: float, complete: bool, limit: float) -> None:
        """After a round: `gap`, seconds from its quorum-th arrival to its last one seen; `complete`, whether every
        rank came within `limit`, the margin it had (a round closed at once tells nothing of the gap)."""
        if self.now:
            return
        if not complete:
            self.estimate = limit / 2
            return
        if self.mean is None:
            self.mean, self.dev = gap, gap / 2
        else:
            self.dev += (abs(gap - self.mean) - self.dev) / 4
            self.mean += (gap - self.mean) / 8
        self.estimate = self.mean + 4 * self.dev


EXPLORE = 8  # a round in this many takes the choice that has not paid (`Margin.limit`)


def check_margin(margin: float | str | None) -> None:
    """None (close at the quorum), "auto" (a margin from the measured arrivals) or a positive number of seconds."""
    if margin is None or margin == "auto":
        return
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0:
        raise ValueError(f"partial allreduce: margin={margin!r} must be None, 'auto' or a number of seconds > 0")


@dataclass
class RoundTimes:
    """One backup round's arrivals on a clock, for the adaptive `Margin` where a driver keeps the clock itself (the
    simulator; `runtime/mpi_partial` measures the same times on the wall clock): T is the time between two rounds'
    quorum-th arrivals, the gap the time from this round's quorum-th arrival to its last one taken."""

    margin: Margin
    quorum: int
    workers: int | None = None  # all of them (None: closing at the quorum is not weighed, `Margin.waiting_pays`)
    complete: bool | None = None  # whether the last round applied had every worker's gradient
    closed_at: float | None = None  # the last round's quorum-th arrival
    quorum_at: float | None = None  # this round's
    last: float = 0.0
    count: int = 0
    used: float = 0.0  # the margin this round was given

    def arrived(self, now: float) -> bool:
        """A gradient of this round came `now`; whether it is the quorum-th (the round's margin starts)."""
        self.count += 1
        self.last = now
        if self.count == self.quorum:
            self.quorum_at = now
        return self.count == self.quorum

    def limit(self, now: float, step: float) -> float:
        """The margin for the round whose quorum-th gradient came `now` after the closing worker's `step` seconds
        of compute; before any round closed, the period is that step."""
        period = now - self.closed_at if self.closed_at is not None else step
        if self.closed_at is not None and self.complete is not None:
            self.margin.paced(period, self.complete)  # the last round's period, and whether it took everyone
        self.used = self.margin.limit(period, self.quorum, step, self.workers)
        return self.used

    def applied(self, complete: bool) -> None:
        """The round was applied: `complete`, every live worker's gradient in it."""
        if self.quorum_at is not None:
            self.margin.observe(self.last - self.quorum_at, complete, self.used)
            self.closed_at = self.quorum_at
        self.complete = complete
        self.quorum_at, self.count = None, 0
