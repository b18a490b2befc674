"""A run folder's report files, written and read back: `write_report` (metrics.csv, summary.json and the figures,
for the trainer's run folder and `collsync-report`), and for `collsync-report` the run folders under a sweep
(`find_runs`), each one's trace, the overrides it was launched with and the clock of its times (`read_run`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # installed with hydra-core

from collsync.metrics import (
    CLOCKS,
    TraceLike,
    clock_of,
    events_of,
    gap_vs_delay,
    kth_gradient_times,
    metrics_rows,
    summary,
    write_csv,
)
from collsync.trace import Trace

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


def missing_runs(paths: Sequence[Path]) -> list[Path]:
    """The sweep members under `paths` that left no run: folders Hydra made for a job (holding .hydra/) with no
    trace.jsonl, because the member failed before training or was killed before it wrote its run folder. Left out
    of a comparison, they must still be named: a table of the members that worked reads as the whole sweep."""
    found: list[Path] = []

    def walk(folder: Path) -> None:
        if (folder / "trace.jsonl").is_file():
            return
        if (folder / ".hydra").is_dir():
            found.append(folder)
        for child in folder.iterdir():
            if child.is_dir() and not child.name.startswith("."):
                walk(child)

    for path in paths:
        if path.is_dir():
            walk(path)
    unique = {p.resolve(): p for p in found}
    return sorted(unique.values(), key=lambda p: _natural(p.resolve()))


def cut_short(run: Path) -> str | None:
    """Why a sweep member's run folder was left unfinished by a crash, or None. The trainer writes trace.jsonl,
    then params.pt, then summary.json (`rundir.write_run`), so a member killed meanwhile leaves a trace that is empty
    or ends inside a line, or one with no summary.json beside it. Only folders Hydra made for a job (holding
    .hydra/) count: a comparison leaves such a member out and names it, as it names a member that left no run."""
    trace = run / "trace.jsonl"
    if not (run / ".hydra").is_dir() or not trace.is_file():
        return None
    try:
        with trace.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - 1, 0))
            last = f.read(1)
    except OSError:
        return None  # read_run names it
    if not size:
        return "its trace.jsonl is empty"
    if last != b"\n":
        lines = trace.read_bytes().count(b"\n")
        return f"its trace.jsonl ends inside line {lines + 1}"
    if not (run / "summary.json").is_file():
        return "it has a trace.jsonl but no summary.json"
    return None


def read_overrides(run: Path) -> list[str] | None:
    """The task overrides a run was launched with (.hydra/overrides.yaml), or None where the file is absent."""
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
    except UnicodeDecodeError:  # its message would quote the binary
        raise ReportError(f"{trace_path} is binary, not a trace (JSON lines of text)") from None
    except OSError as exc:
        raise ReportError(f"{trace_path} cannot be read: {exc!r}") from exc
    except ValueError as exc:
        raise ReportError(f"{trace_path} is not a valid trace: {exc}") from exc
    if not trace.events:
        raise ReportError(f"{trace_path} is empty: the run recorded no events (did it stop before training?)")
    clock = run_clock(path)
    try:
        result = {**summary(trace, clock=clock), **kept_summary_keys(path)}  # with the trainer's `incomplete`
    except (KeyError, TypeError, ValueError) as exc:
        raise ReportError(f"{trace_path} is not a valid trace: {exc!r}") from exc
    return Run(path, trace, read_overrides(path), clock, result)


def run_names(runs: Sequence[Path]) -> list[str]:
    """Distinct short names for run folders (where their reports go under --out): the folder name, or
    parent_name where two folders share a name."""
    names = [r.resolve().name for r in runs]
    clash = {n for n in names if names.count(n) > 1}
    return [f"{r.resolve().parent.name}_{n}" if n in clash else n for r, n in zip(runs, names, strict=True)]


def kept_summary_keys(run_dir: Path) -> dict[str, Any]:
    """Keys of an existing summary.json that `summary()` does not compute (e.g. the trainer's trace checks)."""
    try:
        old = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    fresh = summary([])
    return {k: v for k, v in old.items() if k not in fresh and k != "ema_note"} if isinstance(old, dict) else {}


def write_report(
    trace: TraceLike,
    out_dir: str | Path,
    extra: dict[str, Any] | None = None,
    clock: str | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    """Write metrics.csv, summary.json (with `extra` merged in) and the figures into `out_dir`; return their paths,
    keyed by file stem. kth_gradient_cdf.png only for round policies, gap_vs_delay.png only with Gap data; no
    figures with `plots=False` (the config's `plots`: matplotlib's import and four figures cost about 3 s a run,
    which a test suite of hundreds of short runs does not need; `collsync-report` draws them later).

    `clock` ("simulated" or "wall") is what the trace's times are in; by default the trace's own `clock_kind`.
    It goes into summary.json as `clock`, which is how a later report tells simulated from wall seconds: the
    config cannot always say (`runtime=auto` is the simulator or MPI depending on how the run was launched).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    events = events_of(trace)
    clock = clock or clock_of(trace)
    rows = metrics_rows(events)
    paths = {"metrics": write_csv(rows, out / "metrics.csv"), "summary": out / "summary.json"}
    result = {**summary(events, clock=clock), **(extra or {})}
    paths["summary"].write_text(json.dumps(result, indent=2, default=str) + "\n")
    if not plots:
        return paths
    from collsync import plots as figures  # matplotlib is imported only when figures are drawn

    paths["accuracy_vs_time"] = figures.plot_accuracy(rows, out / "accuracy_vs_time.png", x="time", clock=clock)
    paths["accuracy_vs_steps"] = figures.plot_accuracy(rows, out / "accuracy_vs_steps.png", x="steps")
    paths["staleness_hist"] = figures.plot_staleness(events, out / "staleness_hist.png")
    if kth_gradient_times(events):
        paths["kth_gradient_cdf"] = figures.plot_kth_cdf(events, out / "kth_gradient_cdf.png", clock=clock)
    if gap_vs_delay(events):
        paths["gap_vs_delay"] = figures.plot_gap_vs_delay(events, out / "gap_vs_delay.png")
    return paths
