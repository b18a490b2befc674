"""Preemption on a real Slurm: slurm/train.sbatch takes USR1 (what `--signal=B:USR1@120` sends before the time
limit), passes it to the ranks, which checkpoint and stop, requeues itself, and the next attempt goes on from the
checkpoint (`resume=auto`) to the end of training, in the same run folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import torch

from tests.slurm.cluster import ROOT, job_states, sbatch, start_requeued_now, wait_for

PY = sys.executable


def test_usr1_checkpoints_requeues_and_the_next_attempt_resumes(cluster, submit_dir):
    os.environ.update(COLLSYNC_PYTHON=PY, OMP_NUM_THREADS="1")
    steps = 300
    job = sbatch(
        submit_dir,
        "--overcommit",
        "--ntasks=3",
        str(ROOT / "slurm/train.sbatch"),
        "runtime=mpi",
        "sync=bsp",
        f"steps={steps}",
        "checkpoint.every=20",
        "eval_every=100",
        "progress=false",
        # Paced (30 ms a step, ~9 s in all) so that USR1 lands while the run trains: unpaced, the digits MLP does 300
        # steps in well under a second, and the run could end before the signal arrives.
        "stragglers=none",
        "runtime.inject_stragglers=true",
        "runtime.time_scale=0.03",
    )
    run = submit_dir / "outputs" / f"slurm-{job}"
    deadline = time.monotonic() + 180
    while not (run / "checkpoint.pt").exists():
        assert time.monotonic() < deadline, f"job {job}: no checkpoint within 180 s: {job_states(job)}"
        time.sleep(0.2)
    # As Slurm does before a time limit: USR1 to the batch shell only.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=30)
    start_requeued_now(job)
    states = wait_for(job, "train.sbatch: USR1, requeue, resume", timeout=300)
    log = "\n".join(p.read_text() for p in submit_dir.glob(f"slurm-*-{job}.out"))
    assert states[job] == "COMPLETED", log[-3000:]
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
    assert int(re.search(r"Restarts=(\d+)", shown.stdout).group(1)) == 1, shown.stdout
    assert "stopped by SIGUSR1 at server step" in log, log[-3000:]
    events = [json.loads(line) for line in (run / "trace.jsonl").open()]
    resumed = [e for e in events if e["ev"] == "resume"]
    assert len(resumed) == 1 and 0 < resumed[0]["version"] < steps
    assert [e["version"] for e in events if e["ev"] == "apply"] == list(range(1, steps + 1))
    finished = torch.load(run / "params.pt", weights_only=False)
    assert finished["version"] == steps
    summary = json.loads((run / "summary.json").read_text())
    assert "incomplete" not in summary and summary["final_acc"] > 0.5
