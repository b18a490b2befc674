"""`collsync-report`: re-render run folders, compare runs and sweeps, and choose backup workers from a run.

    collsync-report RUN                      re-render one run's summary and plots from its trace.jsonl
    collsync-report RUN RUN ... | SWEEP      the same for each run, plus a comparison (plots, table.md, table.csv)
    collsync-report --choose-backups RUN     predicted round time and gradients/s for every b (collsync.backups)

A sweep folder (`multirun/<date>/<time>`) is searched for run folders (those holding trace.jsonl), so the folder
itself, a shell glob over it (which also names multirun.yaml) or a few run folders all work. Runs are labelled by
the Hydra overrides that tell them apart (`sync=async seed=1`, from .hydra/overrides.yaml), never by the time
stamps in their folder names; runs whose overrides differ only in `seed=` form a group, reported as mean and spread
(run folders read back: `collsync.runfiles`). Times are simulated seconds for the simulator and wall seconds for real
runs; the two never share an axis or a column without their unit.

A sweep member that left no run (a folder Hydra made for the job, with no trace.jsonl: it failed on a bad input or
was killed before writing its run folder), or an unfinished one (killed while writing it: a trace.jsonl that is
empty or ends inside a line, or no summary.json beside it; `runfiles.cut_short`), is named on stderr, one line each,
after the report of the others, and the exit status is then 1 (0 when every member is in the report). A single run
named alone is read as it is: a trace cut off there is an error naming its line (exit status 2).

Every folder the command will write is probed first (`collsync.rundir.probe`, as `collsync-train` probes its run
folder): one that is read-only, full or under a regular file stops it with one line and exit status 2, before
anything is written.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from collsync.metrics import THRESHOLDS, format_summary, metrics_rows
from collsync.rundir import RunFolderError, describe, probe
from collsync.runfiles import (
    ReportError,
    Run,
    cut_short,
    find_runs,
    kept_summary_keys,
    missing_runs,
    read_overrides,
    read_run,
    run_names,
    write_report,
)

PROG = "collsync-report"


def _is_seed(override: str) -> bool:
    return override.split("=", 1)[0].lstrip("+~") == "seed"


def label_runs(runs: Sequence[Run]) -> str:
    """Set each run's `label` and `group` from its overrides; return the overrides every run shares.

    The label is the overrides that differ between the runs (`sync=async seed=1`; all of them for a single run,
    "defaults" for none); a run without .hydra/overrides.yaml is labelled by its folder name. The group is the
    label without `seed=...`, so runs that differ only in their seed (and share a clock) are averaged together.
    Runs alike but for their clock get " [simulated]" / " [wall]"; labels that would still clash " #1", " #2", ...
    """
    known = [r.overrides for r in runs if r.overrides is not None]
    common = set(known[0]).intersection(*known[1:]) if len(known) > 1 and len(known) == len(runs) else set()
    names = run_names([r.path for r in runs])
    for run, name in zip(runs, names, strict=True):
        if run.overrides is None:
            run.label = run.group = name
            continue
        own = [o for o in run.overrides if o not in common] or run.overrides
        run.label = " ".join(own) or "defaults"
        run.group = (
            " ".join(o for o in own if not _is_seed(o))
            or " ".join(o for o in run.overrides if not _is_seed(o))
            or "defaults"
        )
    clocks = {label: {r.clock for r in runs if r.label == label} for label in {r.label for r in runs}}
    for run in runs:
        if len(clocks[run.label]) > 1:  # the same overrides launched in the simulator and under MPI
            run.label += f" [{run.clock or 'clock unknown'}]"
    for group in {r.group for r in runs}:
        if len({r.clock for r in runs if r.group == group}) > 1:  # averaging simulated with wall seconds: never
            for run in runs:
                if run.group == group:
                    run.group += f" [{run.clock or 'clock unknown'}]"
    counts: dict[str, int] = {}
    clash = {r.label for r in runs if sum(1 for o in runs if o.label == r.label) > 1}
    for run in runs:
        if run.label in clash:  # the same overrides twice: no seed tells them apart, so no group either
            counts[run.label] = counts.get(run.label, 0) + 1
            run.label = run.group = f"{run.label} #{counts[run.label]}"
    return " ".join(o for o in (known[0] if known else []) if o in common)


def _stats(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """Mean and sample standard deviation of the values that are not None (None where fewer than 1 / 2), and how
    many there were."""
    got = [float(v) for v in values if v is not None]
    mean = statistics.fmean(got) if got else None
    return mean, statistics.stdev(got) if len(got) > 1 else None, len(got)


def group_table(runs: Sequence[Run], thresholds: Sequence[float] = THRESHOLDS) -> list[dict[str, Any]]:
    """One row per group (runs differing only in seed), in order of first appearance: `group`, `clock`, `seeds`,
    `stopped_early` (runs whose summary.json is marked incomplete), then `<metric>_mean`, `<metric>_std` for
    time_to_<a> (and `time_to_<a>_reached`, how many seeds got there), final_acc, best_acc, updates_per_s, dropped,
    staleness_mean."""
    rows = []
    for group in dict.fromkeys(r.group for r in runs):
        members = [r for r in runs if r.group == group]
        sums = [r.summary for r in members]
        row: dict[str, Any] = {"group": group, "clock": members[0].clock or "", "seeds": len(members)}
        row["stopped_early"] = sum(1 for s in sums if s.get("incomplete"))  # deadline, divergence guard, signal
        for a in thresholds:
            mean, std, reached = _stats([s["time_to_acc"][a] for s in sums])
            row |= {f"time_to_{a:g}_mean": mean, f"time_to_{a:g}_std": std, f"time_to_{a:g}_reached": reached}
        for key in ("final_acc", "best_acc", "updates_per_s", "dropped", "staleness_mean"):
            mean, std, _ = _stats([s[key] for s in sums])
            row |= {f"{key}_mean": mean, f"{key}_std": std}
        rows.append(row)
    return rows


def run_rows(runs: Sequence[Run], thresholds: Sequence[float] = THRESHOLDS) -> list[dict[str, Any]]:
    """One row per run (the numbers behind `group_table`): label, group, clock, folder, then the same metrics."""
    rows = []
    for run in runs:
        s = run.summary
        row: dict[str, Any] = {
            "label": run.label,
            "group": run.group,
            "clock": run.clock or "",
            "folder": str(run.path),
        }
        row |= {f"time_to_{a:g}": s["time_to_acc"][a] for a in thresholds}
        row |= {k: s[k] for k in ("final_acc", "best_acc", "updates_per_s", "dropped", "staleness_mean")}
        rows.append(row)
    return rows


def _cell(mean: float | None, std: float | None, spec: str) -> str:
    if mean is None:
        return "-"
    return f"{mean:{spec}} ± {std:{spec}}" if std is not None else f"{mean:{spec}}"


def format_table(rows: Sequence[dict[str, Any]], thresholds: Sequence[float] = THRESHOLDS) -> str:
    """`group_table` as a markdown table, mean ± standard deviation over seeds, with a note on how to read it."""
    clocks = {r["clock"] for r in rows}
    unit = f"{next(iter(clocks))} s" if len(clocks) == 1 and "" not in clocks else "s"
    head = ["runs", "seeds", *(f"time to {a:g} ({unit})" for a in thresholds)]
    head += ["final acc", "best acc", "updates/s", "dropped", "mean staleness"]
    if len(clocks) > 1:
        head.insert(1, "clock")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        stopped = r.get("stopped_early", 0)
        cells = [r["group"] + (f" ({stopped} of {r['seeds']} stopped early)" if stopped else ""), str(r["seeds"])]
        if len(clocks) > 1:
            cells.insert(1, r["clock"] or "unknown")
        for a in thresholds:
            reached = r[f"time_to_{a:g}_reached"]
            cell = _cell(r[f"time_to_{a:g}_mean"], r[f"time_to_{a:g}_std"], ".2f") if reached else "never"
            cells.append(cell + (f" ({reached} of {r['seeds']})" if 0 < reached < r["seeds"] else ""))
        cells += [
            _cell(r["final_acc_mean"], r["final_acc_std"], ".3f"),
            _cell(r["best_acc_mean"], r["best_acc_std"], ".3f"),
        ]
        cells += [
            _cell(r["updates_per_s_mean"], r["updates_per_s_std"], ".2f"),
            _cell(r["dropped_mean"], r["dropped_std"], ".1f"),
        ]
        cells.append(_cell(r["staleness_mean_mean"], r["staleness_mean_std"], ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Mean ± standard deviation over the seeds of each row. Time to a: the first evaluation with test accuracy "
        ">= a (of theta); seeds that never got there are left out of the mean and counted as (reached of seeds). "
        "Dropped: gradients dropped per run; mean staleness over applied gradients. A run that stopped early "
        "(its summary.json says why under `incomplete`) is counted in its row as it ended.",
    ]
    return "\n".join(lines)


def _write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return path


def compare(runs: Sequence[Run], out: Path, common: str = "") -> dict[str, Path]:
    """Write the comparison of labelled `runs` into `out`: accuracy_vs_{time,steps}.png, table.md and
    table.csv (one row per group), runs.csv (one per run); return their paths by stem."""
    from collsync.plots import Curve, compare_accuracy  # matplotlib is imported only when figures are drawn

    out.mkdir(parents=True, exist_ok=True)
    curves = [Curve(r.label, r.group, r.clock, metrics_rows(r.trace)) for r in runs]
    title = f"all runs: {common}" if common else ""
    paths = {
        f"accuracy_vs_{x}": compare_accuracy(curves, out / f"accuracy_vs_{x}.png", x, title) for x in ("time", "steps")
    }
    table = group_table(runs)
    header = f"# {len(runs)} runs" + (f" ({common})" if common else "") + "\n\n"
    (out / "table.md").write_text(header + format_table(table) + "\n")
    paths |= {"table": out / "table.md", "table_csv": _write_csv(table, out / "table.csv")}
    paths["runs_csv"] = _write_csv(run_rows(runs), out / "runs.csv")
    return paths


def _default_out(paths: Sequence[Path], runs: Sequence[Run]) -> Path:
    """Where the comparison goes without --out: report/ inside the one sweep folder named, else inside the runs'
    common parent folder (never the current folder itself)."""
    folders = [p for p in paths if p.is_dir()]
    if len(folders) == 1 and not (folders[0] / "trace.jsonl").is_file():
        return folders[0] / "report"
    common = Path(os.path.commonpath([r.path.resolve() for r in runs]))
    return Path(os.path.relpath(common / "report")) if common.is_relative_to(Path.cwd()) else common / "report"


def _outputs(args: argparse.Namespace, runs: Sequence[Run]) -> tuple[list[Path | None], Path | None]:
    """Where each run's own report goes (None: not re-rendered) and where the comparison goes (None: one run)."""
    several = len(runs) > 1
    if several and not args.each:
        each: list[Path | None] = [None] * len(runs)
    elif args.out is None:
        each = [r.path for r in runs]
    else:
        each = [args.out if not several else args.out / n for n in run_names([r.path for r in runs])]
    return each, (args.out or _default_out(args.paths, runs)) if several else None


