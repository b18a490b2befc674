"""Choosing the number of backup workers from measured gradient arrival times (000_... §3.1, Fig. 4-6).

With N + b workers of which each round waits for the first N gradients, a larger b shortens the round (the slowest
b gradients are not waited for) but averages fewer gradients per update. 000_... estimates the time to converge as
(rounds needed, about proportional to 1 / N: Fig. 5 halves them when N doubles) x (round time); so the setting that
trains fastest is the one with the most applied gradients per second, N / round time. `predict` gives, for every b,
the round time and that throughput; `recommend` picks the b with the highest throughput.

Which run to measure: one whose rounds each waited for every worker (`sync=bsp`, b = 0). There every worker starts
every round when the previous one ends, so its arrival time in a round is its whole compute and message time: a
sample of that worker's speed that does not depend on the policy. In a run with b > 0 the arrivals are entangled
with the policy: a worker whose gradient was dropped does not cancel its batch, it finishes it and then starts the
round already under way, so its next arrival counts from a start inside the round and the k-th arrival times
measured there depend on how rounds overlapped under that b. The same carry-over is why the round time of a b > 0
run is *not* the mean N-th arrival of the b = 0 run (the paper's estimate from Fig. 4, shown for reference; it would
hold if late batches were cancelled and is low by a few percent under homogeneous stragglers). `predict` instead
replays each b: workers draw their batch times from their own measured arrivals (a seeded bootstrap), a worker whose
gradient counted waits for the round to end, a late one starts the current round as soon as it is done, as
collsync's backup policy runs them in the simulator and over MPI.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from collsync.metrics import TraceLike, events_of


class NotFullRounds(ValueError):
    """The trace is not of a run whose every round waited for every worker, so it cannot predict other b."""


@dataclass(frozen=True)
class Prediction:
    """What N + b workers waiting for the first N = `quorum` gradients per round would give.

    `round_s`: predicted mean round time (seconds on the measured run's clock); `gradients_per_s`: applied
    gradients per second, quorum / round_s; `nth_arrival_s`: the mean time to the quorum-th gradient in the
    measured rounds (000_... Fig. 4), what the round would take if late batches were cancelled.
    """

    backups: int
    quorum: int
    round_s: float
    gradients_per_s: float
    nth_arrival_s: float


def worker_arrivals(trace: TraceLike) -> dict[int, list[float]]:
    """For each worker, the time from the start of each complete round to the arrival of its gradient, from a run
    whose every round waited for every worker (see the module docstring for why only such a run).

    A round starts at the `apply` event that ended the previous one (round 0 at the first `start` event, else at
    t = 0) and is complete once its update was applied. Raises `NotFullRounds` naming what the trace holds when an
    update averaged fewer than all workers, used a stale gradient, or there is no complete round.
    """
    events = events_of(trace)
    applies = [e for e in events if e["ev"] == "apply"]
    workers = sorted({e["worker"] for e in events if e["ev"] == "push"})
    if not applies:
        raise NotFullRounds("the trace has no update (no apply event)")
    partial = [e["version"] for e in applies if sorted(e["workers"]) != workers or any(e["staleness"])]
    if partial:
        got = min(len(e["workers"]) for e in applies)
        raise NotFullRounds(
            f"update {partial[0]} (and {len(partial) - 1} more) did not wait for all {len(workers)} workers' fresh "
            f"gradients (as few as {got}): measure arrivals with sync=bsp, whose rounds each wait for every worker"
        )
    ends = {e["version"]: e["t"] for e in applies}
    starts = {0: next((e["t"] for e in events if e["ev"] == "start"), 0.0), **ends}
    out: dict[int, list[float]] = {w: [] for w in workers}
    for e in events:
        if e["ev"] == "push" and e["clock"] + 1 in ends:
            out[e["worker"]].append(max(0.0, e["t"] - starts[e["clock"]]))
    return out


def replay_round_time(arrivals: Mapping[int, Sequence[float]], quorum: int, rounds: int = 5000, seed: int = 0) -> float:
    """The mean round time of len(arrivals) workers waiting for the first `quorum` gradients per round, over
    `rounds` replayed rounds.

    Each batch of worker w takes a time drawn (with replacement, seeded) from `arrivals[w]`. A worker whose gradient
    arrives while its round is open is counted and waits for the round to end (its next read needs the new
    version); the quorum-th arrival ends the round and every waiting worker starts the next one. A gradient that
    arrives after its round ended is dropped, and its worker starts the current round at once, mid-round: this
    carry-over is what makes backup rounds longer than the mean quorum-th arrival of a fully synchronous run.
    """
    times = [np.asarray(arrivals[w], dtype=float) for w in sorted(arrivals)]
    if not 1 <= quorum <= len(times):
        raise ValueError(f"choose-backups: {quorum=} must be in 1..{len(times)} (the workers)")
    if any(len(t) == 0 for t in times) or rounds < 1:
        raise ValueError(f"choose-backups: every worker needs measured arrivals and {rounds=} must be >= 1")
    rng = np.random.default_rng(seed)
    draws = [t[rng.integers(len(t), size=rounds + 1)] for t in times]  # enough: a worker draws <= once a round
    used = [0] * len(times)

    def batch(w: int) -> float:
        # A worker draws at most one batch per round it starts, so rounds + 1 draws each are never exhausted.
        used[w] += 1
        return float(draws[w][used[w] - 1])

    heap = [(batch(w), w, 0) for w in range(len(times))]  # (arrival time, worker, round it computed for)
    heapq.heapify(heap)
    current, counted, waiting, t = 0, 0, [], 0.0
    while current < rounds:
        t, w, c = heapq.heappop(heap)
        if c < current:  # late: dropped; the worker starts the round under way now
            heapq.heappush(heap, (t + batch(w), w, current))
            continue
        counted += 1
        if counted < quorum:
            waiting.append(w)
            continue
        current, counted = current + 1, 0
        for v in (*waiting, w):
            heapq.heappush(heap, (t + batch(v), v, current))
        waiting = []
    return t / rounds


def predict(trace: TraceLike, rounds: int = 5000, seed: int = 0) -> list[Prediction]:
    """One `Prediction` per b = 0 .. workers - 1 from a run whose rounds waited for every worker (`sync=bsp`)."""
    arrivals = worker_arrivals(trace)
    workers = len(arrivals)
    measured = min(len(t) for t in arrivals.values())
    if measured == 0:
        raise NotFullRounds("the trace has no complete round")
    # The k-th arrival of each measured round (rounds where every worker's gradient is in the trace).
    per_round = np.sort(np.array([t[:measured] for t in arrivals.values()]), axis=0)
    out = []
    for b in range(workers):
        quorum = workers - b
        round_s = replay_round_time(arrivals, quorum, rounds, seed)
        rate = quorum / round_s if round_s > 0 else float("inf")
        out.append(Prediction(b, quorum, round_s, rate, float(per_round[quorum - 1].mean())))
    return out


def recommend(predictions: Sequence[Prediction]) -> Prediction:
    """The prediction with the most applied gradients per second (ties go to fewer backups: bigger batches)."""
    if not predictions:
        raise ValueError("choose-backups: no predictions")
    return max(predictions, key=lambda p: (p.gradients_per_s, -p.backups))


def format_predictions(predictions: Sequence[Prediction], clock: str | None, rounds_measured: int) -> str:
    """The table `collsync-report --choose-backups` prints, then the recommendation and how it was chosen."""
    unit = f"{clock} s" if clock else "s"
    workers = len(predictions)
    best = recommend(predictions)
    lines = [
        f"backup workers for {workers} workers, from {rounds_measured} measured rounds that waited for all "
        f"(times in {unit})",
        f"{'b':>3} {'N':>4} {'round time':>11} {'gradients/s':>12} {'mean N-th arrival':>18}",
    ]
    for p in predictions:
        mark = "  <- recommended" if p is best else ""
        lines.append(
            f"{p.backups:>3} {p.quorum:>4} {p.round_s:>11.4f} {p.gradients_per_s:>12.3f} {p.nth_arrival_s:>18.4f}{mark}"
        )
    lines += [
        f"recommended: sync=backup sync.backups={best.backups} (wait for N={best.quorum} of {workers})"
        if best.backups
        else f"recommended: sync=bsp (b = 0: wait for all {workers}; backup workers would cost more than they save)",
        "  the most applied gradients per second: the least time to converge if the rounds needed fall as 1/N "
        "(000_... Fig. 5-6)",
        "  round time: each worker's measured arrivals replayed, late batches finishing (as collsync runs them)",
        "  mean N-th arrival: over the measured rounds, what a round would take if late batches were cancelled",
    ]
    return "\n".join(lines)
