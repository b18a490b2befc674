"""`collsync-report`: re-render run folders, compare runs and sweeps, and choose backup workers from a run.

    collsync-report RUN                      re-render one run's summary and plots from its trace.jsonl
    collsync-report RUN RUN ... | SWEEP      the same for each run, plus a comparison (plots, table.md, table.csv)
    collsync-report --choose-backups RUN     predicted round time and gradients/s for every b (collsync.backups)

A sweep folder (`multirun/<date>/<time>`) is searched for run folders (those holding trace.jsonl), so the folder
itself, a shell glob over it (which also names multirun.yaml) or a few run folders all work. Runs are labelled by
the Hydra overrides that tell them apart (`sync=async seed=1`, from .hydra/overrides.yaml), never by the time
stamps in their folder names; runs whose overrides differ only in `seed=` form a group, reported as mean and spread.
Times are simulated seconds for the simulator and wall seconds for real runs; the two never share an axis or a
column without their unit.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collsync.metrics import CLOCKS, THRESHOLDS, format_summary, metrics_rows, summary, write_report
from collsync.trace import Trace

PROG = "collsync-report"
# What a runtime's Hydra target says about its clock; `auto` is the simulator or MPI depending on the launch, so a
# run's summary.json (`clock`, written by the run itself) is read first.
_CLOCK_OF_RUNTIME = {"sim": "simulated", "mpi": "wall", "allreduce": "wall", "partial": "wall"}


class ReportError(ValueError):
    """A problem with the user's input to `collsync-report`: printed as one line, exit status 2."""


@dataclass
class Run:
    """A run folder read back: its trace, the overrides it was launched with, and the clock of its times."""

    path: Path
    trace: Trace
    overrides: list[str] | None
    clock: str | None
    summary: dict[str, Any]
    label: str = ""
    group: str = ""


def _natural(path: Path) -> tuple[tuple[int, int | str], ...]:
    """Sort key: numbered job folders in numeric order (2 before 10), as Hydra numbered them, other names by name."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in path.parts)


def find_runs(paths: Sequence[Path]) -> list[Path]:
    """The run folders under `paths`, in natural order (job 2 before job 10, whatever order a shell glob gave): a
    path holding trace.jsonl is a run; another folder is searched (hidden folders such as .hydra and .submitit
    skipped); a plain file (multirun.yaml, named by a shell glob) is skipped. A named path that does not exist, a
    single folder with no run in it, or no run at all, is an error."""
    found: list[Path] = []

    def walk(folder: Path) -> None:
        if (folder / "trace.jsonl").is_file():
            found.append(folder)
            return
        for child in folder.iterdir():
            if child.is_dir() and not child.name.startswith("."):
                walk(child)

    for path in paths:
        if not path.exists():
            raise ReportError(f"{path}: no such file or folder")
        if path.is_dir():
            before = len(found)
            walk(path)
            if len(found) == before and len(paths) == 1:
                raise ReportError(f"no run folder (one holding trace.jsonl) in {path}")
    if not found:
        raise ReportError(f"no run folder (one holding trace.jsonl) in {' '.join(map(str, paths))}")
    unique = {p.resolve(): p for p in found}  # the same run named twice (a folder and its sweep) counts once
    return sorted(unique.values(), key=lambda p: _natural(p.resolve()))


def read_overrides(run: Path) -> list[str] | None:
    """The task overrides a run was launched with (.hydra/overrides.yaml), or None where the file is absent."""
    import yaml  # installed with hydra-core

    path = run / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    try:
        overrides = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ReportError(f"{path} is not readable YAML: {exc}".splitlines()[0]) from exc
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def run_clock(run: Path) -> str | None:
    """ "simulated" or "wall": the `clock` in the run's summary.json (written by the run, which knew), else what
    the runtime in .hydra/config.yaml implies (sim: simulated; mpi, allreduce, partial: wall); None when neither
    says (an older run with `runtime=auto`)."""
    try:
        old = json.loads((run / "summary.json").read_text())
        if isinstance(old, dict) and old.get("clock") in CLOCKS:
            return str(old["clock"])
    except (OSError, ValueError):
        pass
    try:
        import yaml

        config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
        target = str(config["runtime"]["_target_"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return _CLOCK_OF_RUNTIME.get(target.rsplit(".", 1)[-1])


def read_run(path: Path) -> Run:
    """Read a run folder; an unreadable or empty trace is a `ReportError` naming the file."""
    trace_path = path / "trace.jsonl"
    try:
        trace = Trace.read_jsonl(trace_path)
    except (OSError, ValueError) as exc:
        raise ReportError(f"{trace_path} is not a valid trace: {exc!r}") from exc
    if not trace.events:
        raise ReportError(f"{trace_path} is empty: the run recorded no events (did it stop before training?)")
    clock = run_clock(path)
    try:
        result = {**summary(trace, clock=clock), **_kept_summary_keys(path)}  # with the trainer's `incomplete`
    except (KeyError, TypeError, ValueError) as exc:
        raise ReportError(f"{trace_path} is not a valid trace: {exc!r}") from exc
    return Run(path, trace, read_overrides(path), clock, result)


def run_names(runs: Sequence[Path]) -> list[str]:
    """Distinct short names for run folders (where their reports go under --out): the folder name, or
    parent_name where two folders share a name."""
    names = [r.resolve().name for r in runs]
    clash = {n for n in names if names.count(n) > 1}
    return [f"{r.resolve().parent.name}_{n}" if n in clash else n for r, n in zip(runs, names, strict=True)]


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
    from collsync.plots import Curve, compare_accuracy

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


def choose_backups(path: Path) -> str:
    """The text `--choose-backups RUN` prints (see `collsync.backups`)."""
    from collsync.backups import NotFullRounds, format_predictions, predict, worker_arrivals

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
    run is read and checked before anything is written.
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
        runs = [read_run(p) for p in find_runs(args.paths)]
    except ReportError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    common = label_runs(runs)
    names = run_names([r.path for r in runs])
    for run, name in zip(runs, names, strict=True):
        if len(runs) == 1 or args.each:
            out = run.path if args.out is None else args.out if len(runs) == 1 else args.out / name
            write_report(run.trace, out, extra=_kept_summary_keys(run.path), clock=run.clock)
            print(f"== {run.label}  ->  {out}")
            print(format_summary(run.summary))
        else:  # the table below has the numbers; one line per run says which folder is which
            print(f"{run.label:<40} {run.path}")
    if len(runs) > 1:
        where = args.out or _default_out(args.paths, runs)
        paths = compare(runs, where, common)
        print(f"\n== comparison of {len(runs)} runs  ->  {where}")
        print(paths["table"].read_text(), end="")
    return 0


def _kept_summary_keys(run_dir: Path) -> dict[str, Any]:
    """Keys of an existing summary.json that `summary()` does not compute (e.g. the trainer's trace checks)."""
    try:
        old = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    fresh = summary([])
    return {k: v for k, v in old.items() if k not in fresh and k != "ema_note"} if isinstance(old, dict) else {}


if __name__ == "__main__":
    sys.exit(main())
