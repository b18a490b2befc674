"""A rank lost at start-up, at the window set-up, mid-run or at the end of a `collsync.torch` script
(tests/scripts/lost_rank.py, which stops one rank with SIGSTOP at the chosen point): the job ends by itself within
the deadline plus a bounded grace, with exit status 2 and one line naming the rank that did not arrive and its
host, and no traceback."""

from __future__ import annotations

import os
import signal
import socket
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
]

SCRIPT = Path(__file__).parents[1] / "scripts" / "lost_rank.py"
# The script's deadline is 3 s; rank 0 then collects the roll call for up to 3 s more and aborts after 1 s: what is
# left is for a loaded machine (4 ranks on 2 cores with other jobs beside them).
BOUND_S = 30.0
HOST = socket.gethostname()


def _stop_and_end(tmp_path: Path, where: str, sync: str) -> tuple[int, str, float]:
    """Launch 3 ranks with rank 2 stopping itself at `where`; return (exit status, stderr, seconds from the stop to
    the end of the job). The stopped rank is continued and killed at the end, whatever happened."""
    stopped = tmp_path / "stopped"
    args = [str(MPIEXEC), "-n", "3", sys.executable, str(SCRIPT), where, sync, "2", str(tmp_path)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        end = time.monotonic() + 180
        while not stopped.exists() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
        assert stopped.exists(), proc.communicate(timeout=60)[1][-2000:]
        hit = time.monotonic()
        pid = int(stopped.read_text() or 0) or None
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err, time.monotonic() - hit
    finally:
        if pid is not None:
            hits.end([pid])
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize(
    ("where", "sync", "says"),
    [
        ("init", "bsp", "start-up: rank(s) 2 of 3 did not arrive within deadline=3s"),
        ("windows", "backup", "partial allreduce: the window set-up did not complete within deadline=3s"),
        ("step", "bsp", "the gradient allreduce did not complete within deadline=3s"),
        ("end", "bsp", "shutdown: not every rank reached shutdown within 3s"),
    ],
    ids=["before-init", "before-windows", "bsp-mid-run", "at-shutdown"],
)
def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path, where, sync, says):
    code, err, took = _stop_and_end(tmp_path, where, sync)
    assert code == 2, (code, err[-2000:])
    assert took < BOUND_S, (took, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    # Rank 0 reports and aborts; another rank reports only if the abort has not reached it 3 s later (load).
    lines = [line for line in err.splitlines() if line.startswith("collsync: ")]
    assert lines and all(says in line for line in lines), err[-2000:]
    named = "arrived: ranks 0-1" if where == "init" else f"rank 2 on {HOST} did not arrive"
    assert named in lines[0], lines[0]


def test_sigterm_while_start_up_waits_for_a_lost_rank_ends_the_job_at_once(tmp_path):
    """Rank 2 stopped before `init()`, a 60 s deadline, and SIGTERM to the others (as `timeout` or Slurm sends it):
    they are waiting in the start-up exchange, which looks at the request and ends each at once with 143."""
    stopped = tmp_path / "stopped"
    args = [str(MPIEXEC), "-n", "3", sys.executable, str(SCRIPT), "init", "bsp", "2", str(tmp_path), "signals"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        end = time.monotonic() + 180
        ready = [tmp_path / f"pid-{r}" for r in range(3)]
        while not (stopped.exists() and all(p.exists() for p in ready)) and time.monotonic() < end:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.05)
        time.sleep(1.0)  # the others are inside the start-up exchange by now (it waits up to 60 s)
        pids = [int(p.read_text()) for p in ready]
        hit = time.monotonic()
        for pid in pids[:2]:
            os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - hit
    finally:
        hits.end(pids[2:])
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # Both live ranks end by the SIGTERM (each says so, below). The launcher then kills the stopped rank 2 with
    # SIGKILL, and MPICH's mpiexec reports whichever status it collected first: 143, or that kill's 9 (1 run in
    # about 7 here). Which one is the launcher's, not collsync's.
    assert proc.returncode in (128 + signal.SIGTERM, signal.SIGKILL), (proc.returncode, err[-2000:])
    assert took < 20, (took, err[-2000:])
    assert err.count("collsync: stopped by SIGTERM during start-up") == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
