"""Metrics, figures and `collsync-report` on small hand-written traces with known times."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from collsync import plots
from collsync.checks import check_trace
from collsync.metrics import (
    format_summary,
    gap_vs_delay,
    has_rounds,
    kth_cdf,
    kth_gradient_times,
    metrics_rows,
    staleness_histogram,
    staleness_per_worker,
    summary,
    write_csv,
)
from collsync.policy import asynchronous, backup, ssp
from collsync.report import main as report_main
from collsync.runfiles import run_names, write_report
from collsync.runs.simulated import sim_cost
from collsync.trace import Trace


def build(*events: tuple) -> Trace:
    """A trace from (t, ev, fields) tuples."""
    trace = Trace(clock=lambda: 0.0)
    trace.extend({"t": t, "ev": ev, **fields} for t, ev, fields in events)
    return trace


def start(w: int, c: int, v: int) -> dict:
    return {"worker": w, "clock": c, "version": v}


push = start


def apply(v: int, workers: list[int], clocks: list[int], staleness: list[int], **extra: object) -> dict:
    return {"version": v, "workers": workers, "clocks": clocks, "staleness": staleness, **extra}


def drop(w: int, c: int, v: int, server: int, reason: str) -> dict:
    return {"worker": w, "clock": c, "version": v, "server": server, "reason": reason}


def evaluation(v: int, acc: float, ema_acc: float, loss: float, **extra: float) -> dict:
    return {"version": v, "acc": acc, "ema_acc": ema_acc, "loss": loss, **extra}


@pytest.fixture
def backup_trace() -> Trace:
    """3 workers, 1 backup (quorum 2), 2 updates. Worker 2 is late for round 0; worker 0's round-1 gradient lands
    after training ended."""
    return build(
        (0.0, "start", start(0, 0, 0)),
        (0.0, "start", start(1, 0, 0)),
        (0.0, "start", start(2, 0, 0)),
        (0.0, "eval", evaluation(0, 0.1, 0.1, 2.3)),
        (1.0, "push", push(1, 0, 0)),
        (1.5, "push", push(0, 0, 0)),
        (1.5, "apply", apply(1, [0, 1], [0, 0], [0, 0])),
        (1.5, "eval", evaluation(1, 0.6, 0.5, 1.0)),
        (1.5, "start", start(0, 1, 1)),
        (1.5, "start", start(1, 1, 1)),
        (2.5, "push", push(2, 0, 0)),
        (2.5, "drop", drop(2, 0, 0, 1, "late")),
        (2.5, "start", start(2, 1, 1)),
        (3.0, "push", push(1, 1, 1)),
        (3.5, "push", push(2, 1, 1)),
        (3.5, "apply", apply(2, [1, 2], [1, 1], [0, 0])),
        (3.5, "eval", evaluation(2, 0.9, 0.8, 0.5)),
        (3.5, "push", push(0, 1, 1)),
        (3.5, "drop", drop(0, 1, 1, 2, "finished")),
    )


@pytest.fixture
def async_trace() -> Trace:
    """3 asynchronous workers (quorum 1), 4 updates with Gap-Aware's `gap` per gradient."""
    return build(
        (0.0, "start", start(0, 0, 0)),
        (0.0, "start", start(1, 0, 0)),
        (0.0, "start", start(2, 0, 0)),
        (1.0, "push", push(0, 0, 0)),
        (1.0, "apply", apply(1, [0], [0], [0], gap=[1.0])),
        (1.0, "start", start(0, 1, 1)),
        (2.0, "push", push(1, 0, 0)),
        (2.0, "apply", apply(2, [1], [0], [1], gap=[1.5])),
        (2.0, "eval", evaluation(2, 0.4, 0.3, 1.2, ema_loss=1.4)),
        (2.0, "start", start(1, 2, 2)),
        (2.5, "push", push(0, 1, 1)),
        (2.5, "apply", apply(3, [0], [1], [1], gap=[1.25])),
        (2.5, "start", start(0, 3, 3)),
        (3.0, "push", push(2, 0, 0)),
        (3.0, "apply", apply(4, [2], [0], [3], gap=[2.0])),
        (3.0, "eval", evaluation(4, 0.7, 0.6, 0.8, ema_loss=0.9)),
        (3.0, "push", push(1, 2, 2)),
        (3.0, "drop", drop(1, 2, 2, 4, "finished")),
        (3.0, "push", push(0, 3, 3)),
        (3.0, "drop", drop(0, 3, 3, 4, "finished")),
    )


