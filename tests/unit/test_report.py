"""`collsync-report` on sweeps: finding runs, labels from overrides, clocks kept apart, the table over seeds, the
comparison figures (read back: axis labels and legend texts), and --choose-backups against the simulator."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from collsync import plots
from collsync.metrics import metrics_rows
from collsync.policy import backup, bsp
from collsync.report import format_table, group_table, label_runs, main
from collsync.rules import sgd
from collsync.runfiles import ReportError, find_runs, read_run, run_clock
from collsync.server import Server
from collsync.sim import Simulator
from collsync.stragglers import gamma_heterogeneous, gamma_homogeneous
from collsync.trace import Trace


def curve_trace(times: list[float], accs: list[float], staleness: int = 0, dropped: int = 0) -> Trace:
    """A small valid trace: one worker, one update and one eval at each time, with the given accuracies."""
    trace = Trace(clock=lambda: 0.0)
    for v, (t, acc) in enumerate(zip(times, accs, strict=True), start=1):
        trace.extend(
            [
                {"t": t, "ev": "push", "worker": 0, "clock": v - 1, "version": v - 1},
                {"t": t, "ev": "apply", "version": v, "workers": [0], "clocks": [v - 1], "staleness": [staleness]},
                {"t": t, "ev": "eval", "version": v, "acc": acc, "ema_acc": acc, "loss": 1.0 - acc},
            ]
        )
    trace.extend(
        {"t": times[-1], "ev": "drop", "worker": 0, "clock": 0, "version": 0, "reason": "late"} for _ in range(dropped)
    )
    return trace


def run_folder(
    path: Path, trace: Trace, overrides: list[str] | None = None, clock: str | None = "simulated", runtime: str = "sim"
) -> Path:
    """A run folder as collsync-train leaves it: trace.jsonl, summary.json (with `clock`) and .hydra files."""
    path.mkdir(parents=True)
    trace.write_jsonl(path / "trace.jsonl")
    (path / "summary.json").write_text(json.dumps({"clock": clock} if clock else {}))
    if overrides is not None:
        (path / ".hydra").mkdir()
        (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (path / ".hydra" / "config.yaml").write_text(f"runtime:\n  _target_: collsync.runtime.spec.{runtime}\n")
    return path


def sweep(root: Path, syncs: tuple[str, ...] = ("bsp", "backup", "async"), seeds: tuple[int, ...] = (0, 1, 2)) -> Path:
    """A Hydra multirun folder: multirun.yaml, job folders 0..n-1 (sync x seed), and a non-run folder."""
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    (root / ".submitit").mkdir()
    job = 0
    for i, sync in enumerate(syncs):
        for seed in seeds:
            # Slower syncs reach accuracy later; seeds shift times by 1 s so the spread is known: std 1.0.
            times = [10.0 * (i + 1) + seed, 20.0 * (i + 1) + seed, 30.0 * (i + 1) + seed]
            trace = curve_trace(times, [0.4, 0.85, 0.9 + 0.01 * seed], staleness=i, dropped=seed)
            run_folder(root / str(job), trace, [f"sync={sync}", f"seed={seed}", "steps=3"])
            job += 1
    return root


def test_find_runs_in_a_sweep_folder_and_a_glob(tmp_path):
    root = sweep(tmp_path / "multirun" / "2026-01-01" / "10-00-00", seeds=(0, 1, 2, 3))  # 12 jobs: 0..11
    (root / "report").mkdir()  # a previous comparison: not a run
    found = find_runs([root])
    assert [p.name for p in found] == [str(i) for i in range(12)]  # numeric order, not 0, 1, 10, 11, 2
    glob = sorted(root.iterdir())  # what `collsync-report multirun/<sweep>/*` passes: multirun.yaml included
    assert [p.name for p in find_runs(glob)] == [p.name for p in found]
    assert find_runs([root / "3"]) == [Path(root / "3")]
    with pytest.raises(ReportError, match="no such file or folder"):
        find_runs([root / "missing"])
    with pytest.raises(ReportError, match="no run folder"):
        find_runs([root / "report"])


def test_labels_from_overrides_and_groups_over_seeds(tmp_path):
    runs = [read_run(p) for p in find_runs([sweep(tmp_path / "s")])]
    common = label_runs(runs)
    assert common == "steps=3"
    assert [r.label for r in runs[:4]] == [
        "sync=bsp seed=0",
        "sync=bsp seed=1",
        "sync=bsp seed=2",
        "sync=backup seed=0",
    ]
    assert [r.group for r in runs] == ["sync=bsp"] * 3 + ["sync=backup"] * 3 + ["sync=async"] * 3
    assert all("10-00" not in r.label and not r.label.isdigit() for r in runs)


def test_same_overrides_on_two_clocks_are_two_groups(tmp_path):
    a = read_run(run_folder(tmp_path / "a", curve_trace([1.0], [0.5]), ["sync=async"], clock="simulated"))
    b = read_run(run_folder(tmp_path / "b", curve_trace([1.0], [0.5]), ["sync=async"], clock="wall"))
    label_runs([a, b])
    assert (a.label, b.label) == ("sync=async [simulated]", "sync=async [wall]")
    assert a.group != b.group


def test_clock_from_summary_then_config(tmp_path):
    trace = curve_trace([1.0], [0.5])
    assert run_clock(run_folder(tmp_path / "s", trace, ["x=1"], clock="wall", runtime="sim")) == "wall"  # summary wins
    assert run_clock(run_folder(tmp_path / "c", trace, ["x=1"], clock=None, runtime="sim")) == "simulated"
    assert run_clock(run_folder(tmp_path / "m", trace, ["x=1"], clock=None, runtime="partial")) == "wall"
    assert run_clock(run_folder(tmp_path / "a", trace, ["x=1"], clock=None, runtime="auto")) is None  # cannot tell
    assert run_clock(run_folder(tmp_path / "n", trace, None, clock=None)) is None


def test_group_table_mean_and_spread(tmp_path):
    runs = [read_run(p) for p in find_runs([sweep(tmp_path / "s")])]
    label_runs(runs)
    rows = group_table(runs, thresholds=(0.8, 0.9, 0.95))
    assert [r["group"] for r in rows] == ["sync=bsp", "sync=backup", "sync=async"]
    bsp_row = rows[0]
    assert bsp_row["seeds"] == 3 and bsp_row["clock"] == "simulated"
    assert bsp_row["time_to_0.8_mean"] == pytest.approx(21.0) and bsp_row["time_to_0.8_std"] == pytest.approx(1.0)
    assert bsp_row["time_to_0.9_mean"] == pytest.approx(31.0) and bsp_row["time_to_0.9_reached"] == 3
    assert bsp_row["time_to_0.95_reached"] == 0 and bsp_row["time_to_0.95_mean"] is None
    assert bsp_row["final_acc_mean"] == pytest.approx(0.91) and bsp_row["final_acc_std"] == pytest.approx(0.01)
    assert bsp_row["updates_per_s_mean"] == pytest.approx((3 / 30 + 3 / 31 + 3 / 32) / 3)
    assert bsp_row["dropped_mean"] == pytest.approx(1.0) and rows[2]["staleness_mean_mean"] == pytest.approx(2.0)
    text = format_table(rows, thresholds=(0.8, 0.9, 0.95))
    lines = text.splitlines()
    assert lines[0].startswith("| runs | seeds | time to 0.8 (simulated s) | time to 0.9 (simulated s) |")
    assert lines[2] == (
        "| sync=bsp | 3 | 21.00 ± 1.00 | 31.00 ± 1.00 | never | 0.910 ± 0.010 | 0.910 ± 0.010 | 0.10 ± 0.00 "
        "| 1.0 ± 1.0 | 0.00 ± 0.00 |"
    )


def test_table_counts_seeds_that_never_got_there(tmp_path):
    runs = [
        read_run(run_folder(tmp_path / str(s), curve_trace([1.0, 2.0 + s], [0.5, acc]), [f"seed={s}", "sync=ssp"]))
        for s, acc in enumerate((0.9, 0.95, 0.7))
    ]
    label_runs(runs)
    row = group_table(runs, thresholds=(0.9,))[0]
    assert row["group"] == "sync=ssp" and row["time_to_0.9_reached"] == 2
    assert "| 2.50 ± 0.71 (2 of 3) |" in format_table([row], thresholds=(0.9,))


def test_table_marks_runs_that_stopped_early(tmp_path):
    runs = [read_run(run_folder(tmp_path / str(s), curve_trace([1.0, 2.0], [0.5, 0.9]), [f"seed={s}"])) for s in (0, 1)]
    stopped = tmp_path / "1" / "summary.json"
    stopped.write_text(json.dumps({"clock": "simulated", "incomplete": "guard: the test loss is nan"}))
    runs[1] = read_run(tmp_path / "1")
    label_runs(runs)
    row = group_table(runs, thresholds=(0.9,))[0]
    assert row["stopped_early"] == 1
    assert (
        format_table([row], thresholds=(0.9,))
        .splitlines()[2]
        .startswith("| defaults (1 of 2 stopped early) | 2 |")  # a sweep over seeds only: one group
    )


def legend_texts(figure) -> list[str]:
    legends = [*figure.legends, *(ax.get_legend() for ax in figure.axes if ax.get_legend() is not None)]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


def test_comparison_figure_keeps_clocks_apart_and_groups_seeds(tmp_path):
    runs = [read_run(p) for p in find_runs([sweep(tmp_path / "s")])]
    wall = read_run(
        run_folder(tmp_path / "w", curve_trace([0.1, 0.2, 0.3], [0.5, 0.8, 0.9]), ["sync=psp", "steps=3"], "wall")
    )
    runs.append(wall)
    label_runs(runs)
    curves = [plots.Curve(r.label, r.group, r.clock, metrics_rows(r.trace)) for r in runs]
    figure = plots.comparison_figure(curves, x="time", title="all runs: steps=3")
    assert [ax.get_xlabel() for ax in figure.axes] == ["simulated time (s)", "wall time (s)"]
    assert [len(ax.lines) for ax in figure.axes] == [9, 1]  # nothing wall-clocked on the simulated panel
    assert legend_texts(figure) == ["sync=bsp (3 seeds)", "sync=backup (3 seeds)", "sync=async (3 seeds)", "sync=psp"]
    assert "all runs: steps=3" in figure._suptitle.get_text()
    steps = plots.comparison_figure(curves, x="steps")
    assert [ax.get_xlabel() for ax in steps.axes] == ["server updates (version)"] and len(steps.axes[0].lines) == 10


def test_comparison_legend_of_many_groups_sits_below(tmp_path):
    """Nine runs of nine different configs: one legend entry each, outside the axes (below), not over the curves."""
    curves = [
        plots.Curve(f"lr={i}", f"lr={i}", "simulated", metrics_rows(curve_trace([1.0, 2.0], [0.3, 0.5])))
        for i in range(9)
    ]
    figure = plots.comparison_figure(curves)
    assert figure.axes[0].get_legend() is None and len(figure.legends) == 1
    assert legend_texts(figure) == [f"lr={i}" for i in range(9)]
    figure.canvas.draw()
    legend_box = figure.legends[0].get_window_extent()
    assert legend_box.y1 <= figure.axes[0].get_window_extent().y0  # entirely under the plotting area


def test_report_of_a_sweep_writes_comparison_inside_it(tmp_path, monkeypatch, capsys):
    root = sweep(tmp_path / "multirun" / "day" / "time")
    monkeypatch.chdir(tmp_path)
    assert main([str(root.relative_to(tmp_path))]) == 0
    out = root / "report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"]  # nothing in the current folder
    for name in ("accuracy_vs_time.png", "accuracy_vs_steps.png", "table.md", "table.csv", "runs.csv"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "table.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["group"] for r in table] == ["sync=bsp", "sync=backup", "sync=async"] and table[0]["seeds"] == "3"
    with open(out / "runs.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 9
    printed = capsys.readouterr().out
    assert (
        re.search(r"^sync=async seed=2 +multirun/day/time/8$", printed, flags=re.M) and "| sync=backup | 3 |" in printed
    )
    assert json.loads((root / "0" / "summary.json").read_text()) == {"clock": "simulated"}  # runs left alone
    # --each --out elsewhere: each run's own report under it too, the run folders still untouched
    two = [str(root / "0"), str(root / "3")]
    assert main([*two, "--each", "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "table.md").is_file() and (tmp_path / "cmp" / "3" / "staleness_hist.png").is_file()
    assert json.loads((tmp_path / "cmp" / "0" / "summary.json").read_text())["clock"] == "simulated"
    assert json.loads((root / "0" / "summary.json").read_text()) == {"clock": "simulated"}
    assert "== sync=backup  ->  " in capsys.readouterr().out  # seed=0 is common to the two


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "trace.jsonl is empty: the run recorded no events"),
        ("{not json\n", "trace.jsonl is not a valid trace"),
        ('{"t": 0.0, "ev": "apply"}\n', "trace.jsonl is not a valid trace"),
    ],
)
def test_bad_or_empty_trace_is_one_line_and_status_2(tmp_path, capsys, content, expected):
    good = run_folder(tmp_path / "good", curve_trace([1.0], [0.5]), ["sync=bsp"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "trace.jsonl").write_text(content)
    assert main([str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"collsync-report: error: {bad / 'trace.jsonl'}") and expected in err
    assert err.count("\n") == 1
    assert json.loads((good / "summary.json").read_text()) == {"clock": "simulated"}  # nothing written first


def test_no_run_in_the_folder_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert (
        capsys.readouterr().err
        == f"collsync-report: error: no run folder (one holding trace.jsonl) in {tmp_path / 'empty'}\n"
    )


# --- --choose-backups ------------------------------------------------------------------------------------------------

WORKERS, ROUNDS = 8, 300


def simulate(policy, stragglers, seed: int) -> Trace:
    """The simulator's trace of a run with `policy` (the gradients are zeros: only the timing matters here)."""
    sim = Simulator(WORKERS, stragglers, seed)
    server = Server(torch.zeros(2), sgd(lr=0.1), policy, WORKERS, steps=ROUNDS, ema_decay=0.9, trace=sim.trace)
    sim.run(server, lambda params, worker, index: torch.zeros(2))
    return sim.trace