def _probe_outputs(folders: Sequence[Path | None]) -> None:
    """`rundir.probe` each folder the command will write (created if needed): ReportError naming the first one that
    cannot be written, with the OS error."""
    for folder in dict.fromkeys(f for f in folders if f is not None):
        try:
            probe(folder)
        except RunFolderError as exc:
            cause = exc.__cause__
            why = describe(cause) if isinstance(cause, OSError) else str(exc)
            raise ReportError(f"the output folder {str(folder)!r} cannot be written: {why}") from exc


def choose_backups(path: Path) -> str:
    """The text `--choose-backups RUN` prints (see `collsync.backups`)."""
    from collsync.backups import NotFullRounds, format_predictions, predict, worker_arrivals

    if not (path / "trace.jsonl").is_file():  # a sweep folder, or none: find_runs names a path without runs
        runs = find_runs([path])
        raise ReportError(f"--choose-backups {path}: a sweep of {len(runs)} run(s): name one run, e.g. {runs[0]}")
    run = read_run(path)
    try:
        predictions = predict(run.trace)
        rounds = min(len(t) for t in worker_arrivals(run.trace).values())
    except NotFullRounds as exc:
        raise ReportError(f"--choose-backups {path}: {exc}") from exc
    return format_predictions(predictions, run.clock, rounds)


