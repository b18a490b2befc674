"""A lost rank on a real Slurm: slurm/train_elastic.sbatch runs a bsp job through collsync-run and srun; one task is
killed mid-run, srun ends the step (--kill-on-bad-exit=1) naming it, and the supervisor starts the run again on the
tasks left, inside the same allocation, from its checkpoint, to the end of training."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.slurm.cluster import ROOT, job_states, sbatch, wait_for

PY = sys.executable


def _task_pid(marker: str, task: int) -> int | None:
    """The collsync process of Slurm task `task` whose command line holds `marker`."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            if not entry.name.isdigit() or marker not in cmdline or "collsync.cli" not in cmdline:
                continue
            if f"SLURM_PROCID={task}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:
            continue
    return None


def test_a_killed_task_is_left_behind_and_the_run_finishes_on_the_others(cluster, submit_dir):
    os.environ.update(COLLSYNC_PYTHON=PY, OMP_NUM_THREADS="1")
    steps = 400
    overrides = ["runtime=mpi", "sync=bsp", "sync.deadline=5", "optimizer=sgd", f"steps={steps}"]
    overrides += ["checkpoint.every=50", "checkpoint.seconds=null", "eval_every=100", "progress=false"]
    # Paced (20 ms a step, ~8 s in all) so that the kill lands while the run trains, not after it has ended.
    overrides += ["stragglers=none", "runtime.inject_stragglers=true", "runtime.time_scale=0.02"]
    job = sbatch(submit_dir, "--overcommit", "--ntasks=4", str(ROOT / "slurm/train_elastic.sbatch"), *overrides)
    run = submit_dir / "outputs" / f"slurm-{job}"
    deadline = time.monotonic() + 180
    while not (run / "checkpoint.pt").exists():
        assert time.monotonic() < deadline, f"job {job}: no checkpoint within 180 s: {job_states(job)}"
        time.sleep(0.1)
    pid = _task_pid(f"slurm-{job}", 2)
    assert pid is not None, f"job {job}: task 2 not found"
    os.kill(pid, signal.SIGKILL)
    states = wait_for(job, "train_elastic.sbatch: task 2 killed, restart on 3", timeout=300)
    log = "\n".join(p.read_text() for p in submit_dir.glob(f"slurm-*-{job}.out"))
    assert states[job] == "COMPLETED", log[-3000:]
    assert "collsync-run: attempt 2 of 3: lost rank 2" in log and "on 3 rank(s) (was 4)" in log, log[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert "incomplete" not in summary and summary["updates"] == steps
    (restart,) = summary["restarts"]
    assert (restart["ranks"], restart["was"], restart["why"]) == (3, 4, "lost rank 2")
    events = [json.loads(line) for line in (run / "trace.jsonl").open()]
    assert [e["version"] for e in events if e["ev"] == "apply"] == list(range(1, steps + 1))
    (resume,) = [e for e in events if e["ev"] == "resume"]
    assert resume["version"] == restart["from_step"] and 0 < resume["version"] < steps