def predictions(text: str) -> dict[int, tuple[float, float, float]]:
    """b -> (round time, gradients/s, mean N-th arrival) from the printed table."""
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", text, flags=re.M)
    return {int(b): (float(r), float(g), float(k)) for b, n, r, g, k in rows}


@pytest.mark.parametrize(
    "stragglers", [gamma_homogeneous(), gamma_heterogeneous()], ids=["homogeneous", "heterogeneous"]
)
def test_choose_backups_predicts_the_round_time_of_each_b(tmp_path, capsys, stragglers):
    """Arrivals of a bsp run predict the mean round time of runs with b backup workers within 5% over 300 rounds.

    The same seed is the same cluster (the machines' mean speeds are drawn from it); the per-batch times the backup
    runs draw are consumed at other rates than in the bsp run, so this is a prediction, not a replay of the same
    numbers. Under homogeneous stragglers the mean N-th arrival (the estimate that ignores late batches finishing)
    is low by several percent at b = 4: the replay is what gets within 5%.
    """
    seed = 3
    run = run_folder(tmp_path / "bsp", simulate(bsp(), stragglers, seed), ["sync=bsp"])
    assert main(["--choose-backups", str(run)]) == 0
    text = capsys.readouterr().out
    predicted = predictions(text)
    assert sorted(predicted) == list(range(WORKERS))
    assert "from 300 measured rounds" in text and "(times in simulated s)" in text
    for b in (0, 1, 2, 4):
        trace = simulate(backup(b) if b else bsp(), stragglers, seed)
        applies = [e["t"] for e in trace.events if e["ev"] == "apply"]
        measured = applies[-1] / len(applies)
        round_s, rate, _ = predicted[b]
        assert round_s == pytest.approx(measured, rel=0.05), (b, round_s, measured)
        assert rate == pytest.approx((WORKERS - b) / round_s, rel=1e-3)
    best = max(predicted, key=lambda b: (predicted[b][1], -b))
    if best:
        assert f"recommended: sync=backup sync.backups={best} (wait for N={WORKERS - best} of {WORKERS})" in text
    else:  # batch times varying by 10% (homogeneous): dropping gradients costs more than the wait it saves
        assert f"recommended: sync=bsp (b = 0: wait for all {WORKERS};" in text
    assert text.count("<- recommended") == 1