def main(argv: list[str] | None = None) -> int:
    """`collsync-report PATH [PATH ...] [--out DIR] | --choose-backups RUN`: see the module docstring.

    One run: its report (summary.json, metrics.csv, figures) is re-rendered from its trace.jsonl, in place or into
    --out. Several: each run's summary is printed and the comparison goes into --out, by default report/ inside the
    sweep folder (or the runs' common parent); their own reports stay as the trainer wrote them unless --each
    re-renders them too (in place, or into DIR/<run name>/), which costs a few seconds of plotting per run. Every
    run is read and checked, and every folder to be written probed, before anything is written.
    """
    parser = argparse.ArgumentParser(prog=PROG, description="Re-render run reports; compare runs and sweeps.")
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="run folder(s) or a sweep folder")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="where to write (see above)")
    parser.add_argument(
        "--each",
        action="store_true",
        help="with several runs, also re-render each run's own report (in place, or under DIR/<run name>/)",
    )
    parser.add_argument(
        "--choose-backups",
        action="store_true",
        help="from one run whose rounds waited for every worker (sync=bsp), predict round time and gradients/s "
        "for each number of backup workers b and recommend one",
    )
    args = parser.parse_args(argv)
    try:
        if args.choose_backups:
            if len(args.paths) != 1:
                raise ReportError(f"--choose-backups takes one run folder, got {len(args.paths)} paths")
            print(choose_backups(args.paths[0]))
            return 0
        runs, cut = _read_runs(find_runs(args.paths))
        common = label_runs(runs)
        each, where = _outputs(args, runs)
        _probe_outputs([*each, where])
    except ReportError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for run, out in zip(runs, each, strict=True):
        if out is not None:
            write_report(run.trace, out, extra=kept_summary_keys(run.path), clock=run.clock)
            print(f"== {run.label}  ->  {out}")
            print(format_summary(run.summary))
        else:  # the table below has the numbers; one line per run says which folder is which
            print(f"{run.label:<40} {run.path}")
    if where is not None:
        paths = compare(runs, where, common)
        print(f"\n== comparison of {len(runs)} runs  ->  {where}")
        print(paths["table"].read_text(), end="")
    return _name_missing(args.paths, cut)


