"""Figures of a run's trace, as PNG files (the numbers behind them are in `collsync.metrics`).

Figures are drawn on a bare `matplotlib.figure.Figure` with an Agg canvas: no pyplot, no global figure registry,
no display needed, and nothing leaks between calls or threads. Each `plot_*` function writes one file and returns its
path; the `*_figure` functions behind them return the figure itself (its labels and legend can be read back).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from collsync.metrics import (
    CLOCKS,
    TraceLike,
    events_of,
    gap_vs_delay,
    kth_cdf,
    kth_gradient_times,
    metrics_rows,
    staleness_histogram,
    summary,
    time_label,
)
from collsync.trace import Trace

Rows = Sequence[dict[str, Any]]
_STEPS_LABEL = "server updates (version)"
_X_KEY = {"time": "t", "steps": "version"}


def _x_label(x: str, clock: str | None) -> str:
    return time_label(clock) if x == "time" else _STEPS_LABEL


def _figure(width: float = 6.4, height: float = 4.2) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(width, height), dpi=120, layout="constrained")
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
        return metrics_rows(data)
    return data


def plot_accuracy(data: TraceLike | Rows, path: str | Path, x: str = "time", clock: str | None = None) -> Path:
    """Write `accuracy_figure` to `path`."""
    return _save(accuracy_figure(data, x, clock), path)


def accuracy_figure(data: TraceLike | Rows, x: str = "time", clock: str | None = None) -> Figure:
    """Test accuracy of theta and of its EMA (000_... §1.1) against time or server updates.

    `data` is a trace or the rows of `metrics_rows`; `x` is "time" (seconds on `clock`, "simulated" or "wall",
    named in the axis label) or "steps" (server version). An EMA evaluated only once (server shards assemble it at
    the end) is one marker, labelled so, rather than a curve.
    """
    _check_x(x)
    rows = _rows(data)
    if clock is None and isinstance(data, Trace):
        clock = data.clock_kind
    fig, ax = _figure()
    points = {key: _series(rows, x, key) for key in ("acc", "ema_acc")}
    once = len(points["ema_acc"][0]) == 1 and len(points["acc"][0]) > 1
    ema_label = "EMA of θ (evaluated at the end only)" if once else "EMA of θ"
    for key, label, style in (("acc", "θ (parameters)", "-"), ("ema_acc", ema_label, "--")):
        xs, ys = points[key]
        if xs:
            ax.plot(xs, ys, style, marker="D" if once and key == "ema_acc" else "o", markersize=3, label=label)
    if ax.lines:
        ax.legend(loc="lower right")
    else:
        _empty(ax, "eval events")
    ax.set(title=f"Test accuracy vs {x}", xlabel=_x_label(x, clock), ylabel="test accuracy (fraction correct)")
    return fig


def plot_staleness(trace: TraceLike, path: str | Path) -> Path:
    """Write `staleness_figure` to `path`."""
    return _save(staleness_figure(trace), path)


def staleness_figure(trace: TraceLike) -> Figure:
    """Histogram of the staleness tau of applied gradients: server updates between a worker's read and the update
    that used its gradient (the delay of 001_...; 000_... Table 1 reports its mean and spread for Async-Opt)."""
    hist = staleness_histogram(trace)
    fig, ax = _figure()
    if hist:
        ax.bar(list(hist), list(hist.values()), width=0.8, color="tab:blue")
        # Staleness is a whole number of updates: ticks on integers only. A lone bar (synchronous runs: all 0) would
        # otherwise get fractional ticks (-0.4 .. 0.4), so the view always spans at least one step either side.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_xlim(min(hist) - 1, max(hist) + 1)
        s = summary(trace)
        ax.set_title(f"Staleness of applied gradients (mean {s['staleness_mean']:.2f}, max {s['staleness_max']})")
    else:
        ax.set_title("Staleness of applied gradients")
        _empty(ax, "applied gradients")
    ax.set(xlabel="staleness τ (server updates)", ylabel="applied gradients (count)")
    return fig


def default_ks(times: Sequence[Sequence[float]], quorum: int | None = None) -> list[int]:
    """The k worth a curve: the first gradient, the middle one, the quorum (what an update waits for) and the
    last two (the stragglers), as 000_... Fig. 3 shows k = 1, 50, 90, 97, ..., 100 of 100."""
    n = max((len(r) for r in times), default=0)
    return sorted({k for k in (1, math.ceil(n / 2), quorum or n, n - 1, n) if 1 <= k <= n})


def plot_kth_cdf(trace: TraceLike, path: str | Path, ks: Sequence[int] | None = None, clock: str | None = None) -> Path:
    """CDF of the time from the start of a round to its k-th gradient, one curve per k (000_... Fig. 3): x = time
    since the round started, y = fraction of rounds whose k-th gradient had arrived by then. The gap between the
    curves of the last few k is the time a synchronous round spends waiting for stragglers. With backup workers the
    curves of k > quorum may stay below 1: a worker that fell behind skips to the server's round (`next_clock`), so
    the round it skipped never gets its gradient. `clock` ("simulated" or "wall") names the seconds on the x axis.
    """
    times = kth_gradient_times(trace)
    clock = clock or (trace.clock_kind if isinstance(trace, Trace) else None)
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
        xlabel=f"{clock + ' ' if clock in CLOCKS else ''}time since the round started (s)",
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


@dataclass(frozen=True)
class Curve:
    """One run in a comparison: its legend `label`, the `group` it averages with (runs that differ only in seed
    share one), the `clock` of its times ("simulated", "wall" or None when unknown) and its `metrics_rows`."""

    label: str
    group: str
    clock: str | None
    rows: Rows


def _panels(curves: Sequence[Curve], x: str) -> list[tuple[str | None, list[Curve]]]:
    """The runs to draw on each panel: one panel against steps; against time, one per clock, so that simulated and
    wall seconds never share an axis (runs whose clock is unknown get a panel of their own)."""
    if x == "steps":
        return [(None, list(curves))]
    order = [c for c in (*CLOCKS, None) if any(curve.clock == c for curve in curves)]
    return [(clock, [curve for curve in curves if curve.clock == clock]) for clock in order]


def compare_accuracy(curves: Sequence[Curve], path: str | Path, x: str = "time", title: str = "") -> Path:
    """Write `comparison_figure` to `path`."""
    return _save(comparison_figure(curves, x, title), path)


def comparison_figure(curves: Sequence[Curve], x: str = "time", title: str = "") -> Figure:
    """Overlay the test accuracy of theta of several runs against time or server updates.

    One colour per group; the seeds of a group are thin lines of its colour, so the legend has one entry per group
    ("sync=async (3 seeds)") however many runs there are, and sits below the axes once it has more than four
    entries or there are several panels. Against time there is one panel per clock, its unit in the axis label
    ("simulated time (s)", "wall time (s)"). `title` (e.g. the overrides every run shares) goes under the main title.
    """
    _check_x(x)
    if not curves:
        raise ValueError("compare_accuracy: no runs to compare")
    panels = _panels(curves, x)
    groups = list(dict.fromkeys(c.group for c in curves))
    below = len(groups) > 4 or len(panels) > 1  # below the axes: over one panel it would hide curves, or name others'
    height = 4.2 + (0.22 * math.ceil(len(groups) / 2) if below else 0.0)
    fig = Figure(figsize=(6.4 * len(panels), height), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colour = {g: f"C{i % 10}" for i, g in enumerate(groups)}
    seeds = {g: sum(1 for c in curves if c.group == g) for g in groups}
    for ax, (clock, members) in zip(axes, panels, strict=True):
        ax.grid(True, alpha=0.3)
        for curve in members:
            many = seeds[curve.group] > 1
            xs, ys = _series(curve.rows, x, "acc")
            ax.plot(xs, ys, "-", color=colour[curve.group], lw=1.0 if many else 1.6, alpha=0.75 if many else 1.0)
        ax.set(xlabel=_x_label(x, clock), ylabel="test accuracy of θ (fraction correct)")
        if len(panels) > 1:
            runs = f"{len(members)} run{'s' if len(members) > 1 else ''}"
            ax.set_title(f"{clock + ' time' if clock else 'clock not recorded'}: {runs}", fontsize="medium")
    handles = [
        Line2D([], [], color=colour[g], lw=1.6, label=f"{g} ({seeds[g]} seeds)" if seeds[g] > 1 else g) for g in groups
    ]
    if below:
        fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize="small")
    else:
        axes[-1].legend(handles=handles, loc="best", fontsize="small")  # where it hides the fewest points
    fig.suptitle(f"Test accuracy vs {x}" + (f"\n{title}" if title else ""), fontsize="medium")
    return fig
