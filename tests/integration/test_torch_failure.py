"""A rank whose script raises ends the whole job within seconds, at the default deadline (600 s), in every mode:
one line names the rank and its exception after the traceback, and the job exits 1 (`collsync.ending`). Before,
the other ranks waited for it in their next collective, and the failing rank's own exit-time `shutdown()` waited
for them, until the deadline: a short deadline hid the hang, so these runs keep the default.

The bound each run is given (`timeout`) is only a guard against that hang: ten times less than the deadline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.hits import MPIEXEC, OPENMPI, OPENMPI_ENV

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)")

SCRIPT = Path(__file__).parents[1] / "scripts" / "torch_raise.py"
GUARD_S = 60  # a tenth of the default deadline: a run still going then hangs as before


def _run(head: list[str], python: str, sync: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    args = [*head, "-n", "4", python, *([] if sync == "bsp" else ["-m", "mpi4py"]), str(SCRIPT), sync, "1", "5"]
    return subprocess.run(args, capture_output=True, text=True, timeout=GUARD_S, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("sync", ["bsp", "backup", "async", "ssp", "psp", "specsync"])
def test_an_exception_on_one_rank_ends_the_job(sync):
    """Worker 1 raises at step 5 of 400 (bsp without `python -m mpi4py`, the others with it); every mode ends."""
    proc = _run([str(MPIEXEC)], sys.executable, sync)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RuntimeError: worker 1 fails at step 5" in proc.stderr  # the traceback, as Python shows it
    line = next((x for x in proc.stderr.splitlines() if "ending the job" in x), "")
    assert line.startswith("collsync: worker 1 (rank ") and "RuntimeError: worker 1 fails at step 5" in line, line


@pytest.mark.parametrize(
    ("sync", "how", "mpi4py"),
    [("bsp", "exit", False), ("bsp", "raise", True), ("backup", "exit", True), ("async", "exit", True)],
)
def test_a_nonzero_sys_exit_on_one_rank_ends_the_job_with_its_status(sync, how, mpi4py):
    """Worker 1 calls `sys.exit(3)` (or, under `python -m mpi4py`, whose runner sees it, `raise SystemExit(3)`) at
    step 5 of 400: the job ends with status 3 and one line naming the rank, at the default deadline (before, the
    exiting rank's `shutdown` waited up to the deadline for the others, waiting in a collective for it)."""
    runner = ["-m", "mpi4py"] if mpi4py else []
    args = [str(MPIEXEC), "-n", "4", sys.executable, *runner, str(SCRIPT), sync, "1", "5", how]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=GUARD_S)
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = next((x for x in proc.stderr.splitlines() if "ending the job" in x), "")
    assert line.startswith("collsync: worker 1 (rank ") and "exited with status 3 (SystemExit(3))" in line, line


@pytest.mark.skipif(not (OPENMPI / "mpirun").exists(), reason="no .venv-openmpi (bash scripts/setup_openmpi.sh)")
def test_an_exception_on_one_rank_ends_the_job_under_open_mpi():
    head = [str(OPENMPI / "mpirun"), "--oversubscribe"]
    proc = _run(head, str(OPENMPI / "python"), "bsp", OPENMPI_ENV)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert any(x.startswith("collsync: worker 1 (rank 1 of 4") for x in proc.stderr.splitlines()), proc.stderr[-3000:]


def test_without_the_failure_every_worker_finishes():
    """The script itself trains to its end (so the runs above end because of the exception, not of the script)."""
    args = [str(MPIEXEC), "-n", "2", sys.executable, str(SCRIPT), "bsp", "-1"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The launcher may interleave two ranks' lines ("done 1done 0\n\n"): match the words, not the lines.
    assert sorted(re.findall(r"done \d", proc.stdout)) == ["done 0", "done 1"], proc.stdout