def _read_runs(found: Sequence[Path]) -> tuple[list[Run], dict[Path, str]]:
    """The runs to report, and the sweep members a crash left unfinished (`runfiles.cut_short`), with why: set aside
    in a comparison, so that the others are still reported (a single run named alone is read, and refused, as is)."""
    cut = {p: why for p in found if len(found) > 1 and (why := cut_short(p)) is not None}
    if cut and len(cut) == len(found):
        first = next(iter(cut.items()))
        raise ReportError(f"no finished run to report: every one was cut short ({first[0]}: {first[1]})")
    return [read_run(p) for p in found if p not in cut], cut


def _name_missing(paths: Sequence[Path], cut: dict[Path, str]) -> int:
    """Name each sweep member that left no run or an unfinished one (one line each on stderr) and return the exit
    status: 1 when one did (the report of the others is written all the same), else 0."""
    missing = missing_runs(paths)
    for folder in missing:
        print(
            f"{PROG}: warning: {folder} ({_said(folder)}) has no trace.jsonl: the run failed or was killed before "
            f"writing its run folder (its collsync.log says why); left out of the report",
            file=sys.stderr,
        )
    for folder, why in cut.items():
        print(
            f"{PROG}: warning: {folder} ({_said(folder)}) is unfinished: {why} (the run was killed while writing "
            "its run folder); left out of the report",
            file=sys.stderr,
        )
    return 1 if missing or cut else 0


def _said(folder: Path) -> str:
    """A sweep member as its warning names it: by the overrides that made it."""
    return " ".join(read_overrides(folder) or []) or "no overrides"


if __name__ == "__main__":
    sys.exit(main())
