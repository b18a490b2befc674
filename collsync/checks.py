"""Invariants every runtime's trace must satisfy, checked the same way for the simulator and for MPI runs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from collsync.policy import SyncPolicy
from collsync.trace import Event, Trace


class TraceError(AssertionError):
    """A trace broke an invariant; the message lists every violation found."""


def _bounds(policy: SyncPolicy, workers: int, up_to_all: bool) -> tuple[int, int, int]:
    """(quorum, most, least) gradients an update takes: exactly `quorum`, except where a collection timeout lets it
    take fewer (a stream flushed early) or more (a round that waited for every worker, up to the timeout after its
    quorum), or the transport lets a round take up to every worker (`up_to_all`: serverless backup's margin)."""
    quorum = policy.quorum_for(workers)
    least = 1 if policy.timeout is not None and not policy.rounds else quorum
    return quorum, workers if up_to_all else policy.full_for(workers), least


def check_trace(
    trace: Trace | Sequence[Event], policy: SyncPolicy, workers: int, up_to_all: bool = False
) -> dict[str, int]:
    """Check a run's trace against its policy; return counts (pushed, applied, dropped, updates).

    * updates are numbered 1, 2, 3, ... and time never goes backwards;
    * every pushed gradient is applied exactly once or dropped exactly once;
    * an update aggregates `quorum` gradients (a round with a timeout, or `up_to_all`: from `quorum` to every
      worker; a stream with one: 1 to `quorum`);
    * rounds: an update aggregates only gradients of its own round, each worker at most once; a worker starts
      round c only on version >= c - max_lead;
    * staleness is never negative;
    * a `lost` worker (`Server.lose`) is part of no later update, and from then on an update counts only the live
      workers (its bounds above become at most n - lost; under PSP, also less the workers an `away` event names:
      `Server.pushing`); after a `world` event (a restart on n' workers) they are
      those of n' workers, none lost;
    * SpecSync: `abort` events only under a policy that speculates, each with `wasted` >= 0 seconds; where the trace
      has `start` events (the simulator), an abort ends that worker's gradient under way (same round and version,
      `wasted` = the time since its start) and the worker's next start is on a strictly newer version.
    """
    events = trace.events if isinstance(trace, Trace) else list(trace)
    errors: list[str] = []
    # A run restarted on another number of workers starts with the first world's (`world` events, below).
    workers = next((int(e["was"]) for e in events if e["ev"] == "world"), workers)
    quorum, full, least = _bounds(policy, workers, up_to_all)
    pushed: Counter[tuple[int, int, int]] = Counter()
    settled: Counter[tuple[int, int, int]] = Counter()
    last_t, updates = float("-inf"), 0
    speculates = policy.speculation is not None and policy.speculation.speculates
    under_way: dict[int, Event] = {}  # each worker's last start (the simulator traces them)
    aborted: dict[int, Event] = {}  # workers whose next start must be on a newer version
    lost: set[int] = set()
    for e in events:
        if e["t"] < last_t:
            errors.append(f"time goes backwards at {e}")
        last_t = e["t"]
        ev = e["ev"]
        if ev == "push":
            pushed[(e["worker"], e["clock"], e["version"])] += 1
        elif ev == "drop":
            settled[(e["worker"], e["clock"], e["version"])] += 1
        elif ev == "start":
            errors.extend(_check_start(e, policy, aborted.pop(e["worker"], None)))
            under_way[e["worker"]] = e
        elif ev == "world":
            # A restart on another number of workers (`runs.resume.refit`): the bounds are the new world's.
            workers, lost = e["workers"], set()
            quorum, full, least = _bounds(policy, workers, up_to_all)
        elif ev == "away":
            # PSP's workers in another collective (`Server.pushing`): the bounds count the others, from the policy's.
            live = max(1, workers - len(lost) - len(e["workers"]))
            quorum, full, least = (min(b, live) for b in _bounds(policy, workers, up_to_all))
        elif ev == "lost":
            lost.add(e["worker"])
            live = workers - len(lost)
            quorum, full, least = min(quorum, live), min(full, live), min(least, live)
        elif ev == "abort":
            errors.extend(_check_abort(e, under_way.pop(e["worker"], None), speculates, workers))
            aborted[e["worker"]] = e
        elif ev == "apply":
            updates += 1
            if e["version"] != updates:
                errors.append(f"update {updates} recorded as version {e['version']}")
            for w, c, s in zip(e["workers"], e["clocks"], e["staleness"], strict=True):
                settled[(w, c, e["version"] - 1 - s)] += 1
            errors.extend(_check_apply(e, policy, lost, least, full))
    for key in pushed.keys() | settled.keys():
        if pushed[key] != settled[key]:
            w, c, v = key
            errors.append(
                f"gradient of worker {w} (round {c}, version {v}) pushed {pushed[key]}x, settled {settled[key]}x"
            )
    if errors:
        shown = "\n  ".join(errors[:20])
        raise TraceError(f"{len(errors)} trace invariant violation(s):\n  {shown}")
    return {
        "pushed": sum(pushed.values()),
        "applied": sum(len(e["workers"]) for e in events if e["ev"] == "apply"),
        "dropped": sum(1 for e in events if e["ev"] == "drop"),
        "updates": updates,
    }


def _check_start(e: Event, policy: SyncPolicy, aborted: Event | None) -> list[str]:
    """A worker's start: within the policy's lead, and on a newer version than the one it aborted (if it did)."""
    errors = []
    if policy.rounds and e["clock"] - e["version"] > (policy.max_lead or 0):
        errors.append(f"worker {e['worker']} started round {e['clock']} on version {e['version']}: lead too large")
    if aborted is not None and not e["version"] > aborted["version"]:
        errors.append(f"worker {e['worker']} restarted on version {e['version']} after an abort on it: {aborted}")
    return errors


def _check_apply(e: Event, policy: SyncPolicy, lost: set[int], least: int, full: int) -> list[str]:
    """An update: staleness >= 0; under rounds, one round's gradients, each worker once; no lost worker's gradient;
    between `least` and `full` gradients."""
    errors = [
        f"negative staleness {s} for worker {w} at version {e['version']}"
        for w, s in zip(e["workers"], e["staleness"], strict=True)
        if s < 0
    ]
    round_ = e["version"] - 1
    if policy.rounds:
        if any(c != round_ for c in e["clocks"]):
            errors.append(f"round {round_} aggregated gradients of rounds {e['clocks']}")
        if len(set(e["workers"])) != len(e["workers"]):
            errors.append(f"round {round_} took a worker twice: {e['workers']}")
    if lost & set(e["workers"]):
        errors.append(f"update {e['version']} took a gradient of lost worker(s) {sorted(lost & set(e['workers']))}")
    count = len(e["workers"])
    if not least <= count <= full:
        errors.append(f"update {e['version']} aggregated {count} gradients, not in [{least}, {full}]")
    return errors


def _check_abort(e: Event, start: Event | None, speculates: bool, workers: int) -> list[str]:
    """An `abort` event's own invariants, and against the start it ended where the trace has starts."""
    errors = []
    if not speculates:
        errors.append(f"an abort under a policy that does not speculate: {e}")
    if not (0 <= e["worker"] < workers and e["wasted"] >= 0):
        errors.append(f"abort of an unknown worker or with negative wasted time: {e}")
    if start is not None:
        if (start["clock"], start["version"]) != (e["clock"], e["version"]):
            errors.append(f"abort {e} does not match the gradient under way {start}")
        if abs((e["t"] - start["t"]) - e["wasted"]) > 1e-9 * max(1.0, abs(e["t"])):
            errors.append(f"abort {e} wasted {e['wasted']} s, not the {e['t'] - start['t']} s since its start")
    return errors