def test_hand_traces_are_valid_runs(backup_trace, async_trace):
    assert check_trace(backup_trace, backup(1), 3) == {"pushed": 6, "applied": 4, "dropped": 2, "updates": 2}
    assert check_trace(async_trace, asynchronous(), 3) == {"pushed": 6, "applied": 4, "dropped": 2, "updates": 4}


def test_summary_counts_and_time_to_accuracy(backup_trace):
    s = summary(backup_trace, thresholds=(0.5, 0.9, 0.95))
    assert s["final_acc"] == 0.9 and s["final_ema_acc"] == 0.8 and s["final_loss"] == 0.5
    assert s["best_acc"] == 0.9 and s["best_ema_acc"] == 0.8 and s["evals"] == 3
    assert s["time_s"] == 3.5 and s["updates"] == 2 and s["updates_per_s"] == pytest.approx(2 / 3.5)
    assert (s["pushed"], s["applied"], s["dropped"], s["workers"]) == (6, 4, 2, 3)
    assert s["dropped_by_reason"] == {"late": 1, "finished": 1}
    assert s["staleness_mean"] == 0.0 and s["staleness_max"] == 0 and s["gap_mean"] is None
    assert s["time_to_acc"] == {0.5: 1.5, 0.9: 3.5, 0.95: None}
    assert s["time_to_ema_acc"] == {0.5: 1.5, 0.9: None, 0.95: None}


def test_summary_says_which_clock(backup_trace):
    assert summary(backup_trace)["clock"] == "simulated"  # a trace on a given clock: the simulator's
    assert summary(Trace())["clock"] == "wall"
    assert (
        summary(backup_trace.events)["clock"] is None and summary(backup_trace.events, clock="wall")["clock"] == "wall"
    )
    assert format_summary(summary(backup_trace)).splitlines()[1].startswith("time         3.50 s simulated  2 updates")
    assert format_summary(summary(Trace())).splitlines()[1].startswith("time         0.00 s wall  0 updates")
    assert format_summary(summary(backup_trace.events)).splitlines()[1].startswith("time         3.50 s  2 updates")
    with pytest.raises(ValueError, match="clock='cpu'"):
        summary(backup_trace, clock="cpu")


def test_ema_evaluated_once_gives_no_time_to_ema_accuracy(backup_trace):
    """With server shards the EMA is assembled only at the end: one point, which must not pass for the time at
    which every threshold was reached."""
    once = build(
        *[(e["t"], e["ev"], {k: v for k, v in e.items() if k not in ("t", "ev")}) for e in backup_trace.events]
    )
    for e in once.of("eval")[:-1]:
        del e["ema_acc"]
    s = summary(once, thresholds=(0.5, 0.9))
    assert s["time_to_acc"] == {0.5: 1.5, 0.9: 3.5}
    assert s["time_to_ema_acc"] is None and s["ema_evals"] == 1 and "once" in s["ema_note"]
    assert s["final_ema_acc"] == 0.8
    assert format_summary(s).splitlines()[-1].startswith("EMA          the EMA was evaluated once")
    assert summary(backup_trace)["ema_evals"] == 3 and summary(backup_trace)["time_to_ema_acc"] is not None
    assert "ema_note" not in summary(backup_trace)
    figure = plots.accuracy_figure(once, x="steps")
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert labels == ["θ (parameters)", "EMA of θ (evaluated at the end only)"]


def test_summary_of_empty_trace_and_format():
    s = summary(Trace())
    assert s["final_acc"] is None and s["updates"] == 0 and s["updates_per_s"] is None
    assert "accuracy" in format_summary(s)


def test_format_summary_reads_json_round_trip(async_trace):
    text = format_summary(json.loads(json.dumps(summary(async_trace, thresholds=(0.5, 0.8)))))
    lines = text.splitlines()
    assert len(lines) == 5
    assert "dropped 2 (finished 2)" in lines[2]
    assert "mean 1.250  max 3  gap mean 1.438" in lines[3]
    assert lines[4] == "time to acc  0.5: 3.00 s  0.8: never"


def test_staleness_histogram_and_per_worker(async_trace):
    assert staleness_histogram(async_trace) == {0: 1, 1: 2, 3: 1}
    assert list(staleness_histogram(async_trace)) == [0, 1, 3]
    assert staleness_per_worker(async_trace) == {0: [0, 1], 1: [1], 2: [3]}
    s = summary(async_trace)
    assert s["staleness_mean"] == 1.25 and s["staleness_max"] == 3 and s["gap_mean"] == pytest.approx(1.4375)


