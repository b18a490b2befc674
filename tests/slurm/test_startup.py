"""A rank that never starts, under `srun --mpi=pmi2`: the others wait in MPI_Init (PMI-2's fence) until the start-up
watchdog ends them at `sync.deadline` (collsync/runtime/startup.py), each with one line naming MPI's start-up, the
rank count srun announced and the host; or MPICH's MPI_Init fails on them instead, and each says it ended inside
MPI's start-up. A plain `srun` keeps a step whose tasks exited for as long as the stopped
one lives (the allocation would be billed until its time limit): the watchdog cancels the step then. With
`--kill-on-bad-exit` srun ends the step itself at the first exit. Rank 2 stops itself (SIGSTOP) through the test
hook before it loads anything of collsync's start-up."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collsync.runtime.startup import STALL_ENV, STALL_PID_ENV

pytestmark = pytest.mark.usefixtures("cluster")

PY = sys.executable
DEADLINE = 10
# The bound: the deadline plus 30 s (4 ranks starting on the 2-CPU node included).
BOUND_S = DEADLINE + 30
SAYS = f"start-up: MPI's start-up (MPI_Init) did not complete within deadline={DEADLINE}s"
# Under srun's PMI-2, MPICH's MPI_Init on the ranks that came may also fail ("Out of memory" in its shared-memory
# bootstrap) rather than wait for the stopped one: each such rank's watchdog then cancels the step, saying this.
DIED = "start-up: this rank ended inside MPI's start-up"


def _end(pid_file: Path) -> None:
    """Continue and kill the stopped rank if Slurm left it (it should not)."""
    if pid_file.exists():
        for sig in ("CONT", "KILL"):
            subprocess.run(["kill", f"-{sig}", pid_file.read_text()], capture_output=True)


@pytest.mark.parametrize("kill_on_bad_exit", [False, True], ids=["plain-srun", "kill-on-bad-exit"])
def test_a_rank_that_never_starts_ends_the_step_within_the_deadline(submit_dir, kill_on_bad_exit):
    run = submit_dir / "outputs" / f"startup-stall-{int(kill_on_bad_exit)}"
    pid_file = submit_dir / f"stalled-{int(kill_on_bad_exit)}"
    args = ["srun", "--mpi=pmi2", "--overcommit", "-n", "4", *(["--kill-on-bad-exit=1"] if kill_on_bad_exit else [])]
    args += [PY, "-m", "mpi4py", "-m", "collsync.cli", "sync=async", f"sync.deadline={DEADLINE}"]
    args += [f"hydra.run.dir={run}", "progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", STALL_ENV: "2", STALL_PID_ENV: str(pid_file)}
    started = time.monotonic()
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=3 * BOUND_S, cwd=submit_dir, env=env)
    finally:
        _end(pid_file)
    took = time.monotonic() - started
    assert pid_file.exists(), proc.stderr[-3000:]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert took < BOUND_S, (took, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("collsync-train: ")]
    # Slurm sends SIGCONT before it ends a step's tasks: the stopped rank 2 may run on long enough to arm its own
    # watchdog, which then says it ended inside the start-up (CI, --kill-on-bad-exit). It never says it waited.
    stopped = [line for line in lines if "rank 2 of 4" in line]
    assert 1 <= len(lines) - len(stopped) <= 3, proc.stderr[-3000:]
    assert all(DIED in line for line in stopped), stopped
    for line in lines:
        assert (SAYS in line and "(PMI_SIZE=4)" in line) or DIED in line, line
        assert f" of 4 on {socket.gethostname()}: " in line, line
    if not kill_on_bad_exit:
        assert "CANCELLED" in proc.stderr, proc.stderr[-3000:]  # the watchdog cancelled the step
    assert not run.exists()
