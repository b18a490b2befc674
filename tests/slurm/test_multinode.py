"""A multi-node Slurm on the cluster in one box: slurmctld on node0 and a slurmd on each of node0..node2, each in its
host's network namespace under its name (scripts/slurm_up.sh with COLLSYNC_SLURM_HOSTS; tests/run.sh starts it).
Jobs ask for two nodes; where the ranks ran is read back from the ranks themselves and from the run's summary.

The nodes share this machine's CPUs (each node is given all of them), so the jobs pass --overcommit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import start_requeued_now

MULTI = Path(os.environ.get("COLLSYNC_SLURM_MULTI_DIR", "/tmp/collsync-slurm-multi"))
ON_HEAD = MULTI / "bin" / "on-head"
START = "bash scripts/cluster_up.sh && COLLSYNC_SLURM_HOSTS='node0 node1 node2' bash scripts/slurm_up.sh " + str(MULTI)
ENV = {**os.environ, "COLLSYNC_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def head(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A Slurm command run where the multi-node controller answers (the first host's namespace)."""
    return subprocess.run([str(ON_HEAD), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=ENV)


@pytest.fixture(scope="module")
def nodes() -> list[str]:
    """The idle nodes of the multi-node cluster, or a skip saying how to start one."""
    if not ON_HEAD.exists():
        why = (MULTI / "unavailable").read_text().strip() if (MULTI / "unavailable").exists() else ""
        pytest.skip(why or f"no multi-node Slurm in {MULTI} (start one: {START})")
    listed = head("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
    idle = sorted(line.split()[0] for line in listed if line.endswith(" idle"))
    if len(idle) < 2:
        pytest.skip(f"the multi-node Slurm in {MULTI} has fewer than 2 idle nodes: {listed}")
    return idle


def test_srun_places_ranks_on_two_nodes(nodes):
    probe = "from mpi4py import MPI; import socket; c = MPI.COMM_WORLD; print(c.rank, c.size, socket.gethostname())"
    proc = head("srun", "--mpi=pmi2", "-N", "2", "-n", "4", "--overcommit", sys.executable, "-c", probe)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = sorted(tuple(line.split()) for line in proc.stdout.splitlines() if line.strip())
    assert [r[:2] for r in ranks] == [(str(i), "4") for i in range(4)], proc.stdout  # one world of 4, not 4 of 1
    assert len({r[2] for r in ranks}) == 2 and {r[2] for r in ranks} <= set(nodes), ranks


def wait(job: str, timeout: float = 300) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = re.search(r"JobState=(\w+)", head("scontrol", "show", "job", job).stdout)
        if state and state.group(1) in FINAL:
            return state.group(1)
        time.sleep(0.5)
    head("scancel", job)
    raise AssertionError(f"job {job} not finished within {timeout:.0f} s")


def test_sbatch_train_runs_across_two_nodes(nodes, tmp_path):
    """slurm/train.sbatch as it is, with -N 2: the run's ranks (summary.json's hosts) on both nodes."""
    script = Path(__file__).resolve().parents[2] / "slurm" / "train.sbatch"
    args = ["sbatch", "--parsable", "-N", "2", "--ntasks=4", "--overcommit", str(script)]
    proc = head(*args, "sync=async", "steps=60", "eval_every=30", "progress=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    state = wait(job)
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert state == "COMPLETED", log[-3000:]
    result = json.loads((tmp_path / "outputs" / f"slurm-{job}" / "summary.json").read_text())
    assert result["updates"] == 60
    hosts = result.get("hosts")
    assert hosts is not None and len(hosts) == 4 and len(set(hosts)) == 2 and set(hosts) <= set(nodes), hosts


def submitted(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def test_sweep_array_spreads_over_the_nodes(nodes, tmp_path):
    """slurm/sweep_array.sbatch, three tasks each given a whole node (--exclusive): each ran, each on its own node."""
    script = Path(__file__).resolve().parents[2] / "slurm" / "sweep_array.sbatch"
    lines = tmp_path / "sweep.txt"
    lines.write_text("".join(f"sync=async seed={seed} steps=40 eval_every=20 progress=false\n" for seed in range(3)))
    args = ["sbatch", "--parsable", "--array=0-2", "--exclusive", "-N", "1", "--ntasks=2", "--overcommit"]
    job = submitted(head(*args, str(script), str(lines), cwd=tmp_path))
    tasks = [f"{job}_{i}" for i in range(3)]
    states = {task: wait(task) for task in tasks}
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert set(states.values()) == {"COMPLETED"}, (states, log[-3000:])
    hosts = [
        json.loads((tmp_path / "outputs" / f"slurm-{job}" / str(i) / "summary.json").read_text())["hosts"]
        for i in range(3)
    ]
    assert all(len(set(h)) == 1 for h in hosts), hosts  # -N 1: each task's ranks on one node
    assert sorted(h[0] for h in hosts) == sorted(nodes[:3]), hosts  # and the three tasks on three nodes


# Each step sleeps 30 ms (the straggler model's mean of 1 times time_scale), so 150 steps last ~5 s and USR1 lands
# while the run trains; unpaced, the digits MLP does 150 steps in 0.2 s, before the signal arrives.
PACED = ["stragglers=none", "runtime.inject_stragglers=true", "runtime.time_scale=0.03"]


def test_a_requeued_job_resumes_on_another_node(nodes, tmp_path):
    """The node of the first attempt is drained (as a failing node is) while it runs; USR1 (Slurm's warning before
    the time limit) checkpoints and requeues; the next attempt lands on another node and resumes there."""
    script = Path(__file__).resolve().parents[2] / "slurm" / "train.sbatch"
    args = ["sbatch", "--parsable", "-N", "1", "--ntasks=2", "--overcommit", str(script)]
    overrides = ["runtime=mpi", "sync=bsp", "steps=150", "checkpoint.every=10", "eval_every=100", "progress=false"]
    overrides += PACED
    job = submitted(head(*args, *overrides, cwd=tmp_path))
    run = tmp_path / "outputs" / f"slurm-{job}"
    deadline = time.monotonic() + 180
    while not (run / "checkpoint.pt").exists():
        assert time.monotonic() < deadline, head("scontrol", "show", "job", job).stdout
        time.sleep(0.2)
    first = re.search(r" NodeList=(\S+)", head("scontrol", "show", "job", job).stdout).group(1)
    head("scontrol", "update", f"nodename={first}", "state=drain", "reason=collsync-test")
    try:
        head("scancel", "--batch", "--signal=USR1", job)
        start_requeued_now(job, (str(ON_HEAD), "scontrol"))
        state = wait(job)
    finally:
        head("scontrol", "update", f"nodename={first}", "state=resume")
    log = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert state == "COMPLETED", log[-3000:]
    assert "stopped by SIGUSR1 at server step" in log, log[-3000:]
    result = json.loads((run / "summary.json").read_text())
    assert result["updates"] == 150 and "incomplete" not in result
    assert first not in result["hosts"] and len(set(result["hosts"])) == 1, (first, result["hosts"])
    resumed = [json.loads(line) for line in (run / "trace.jsonl").open() if '"resume"' in line]
    assert len(resumed) == 1 and 0 < resumed[0]["version"] < 150
