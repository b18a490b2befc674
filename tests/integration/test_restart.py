"""bsp and runtime=allreduce go on through a lost rank by a supervised restart (`collsync-run`): a rank killed
(SIGKILL: MPICH's mpiexec then ends the whole job) or stopped (SIGSTOP: the run stops after `sync.deadline` naming
it) mid-run; the supervisor relaunches on the ranks left from the last checkpoint, the run finishes all its steps,
its summary lists the restart, and no step is trained twice beyond the checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration import hits
from tests.integration.test_mpi_cli import MPIEXEC

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks' processes through /proc"),
]

STEPS = 600
# A killed rank ends the job at once (MPICH), whatever the deadline; a long one keeps the end of the restarted run
# (rank 0 writes the run folder while the others wait at shutdown, bounded by it) clear of a loaded machine.
KILLED_DEADLINE = 30


def _restarted(tmp_path: Path, ranks: int, overrides: list[str], hit: int, sig: signal.Signals) -> tuple[dict, str]:
    """Run under the supervisor; once the first checkpoint is written, send `sig` to rank `hit`. Returns the final
    summary and the supervisor's stderr."""
    run = tmp_path / "run"
    job = [sys.executable, "-m", "mpi4py", "-m", "collsync.cli", f"hydra.run.dir={run}", "progress=false"]
    job += [f"steps={STEPS}", "checkpoint.every=50", "checkpoint.seconds=null", "optimizer=sgd", *overrides]
    args = [sys.executable, "-m", "collsync.supervise", "-n", str(ranks), "--max-restarts", "1", "--", *job]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    with hits.ended(proc) as pids:
        end = time.monotonic() + 180
        while not (run / "checkpoint.pt").exists():
            assert proc.poll() is None and time.monotonic() < end, proc.communicate(timeout=60)[1][-3000:]
            time.sleep(0.02)
        pids += hits.rank_pids(f"hydra.run.dir={run}", hit)
        assert pids, f"rank {hit} not found"
        for pid in pids:
            os.kill(pid, sig)
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads((run / "summary.json").read_text()), err


def _check_one_restart(tmp_path: Path, summary: dict, err: str, ranks: int, why: str) -> None:
    """One restart on `ranks` ranks, said in one line; every step trained once, the resumed part from the
    checkpoint's step on."""
    assert "incomplete" not in summary and summary["updates"] == STEPS
    (restart,) = summary["restarts"]
    assert (restart["attempt"], restart["ranks"], restart["was"]) == (2, ranks, ranks + 1)
    assert why in restart["why"]
    lines = [line for line in err.splitlines() if line.startswith("collsync-run: ")]
    assert lines[0].startswith(f"collsync-run: attempt 2 of 2: {why}") and f"on {ranks} rank(s)" in lines[0], lines
    assert lines[-1] == f"collsync-run: finished after 1 restart(s), on {ranks} rank(s) (exit 0)", lines
    events = [json.loads(line) for line in (tmp_path / "run" / "trace.jsonl").open()]
    applies = [e["version"] for e in events if e["ev"] == "apply"]
    assert applies == list(range(1, STEPS + 1))  # no step twice, none missing
    at = next(i for i, e in enumerate(events) if e["ev"] == "resume")
    step = events[at]["version"]
    assert step == restart["from_step"] and step % 50 == 0 and 0 < step < STEPS
    first = next(e["version"] for e in events[at:] if e["ev"] == "apply")
    assert first == step + 1  # the restarted run's first update is the one after the checkpoint's
    (world,) = [e for e in events if e["ev"] == "world"]
    assert world["version"] == step
    assert summary["trace_checks"]["updates"] == STEPS


def test_bsp_on_servers_goes_on_through_a_killed_worker(tmp_path: Path) -> None:
    """1 server + 3 workers; worker 1 (rank 2) killed: MPICH ends the job without naming it, so n - 1."""
    summary, err = _restarted(tmp_path, 4, ["sync=bsp", f"sync.deadline={KILLED_DEADLINE}"], 2, signal.SIGKILL)
    _check_one_restart(tmp_path, summary, err, 3, "lost one rank (not named)")
    world = next(json.loads(line) for line in (tmp_path / "run" / "trace.jsonl").open() if '"world"' in line)
    assert (world["was"], world["workers"]) == (3, 2)


def test_bsp_on_servers_goes_on_through_a_stopped_worker_named_in_the_summary(tmp_path: Path) -> None:
    """Worker 1 (rank 2) stopped: the server stops the run after the deadline naming rank 2 (summary
    `incomplete`), and the supervisor takes exactly that rank off. (The server names every worker missing from the
    round: a deadline of a few seconds on a loaded machine could name a slow one too.)"""
    summary, err = _restarted(tmp_path, 4, ["sync=bsp", "sync.deadline=8"], 2, signal.SIGSTOP)
    _check_one_restart(tmp_path, summary, err, 3, "lost rank 2")


def test_allreduce_goes_on_through_a_killed_rank(tmp_path: Path) -> None:
    overrides = ["runtime=allreduce", "sync=bsp", f"sync.deadline={KILLED_DEADLINE}"]
    summary, err = _restarted(tmp_path, 3, overrides, 2, signal.SIGKILL)
    _check_one_restart(tmp_path, summary, err, 2, "lost one rank (not named)")
    world = next(json.loads(line) for line in (tmp_path / "run" / "trace.jsonl").open() if '"world"' in line)
    assert (world["was"], world["workers"]) == (3, 2)