def test_kth_gradient_times_per_round(backup_trace):
    assert has_rounds(backup_trace)
    # round 0 starts at 0.0: pushes at 1.0, 1.5 and 2.5 (late, dropped, still counted);
    # round 1 starts at the first apply (1.5): pushes at 3.0 and 3.5; worker 0's came after the end (left out).
    assert kth_gradient_times(backup_trace) == [[1.0, 1.5, 2.5], [1.5, 2.0]]
    times = kth_gradient_times(backup_trace)
    assert kth_cdf(times, 1) == ([1.0, 1.5], [0.5, 1.0])
    assert kth_cdf(times, 2) == ([1.5, 2.0], [0.5, 1.0])
    assert kth_cdf(times, 3) == ([2.5], [0.5])  # only one round ever got a third gradient
    assert kth_cdf(times, 4) == ([], [])
    with pytest.raises(ValueError, match="k=0"):
        kth_cdf(times, 0)


def test_kth_gradient_times_ssp_gradient_before_its_round():
    trace = build(
        (0.0, "start", start(0, 0, 0)),
        (0.0, "start", start(1, 0, 0)),
        (1.0, "push", push(0, 0, 0)),
        (1.0, "start", start(0, 1, 0)),
        (2.0, "push", push(0, 1, 0)),  # round 1 starts only at t = 3
        (3.0, "push", push(1, 0, 0)),
        (3.0, "apply", apply(1, [0, 1], [0, 0], [0, 0])),
        (3.0, "start", start(1, 1, 1)),
        (4.0, "push", push(1, 1, 1)),
        (4.0, "apply", apply(2, [0, 1], [1, 1], [1, 0])),
    )
    check_trace(trace, ssp(1), 2)
    assert kth_gradient_times(trace) == [[1.0, 3.0], [0.0, 1.0]]


def test_stream_trace_has_no_rounds(async_trace):
    assert not has_rounds(async_trace)
    assert kth_gradient_times(async_trace) == []


def test_gap_vs_delay_buckets(async_trace, backup_trace):
    assert gap_vs_delay(async_trace, buckets=2) == [
        {"first_version": 1, "last_version": 2, "gradients": 2, "gap": 1.25, "delay": 0.5},
        {"first_version": 3, "last_version": 4, "gradients": 2, "gap": 1.625, "delay": 2.0},
    ]
    assert [r["gap"] for r in gap_vs_delay(async_trace)] == [1.0, 1.5, 1.25, 2.0]  # 20 buckets, 4 versions
    assert gap_vs_delay(backup_trace) == []


def test_metrics_rows_and_csv(backup_trace, async_trace, tmp_path):
    rows = metrics_rows(backup_trace)
    assert [(r["t"], r["version"], r["applied"], r["dropped"], r["mean_staleness"]) for r in rows] == [
        (0.0, 0, 0, 0, None),
        (1.5, 1, 2, 0, 0.0),
        (3.5, 2, 4, 1, 0.0),
    ]
    path = write_csv(rows, tmp_path / "m.csv")
    with open(path, newline="") as f:
        back = list(csv.DictReader(f))
    assert list(back[0]) == ["t", "version", "acc", "ema_acc", "loss", "applied", "dropped", "mean_staleness"]
    assert back[0] == {
        "t": "0.0",
        "version": "0",
        "acc": "0.1",
        "ema_acc": "0.1",
        "loss": "2.3",
        "applied": "0",
        "dropped": "0",
        "mean_staleness": "",
    }
    assert back[2]["acc"] == "0.9" and back[2]["dropped"] == "1"
    extra = metrics_rows(async_trace)
    assert [(r["ema_loss"], r["mean_gap"], r["mean_staleness"]) for r in extra] == [
        (1.4, 1.25, 0.5),
        (0.9, 1.4375, 1.25),
    ]


