"""What a run's trace says: accuracy over time, staleness, drops, the time to the k-th gradient, Gap vs delay.

Every function here is pure: it reads a `Trace` (see `collsync.trace` for the events) and returns numbers, rows or
files. The figures live in `collsync.plots`; `collsync.report.write_report` ties the two together for one run, and
`collsync.report` (the `collsync-report` command) compares runs. Times are the trace's `t`: simulated seconds in
the simulator, wall seconds under MPI; the summary's `clock` says which ("simulated", "wall", or None when unknown).

Staleness (the delay tau of 001_...) is counted over *applied* gradients, from the `apply` events; dropped
gradients never reached the parameters.
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from collsync.trace import Event, Trace

TraceLike = Trace | Sequence[Event]
THRESHOLDS: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95)
CLOCKS: tuple[str, ...] = ("simulated", "wall")
EMA_ONCE = "the EMA was evaluated once, at the end of training: no time to EMA accuracy"


def clock_of(trace: TraceLike) -> str | None:
    """ "simulated" or "wall" for a `Trace` made by a run; None for events alone or a trace read back from a file."""
    return trace.clock_kind if isinstance(trace, Trace) else None


def time_label(clock: str | None) -> str:
    """The axis label of a time in seconds on `clock`: "simulated time (s)", "wall time (s)", or "time (s)"."""
    return f"{clock} time (s)" if clock in CLOCKS else "time (s)"


def events_of(trace: TraceLike) -> list[Event]:
    """The events of a `Trace`, or a list of events as they are."""
    return trace.events if isinstance(trace, Trace) else list(trace)


def _of(trace: TraceLike, ev: str) -> list[Event]:
    return [e for e in events_of(trace) if e["ev"] == ev]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _applied_staleness(trace: TraceLike) -> list[int]:
    return [s for e in _of(trace, "apply") for s in e["staleness"]]


def _first_time(evals: list[Event], key: str, threshold: float) -> float | None:
    return next((e["t"] for e in evals if e.get(key) is not None and e[key] >= threshold), None)


def summary(trace: TraceLike, thresholds: Sequence[float] = THRESHOLDS, clock: str | None = None) -> dict[str, Any]:
    """The headline numbers of a run (JSON-serialisable; `time_to_acc` is keyed by threshold).

    * `clock`: "simulated" or "wall", what the times are in (`clock`, else the trace's own `clock_kind`);
    * `final_acc`, `final_ema_acc`, `final_loss`: the last `eval` event (theta and its EMA, 000_... §1.1);
      `best_acc`, `best_ema_acc`: the best over all evals;
    * `time_s`: the largest `t` in the trace; `updates`: `apply` events; `updates_per_s` = updates / time_s;
    * `pushed`, `applied`, `dropped` gradients and `dropped_by_reason`;
    * `staleness_mean`, `staleness_max` over applied gradients (`gap_mean` too where apply events carry `gap`);
    * `time_to_acc[a]` (and `time_to_ema_acc[a]`): the time of the first eval with accuracy >= a, None if never.
      Where the EMA was evaluated only once while theta was evaluated more often (server shards assemble the EMA
      only at the end), `time_to_ema_acc` is None and `ema_note` says why: that one point would give the final
      time for every threshold reached, which is not when the EMA got there.
    """
    events = events_of(trace)
    evals = _of(events, "eval")
    applies = _of(events, "apply")
    last = evals[-1] if evals else {}
    accs = [e["acc"] for e in evals if e.get("acc") is not None]
    ema_accs = [e["ema_acc"] for e in evals if e.get("ema_acc") is not None]
    staleness = _applied_staleness(events)
    gaps = [g for e in applies for g in e.get("gap") or () if g is not None]
    time_s = max((e["t"] for e in events), default=0.0)
    workers = {e["worker"] for e in events if e["ev"] in ("start", "push")}
    ema_once = len(ema_accs) == 1 and len(accs) > 1
    if clock is None:
        clock = clock_of(trace)
    if clock is not None and clock not in CLOCKS:
        raise ValueError(f"summary: clock={clock!r} must be one of {', '.join(CLOCKS)}")
    return {
        "clock": clock,
        "evals": len(evals),
        "ema_evals": len(ema_accs),
        "final_acc": last.get("acc"),
        "final_ema_acc": last.get("ema_acc"),
        "final_loss": last.get("loss"),
        "best_acc": max(accs, default=None),
        "best_ema_acc": max(ema_accs, default=None),
        "time_s": time_s,
        "updates": len(applies),
        "updates_per_s": len(applies) / time_s if time_s > 0 else None,
        "workers": len(workers),
        "pushed": sum(1 for e in events if e["ev"] == "push"),
        "applied": sum(len(e["workers"]) for e in applies),
        "dropped": sum(1 for e in events if e["ev"] == "drop"),
        "dropped_by_reason": dict(Counter(e.get("reason", "?") for e in events if e["ev"] == "drop")),
        # B-FASGD (002_... Fig. 3): transmissions made vs possible; a skipped push is a `repeat` push event.
        "push_ratio": _ratio(
            sum(1 for e in events if e["ev"] == "push" and not e.get("repeat")),
            sum(1 for e in events if e["ev"] == "push"),
        ),
        "fetch_ratio": _ratio(
            sum(1 for e in events if e["ev"] == "start" and e.get("fetched", True)),
            sum(1 for e in events if e["ev"] == "start"),
        ),
        "staleness_mean": _mean(staleness),
        "staleness_max": max(staleness, default=None),
        "gap_mean": _mean(gaps),
        "time_to_acc": {a: _first_time(evals, "acc", a) for a in thresholds},
        "time_to_ema_acc": None if ema_once else {a: _first_time(evals, "ema_acc", a) for a in thresholds},
        **({"ema_note": EMA_ONCE} if ema_once else {}),
    }


def _num(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def format_summary(s: dict[str, Any]) -> str:
    """A few aligned lines for the terminal (works on `summary()` and on a summary.json read back). The time line
    says whether its seconds are simulated or wall time (the time-to-accuracy line is on the same clock). The trace
    is rank 0's; with server shards, a last line gives every shard's updates and drops."""
    reasons = ", ".join(f"{k} {v}" for k, v in sorted((s.get("dropped_by_reason") or {}).items()))
    gap = f"  gap mean {_num(s['gap_mean'], '.3f')}" if s.get("gap_mean") is not None else ""
    clock = f" {s['clock']}" if s.get("clock") in CLOCKS else ""
    reached = "  ".join(
        f"{float(a):g}: {'never' if t is None else f'{t:.2f} s'}" for a, t in (s.get("time_to_acc") or {}).items()
    )
    incomplete = [f"INCOMPLETE   {s['incomplete']}"] if s.get("incomplete") else []
    return "\n".join(
        incomplete
        + [
            f"accuracy     theta {_num(s['final_acc'])}  EMA {_num(s['final_ema_acc'])}  "
            f"best {_num(s['best_acc'])} (EMA {_num(s['best_ema_acc'])})",
            f"time         {s['time_s']:.2f} s{clock}  {s['updates']} updates  "
            f"{_num(s['updates_per_s'], '.2f')} updates/s",
            f"gradients    pushed {s['pushed']}  applied {s['applied']}  dropped {s['dropped']}"
            + (f" ({reasons})" if reasons else ""),
            f"staleness    mean {_num(s['staleness_mean'], '.3f')}  max {_num(s['staleness_max'], 'd')}{gap}",
            f"time to acc  {reached or '-'}",
        ]
        + ([f"EMA          {s['ema_note']}"] if s.get("ema_note") else [])
        + _cost_line(s.get("sim_cost"))
        + (
            [f"bandwidth    pushes {_num(s['push_ratio'])} of possible, fetches {_num(s['fetch_ratio'])}"]
            if (s.get("push_ratio") or 1.0) < 1.0 or (s.get("fetch_ratio") or 1.0) < 1.0
            else []
        )
        + (
            [
                f"shards       {len(s['shards'])}: updates "
                + " / ".join(str(shard["updates"]) for shard in s["shards"])
                + f"  dropped {' / '.join(str(shard['dropped']) for shard in s['shards'])}"
                + f"  partial pulls {s.get('partial_pulls', 0)}"
            ]
            if s.get("shards")
            else []
        )
    )


def _cost_line(cost: dict[str, Any] | None) -> list[str]:
    """The simulator's own wall time (`runs.simulated.sim_cost`), where the summary has it."""
    if not cost:
        return []
    return [
        f"simulator    {_num(cost.get('per_update_ms'), '.2f')} ms wall per update, "
        f"{_num(cost.get('per_gradient_ms'), '.2f')} ms per gradient ({cost['wall_s']:.1f} s; evaluation and "
        f"checkpoints {cost['aside_wall_s']:.1f} s more)"
    ]


def metrics_rows(trace: TraceLike) -> list[dict[str, Any]]:
    """One row per `eval` event, in trace order: the learning curve with what the server had done by then.

    Columns: t, version, acc, ema_acc, loss (ema_loss and mean_gap where the trace has them), then cumulative
    applied and dropped gradients and the mean staleness of the gradients applied so far (None before the first).
    """
    events = events_of(trace)
    has_ema_loss = any("ema_loss" in e for e in events if e["ev"] == "eval")
    has_gap = any("gap" in e for e in events if e["ev"] == "apply")
    rows: list[dict[str, Any]] = []
    applied = dropped = stale_sum = gap_count = 0
    gap_sum = 0.0
    for e in events:
        if e["ev"] == "apply":
            applied += len(e["staleness"])
            stale_sum += sum(e["staleness"])
            gaps = [g for g in e.get("gap") or () if g is not None]
            gap_sum, gap_count = gap_sum + sum(gaps), gap_count + len(gaps)
        elif e["ev"] == "drop":
            dropped += 1
        elif e["ev"] == "eval":
            row = {"t": e["t"], "version": e.get("version"), "acc": e.get("acc"), "ema_acc": e.get("ema_acc")}
            row["loss"] = e.get("loss")
            if has_ema_loss:
                row["ema_loss"] = e.get("ema_loss")
            row |= {"applied": applied, "dropped": dropped, "mean_staleness": stale_sum / applied if applied else None}
            if has_gap:
                row["mean_gap"] = gap_sum / gap_count if gap_count else None
            rows.append(row)
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write rows (e.g. `metrics_rows`) as CSV with a header; None becomes an empty cell."""
    path = Path(path)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    return path


def staleness_histogram(trace: TraceLike) -> dict[int, int]:
    """Applied gradients per staleness value tau (updates between the read and the apply), sorted by tau."""
    return dict(sorted(Counter(_applied_staleness(trace)).items()))


def staleness_per_worker(trace: TraceLike) -> dict[int, list[int]]:
    """For each worker (sorted), the staleness of each of its applied gradients, in the order they were applied."""
    out: dict[int, list[int]] = {}
    for e in _of(trace, "apply"):
        for w, s in zip(e["workers"], e["staleness"], strict=True):
            out.setdefault(w, []).append(s)
    return dict(sorted(out.items()))


def has_rounds(trace: TraceLike) -> bool:
    """Whether the trace comes from a round policy (BSP, backup workers, SSP).

    The trace does not name its policy, so this reads it off the updates: under rounds every gradient of update v
    was tagged with round v - 1. A stream trace with staleness 0 everywhere passes too, and there it is harmless:
    each "round" is then one update and the gradients computed for it.
    """
    applies = _of(trace, "apply")
    return bool(applies) and all(c == e["version"] - 1 for e in applies for c in e["clocks"])


def kth_gradient_times(trace: TraceLike, rounds: bool | None = None) -> list[list[float]]:
    """For each completed round c = 0, 1, ..., the sorted times from the start of round c to each gradient pushed
    for it, dropped ones included: entry k-1 is the time to the k-th gradient (000_... Fig. 3-4).

    Round c starts at the `apply` event with version c (round 0 at the first `start` event, else t = 0) and is
    complete once the update with version c + 1 was applied. Under SSP a gradient may arrive before its round
    starts; it counts as there at time 0. Gradients dropped because training had finished are left out: they
    arrived after the run ended (and the simulator stamps them with the end time, not their arrival).
    `rounds=None` detects a round policy with `has_rounds`; a stream trace has no rounds and gives [].
    """
    events = events_of(trace)
    if not (has_rounds(events) if rounds is None else rounds):
        return []
    applies = {e["version"]: e["t"] for e in events if e["ev"] == "apply"}
    starts = {0: next((e["t"] for e in events if e["ev"] == "start"), 0.0), **applies}
    complete = sorted(c for c in starts if c + 1 in applies)
    finished = Counter(
        (e["worker"], e["clock"], e["version"]) for e in events if e["ev"] == "drop" and e.get("reason") == "finished"
    )
    times: dict[int, list[float]] = {c: [] for c in complete}
    for e in events:
        if e["ev"] != "push" or e["clock"] not in times:
            continue
        key = (e["worker"], e["clock"], e["version"])
        if finished[key]:
            finished[key] -= 1
            continue
        times[e["clock"]].append(max(0.0, e["t"] - starts[e["clock"]]))
    return [sorted(times[c]) for c in complete]


def kth_cdf(times: Sequence[Sequence[float]], k: int) -> tuple[list[float], list[float]]:
    """The empirical CDF of the time to the k-th gradient (000_... Fig. 3): points (x_i, y_i), x sorted, where
    y_i is the fraction of *all* rounds whose k-th gradient had arrived by x_i. Rounds that never got k gradients
    keep the curve below 1."""
    if k < 1:
        raise ValueError(f"kth_cdf: {k=} must be >= 1")
    xs = sorted(r[k - 1] for r in times if len(r) >= k)
    return xs, [(i + 1) / len(times) for i in range(len(xs))]


def gap_vs_delay(trace: TraceLike, buckets: int = 20) -> list[dict[str, Any]]:
    """Mean Gap and mean delay tau of the applied gradients, per bucket of server versions (001_... Fig. 4, App.
    C.8, which averages per epoch). Uses the `gap` list of `apply` events; [] when the trace has none.

    Each row: first_version, last_version (the update versions in the bucket), gradients, gap, delay.
    """
    if buckets < 1:
        raise ValueError(f"gap_vs_delay: {buckets=} must be >= 1")
    applies = [e for e in _of(trace, "apply") if e.get("gap")]
    if not applies:
        return []
    top = max(e["version"] for e in _of(trace, "apply"))
    width = max(1, -(-top // buckets))  # ceil: versions 1..top in at most `buckets` buckets
    acc: dict[int, tuple[list[float], list[int]]] = {}
    for e in applies:
        gaps, delays = acc.setdefault((e["version"] - 1) // width, ([], []))
        for g, s in zip(e["gap"], e["staleness"], strict=True):
            if g is not None:
                gaps.append(g)
                delays.append(s)
    return [
        {
            "first_version": b * width + 1,
            "last_version": min(top, (b + 1) * width),
            "gradients": len(gaps),
            "gap": sum(gaps) / len(gaps),
            "delay": sum(delays) / len(delays),
        }
        for b, (gaps, delays) in sorted(acc.items())
        if gaps
    ]


def _ratio(made: int, possible: int) -> float | None:
    return made / possible if possible else None
