"""Figures of a run's trace, as PNG files (the numbers behind them are in `collsync.metrics`).

Figures are drawn on a bare `matplotlib.figure.Figure` with an Agg canvas: no pyplot, no global figure registry,
no display needed, and nothing leaks between calls or threads. Each function writes one file and returns its path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from collsync.metrics import (
    TraceLike,
    events_of,
    gap_vs_delay,
    kth_cdf,
    kth_gradient_times,
    metrics_rows,
    run_labels,
    staleness_histogram,
    summary,
)
from collsync.trace import Trace

Rows = Sequence[dict[str, Any]]
_X_LABEL = {"time": "time (s)", "steps": "server updates (version)"}
_X_KEY = {"time": "t", "steps": "version"}


def _figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(6.4, 4.2), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg backend, set on this figure only
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _empty(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this trace", ha="center", va="center", transform=ax.transAxes, color="gray")


def _check_x(x: str) -> None:
    if x not in _X_KEY:
        raise ValueError(f"plot: x={x!r} must be 'time' or 'steps'")


def _series(rows: Rows, x: str, key: str) -> tuple[list[float], list[float]]:
    pts = [(r[_X_KEY[x]], r[key]) for r in rows if r.get(key) is not None and r.get(_X_KEY[x]) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _rows(data: TraceLike | Rows) -> Rows:
    if isinstance(data, Trace) or any("ev" in r for r in data):
        return metrics_rows(data)  # type: ignore[arg-type]
    return data  # type: ignore[return-value]


def plot_accuracy(data: TraceLike | Rows, path: str | Path, x: str = "time") -> Path:
    """Test accuracy of theta and of its EMA (000_... §1.1) against time or server updates.

    `data` is a trace or the rows of `metrics_rows`; `x` is "time" (seconds) or "steps" (server version).
    """
    _check_x(x)
    rows = _rows(data)
    fig, ax = _figure()
    for key, label, style in (("acc", "θ (parameters)", "-"), ("ema_acc", "EMA of θ", "--")):
        xs, ys = _series(rows, x, key)
        if xs:
            ax.plot(xs, ys, style, marker="o", markersize=3, label=label)
    if ax.lines:
        ax.legend(loc="lower right")
    else:
        _empty(ax, "eval events")
    ax.set(title=f"Test accuracy vs {x}", xlabel=_X_LABEL[x], ylabel="test accuracy (fraction correct)")
    return _save(fig, path)


def plot_staleness(trace: TraceLike, path: str | Path) -> Path:
    """Histogram of the staleness tau of applied gradients: server updates between a worker's read and the update
    that used its gradient (the delay of 001_...; 000_... Table 1 reports its mean and spread for Async-Opt)."""
    hist = staleness_histogram(trace)
    fig, ax = _figure()
    if hist:
        ax.bar(list(hist), list(hist.values()), width=0.8, color="tab:blue")
        ax.xaxis.get_major_locator().set_params(integer=True)
        s = summary(trace)
        ax.set_title(f"Staleness of applied gradients (mean {s['staleness_mean']:.2f}, max {s['staleness_max']})")
    else:
        ax.set_title("Staleness of applied gradients")
        _empty(ax, "applied gradients")
    ax.set(xlabel="staleness τ (server updates)", ylabel="applied gradients (count)")
    return _save(fig, path)


def default_ks(times: Sequence[Sequence[float]], quorum: int | None = None) -> list[int]:
    """The k worth a curve: the first gradient, the middle one, the quorum (what an update waits for) and the
    last two (the stragglers), as 000_... Fig. 3 shows k = 1, 50, 90, 97, ..., 100 of 100."""
    n = max((len(r) for r in times), default=0)
    return sorted({k for k in (1, math.ceil(n / 2), quorum or n, n - 1, n) if 1 <= k <= n})


def plot_kth_cdf(trace: TraceLike, path: str | Path, ks: Sequence[int] | None = None) -> Path:
    """CDF of the time from the start of a round to its k-th gradient, one curve per k (000_... Fig. 3): x = time
    since the round started, y = fraction of rounds whose k-th gradient had arrived by then. The gap between the
    curves of the last few k is the time a synchronous round spends waiting for stragglers. With backup workers the
    curves of k > quorum may stay below 1: a worker that fell behind skips to the server's round (`next_clock`), so
    the round it skipped never gets its gradient."""
    times = kth_gradient_times(trace)
    quorum = max((len(e["workers"]) for e in events_of(trace) if e["ev"] == "apply"), default=None)
    ks = list(ks) if ks is not None else default_ks(times, quorum)
    fig, ax = _figure()
    for k in ks:
        xs, ys = kth_cdf(times, k)
        if xs:
            note = " (quorum)" if k == quorum and k < max(len(r) for r in times) else ""
            ax.step([0.0, *xs], [0.0, *ys], where="post", label=f"k = {k}{note}")
    if ax.lines:
        ax.legend(loc="lower right", title="k-th gradient")
        ax.set_ylim(0.0, 1.02)
    else:
        _empty(ax, "rounds")
    ax.set(
        title=f"Time to the k-th gradient of a round ({len(times)} rounds)",
        xlabel="time since the round started (s)",
        ylabel="fraction of rounds with k gradients",
    )
    return _save(fig, path)


def plot_gap_vs_delay(trace: TraceLike, path: str | Path, buckets: int = 20) -> Path:
    """Mean Gap and mean delay tau of applied gradients over training, per bucket of server versions (001_...
    Fig. 4): the Gap (1 + parameter distance over C) stays below the delay, so penalising by delay over-penalises."""
    rows = gap_vs_delay(trace, buckets)
    fig, ax = _figure()
    if rows:
        mid = [(r["first_version"] + r["last_version"]) / 2 for r in rows]
        ax.plot(mid, [r["gap"] for r in rows], "-o", markersize=3, label="mean Gap (dimensionless)")
        ax.plot(mid, [r["delay"] for r in rows], "-s", markersize=3, label="mean delay τ (server updates)")
        ax.legend(loc="best")
    else:
        _empty(ax, "Gap data")
    ax.set(title="Gap vs delay over training", xlabel="server updates (version)", ylabel="mean per applied gradient")
    return _save(fig, path)


def compare_runs(run_dirs: Sequence[Path], out_path: str | Path, x: str = "time") -> Path:
    """Overlay the test accuracy of several run folders (each with a trace.jsonl): theta solid, its EMA dashed, one
    colour per run, labelled with `metrics.run_labels` (folder names, plus overrides for multirun jobs)."""
    _check_x(x)
    fig, ax = _figure()
    any_ema = False
    for i, (run, label) in enumerate(zip(run_dirs, run_labels(run_dirs), strict=True)):
        trace_path = Path(run) / "trace.jsonl"
        if not trace_path.is_file():
            raise FileNotFoundError(f"compare_runs: no trace.jsonl in {run}")
        rows = metrics_rows(Trace.read_jsonl(trace_path))
        colour = f"C{i % 10}"
        ax.plot(*_series(rows, x, "acc"), "-", color=colour, label=label)
        xs, ys = _series(rows, x, "ema_acc")
        if xs:
            any_ema = True
            ax.plot(xs, ys, "--", color=colour, alpha=0.7)
    handles, _ = ax.get_legend_handles_labels()
    if any_ema:
        handles += [Line2D([], [], color="gray", ls="-", label="θ"), Line2D([], [], color="gray", ls="--", label="EMA")]
    ax.legend(handles=handles, loc="lower right", fontsize="small")
    ax.set(title=f"Test accuracy vs {x}", xlabel=_X_LABEL[x], ylabel="test accuracy (fraction correct)")
    return _save(fig, out_path)