def test_choose_backups_refuses_a_run_that_did_not_wait_for_all(tmp_path, capsys):
    run = run_folder(tmp_path / "b2", simulate(backup(2), gamma_homogeneous(), 0), ["sync=backup"])
    assert main(["--choose-backups", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"collsync-report: error: --choose-backups {run}: update 1")
    assert "measure arrivals with sync=bsp" in err
    assert main(["--choose-backups", str(run), str(run)]) == 2
    assert "takes one run folder, got 2 paths" in capsys.readouterr().err


def test_report_probes_every_folder_it_writes_before_writing(tmp_path, capsys):
    root = sweep(tmp_path / "sweep", syncs=("bsp",), seeds=(0, 1))
    blocker = tmp_path / "a-file"
    blocker.write_text("a regular file where a folder should be\n")
    # One run into --out under a file, several with --each: refused in one line, nothing written anywhere.
    for argv in ([str(root / "0"), "--out", str(blocker / "out")], [str(root), "--each", "--out", str(blocker)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and re.match(r"^collsync-report: error: the output folder '.*a-file.*' cannot be ", err)
        assert "[Errno 20] Not a directory" in err, err
    assert not (root / "report").exists() and not (root / "0" / "metrics.csv").exists()
    # A folder that can be written is left as it was: the probe's file is gone.
    assert main([str(root / "0"), "--out", str(tmp_path / "ok")]) == 0
    assert not [p for p in (tmp_path / "ok").iterdir() if p.name.startswith(".write-probe")]


def test_a_sweep_member_a_crash_left_unfinished_is_named_and_left_out(tmp_path, capsys):
    """Issue 36, item 11: a member killed while writing its run folder (a trace.jsonl that ends inside a line, is
    empty, or has no summary.json beside it: the trainer writes the trace first, the summary last) is named in one
    line and left out, the others are compared, and the exit status is 1; before, a cut trace refused the whole
    report and a missing summary made a group of its own ("clock unknown") without a word."""
    root = sweep(tmp_path / "sweep", syncs=("bsp", "async"), seeds=(0, 1))  # jobs 0-1 bsp, 2-3 async
    text = (root / "1" / "trace.jsonl").read_text()
    (root / "1" / "trace.jsonl").write_text(text[: text.index("\n", 200) + 30])  # cut inside a line
    (root / "3" / "summary.json").unlink()
    run_folder(root / "4", Trace(clock=lambda: 0.0), ["sync=ssp", "seed=0", "steps=3"])  # empty: killed at once
    assert main([str(root)]) == 1
    captured = capsys.readouterr()
    warned = captured.err.splitlines()
    lines = text[: text.index("\n", 200) + 30].count("\n") + 1
    assert warned == [
        f"collsync-report: warning: {root / '1'} (sync=bsp seed=1 steps=3) is unfinished: its trace.jsonl ends "
        f"inside line {lines} (the run was killed while writing its run folder); left out of the report",
        f"collsync-report: warning: {root / '3'} (sync=async seed=1 steps=3) is unfinished: it has a trace.jsonl "
        "but no summary.json (the run was killed while writing its run folder); left out of the report",
        f"collsync-report: warning: {root / '4'} (sync=ssp seed=0 steps=3) is unfinished: its trace.jsonl is empty "
        "(the run was killed while writing its run folder); left out of the report",
    ]
    with open(root / "report" / "runs.csv", newline="") as f:
        assert [r["label"] for r in csv.DictReader(f)] == ["sync=bsp", "sync=async"]
    # Named alone, the cut run is read as it is: its line named, exit status 2.
    assert main([str(root / "1")]) == 2
    assert f"line {lines} is not a JSON event (cut off" in capsys.readouterr().err
    for job in ("0", "2"):
        shutil.rmtree(root / job)
    assert main([str(root)]) == 2
    assert "no finished run to report: every one was cut short" in capsys.readouterr().err