def _decodes(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_write_report_files(backup_trace, async_trace, tmp_path):
    paths = write_report(backup_trace, tmp_path / "b")
    assert sorted(paths) == [
        "accuracy_vs_steps",
        "accuracy_vs_time",
        "kth_gradient_cdf",
        "metrics",
        "staleness_hist",
        "summary",
    ]
    for key in ("accuracy_vs_steps", "accuracy_vs_time", "kth_gradient_cdf", "staleness_hist"):
        _decodes(paths[key])
    assert json.loads(paths["summary"].read_text())["time_to_acc"]["0.9"] == 3.5
    paths = write_report(async_trace, tmp_path / "a", extra={"note": "x"})
    assert "gap_vs_delay" in paths and "kth_gradient_cdf" not in paths
    _decodes(paths["gap_vs_delay"])
    assert json.loads(paths["summary"].read_text())["note"] == "x"


def test_staleness_histogram_has_integer_ticks(backup_trace, async_trace):
    """A synchronous run's histogram is one bar at 0: its ticks must still be whole updates (not -0.4 .. 0.4)."""
    for trace, bars in ((backup_trace, [0]), (async_trace, [0, 1, 3])):
        ax = plots.staleness_figure(trace).axes[0]
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert set(bars) <= set(ticks)  # every bar sits on a labelled tick
        assert ax.get_xlabel() == "staleness τ (server updates)"


def test_accuracy_axis_names_the_clock(backup_trace):
    assert plots.accuracy_figure(backup_trace).axes[0].get_xlabel() == "simulated time (s)"
    assert plots.accuracy_figure(metrics_rows(backup_trace), clock="wall").axes[0].get_xlabel() == "wall time (s)"
    assert plots.accuracy_figure(metrics_rows(backup_trace)).axes[0].get_xlabel() == "time (s)"
    assert plots.accuracy_figure(backup_trace, x="steps").axes[0].get_xlabel() == "server updates (version)"


def test_plots_accept_rows_and_empty_traces(backup_trace, tmp_path):
    _decodes(plots.plot_accuracy(metrics_rows(backup_trace), tmp_path / "rows.png", x="steps"))
    _decodes(plots.plot_kth_cdf(backup_trace, tmp_path / "k.png", ks=[1, 3]))
    for plot in (plots.plot_accuracy, plots.plot_staleness, plots.plot_kth_cdf, plots.plot_gap_vs_delay):
        _decodes(plot(Trace(), tmp_path / f"empty_{plot.__name__}.png"))
    with pytest.raises(ValueError, match="x='epochs'"):
        plots.plot_accuracy(backup_trace, tmp_path / "bad.png", x="epochs")
    assert plots.default_ks([[1.0, 2.0, 3.0, 4.0, 5.0]], quorum=3) == [1, 3, 4, 5]


def _run_dir(path: Path, trace: Trace) -> Path:
    path.mkdir(parents=True)
    trace.write_jsonl(path / "trace.jsonl")
    return path


def test_report_cli_one_run_keeps_trainer_keys(backup_trace, tmp_path, capsys):
    run = _run_dir(tmp_path / "run", backup_trace)
    (run / "summary.json").write_text(json.dumps({"final_acc": 0.0, "trace_checks": {"pushed": 6}}))
    assert report_main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "== run" in out and "pushed 6  applied 4  dropped 2" in out
    written = json.loads((run / "summary.json").read_text())
    assert written["final_acc"] == 0.9 and written["trace_checks"] == {"pushed": 6}
    for name in ("metrics.csv", "accuracy_vs_time.png", "kth_gradient_cdf.png"):
        assert (run / name).stat().st_size > 0


def test_run_names_disambiguate(tmp_path):
    assert run_names([tmp_path / "x" / "0", tmp_path / "y" / "0", tmp_path / "z"]) == ["x_0", "y_0", "z"]


def test_format_summary_adds_a_line_for_server_shards(async_trace):
    s = summary(async_trace)
    s["shards"] = [{"updates": 300, "dropped": 4}, {"updates": 300, "dropped": 7}]
    s["partial_pulls"] = 12
    assert format_summary(s).splitlines()[-1] == "shards       2: updates 300 / 300  dropped 4 / 7  partial pulls 12"


def test_the_simulators_cost_per_update_and_per_gradient():
    cost = sim_cost(2.0, 0.5, updates=100, gradients=800)
    assert cost == {"wall_s": 2.0, "aside_wall_s": 0.5, "per_update_ms": 20.0, "per_gradient_ms": 2.5}
    assert sim_cost(0.1, 0.0, updates=0, gradients=0)["per_update_ms"] is None  # a resumed run already finished
    line = format_summary({**summary(Trace()), "sim_cost": cost}).splitlines()[-1]
    assert line == (
        "simulator    20.00 ms wall per update, 2.50 ms per gradient (2.0 s; evaluation and checkpoints 0.5 s more)"
    )
    assert "simulator" not in format_summary(summary(Trace()))
