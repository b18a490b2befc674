"""slurm/*.sbatch, srun lines and Hydra's submitit launchers against a real (single-node, 2-CPU) Slurm cluster.

Every job is submitted at once by one fixture and the tests then wait for theirs, so the cluster keeps the node busy
instead of idling between tests. Runs are short (60 updates) and the node small: the jobs ask for more tasks than it
has CPUs, hence `--overcommit`, as slurm/README.md says.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.slurm.cluster import ROOT, job_states, sbatch, wait_for

pytestmark = pytest.mark.usefixtures("cluster")

PY = sys.executable
TRAIN = str(Path(PY).parent / "collsync-train")
SHORT = ["steps=60", "eval_every=30", "progress=false"]
# The runs of slurm/train.sbatch: sbatch options, overrides, and how many ranks are workers.
RUNS = {
    "backup": (["--overcommit", "--ntasks=3"], ["sync=backup", "sync.backups=1"], 2),
    "async": (["--overcommit", "--ntasks=3"], ["sync=async", "optimizer=sgd"], 2),
    "psp-2-shards": (["--overcommit", "--ntasks=3"], ["sync=psp", "runtime.servers=2"], 1),
    "partial": (["--overcommit", "--ntasks=3"], ["runtime=partial", "sync=backup"], 3),
}
FAILING = "collsync-train: error: backup: backups=8 must be < workers=8"


@dataclass
class Launched:
    """What the fixture started: batch jobs by name, the two submitit sweeps' launcher processes and folders."""

    jobs: dict[str, str]
    sweeps: dict[str, tuple[subprocess.Popen[str], Path]]


def env() -> dict[str, str]:
    """The environment of a launch: one torch thread per rank (2 CPUs), the venv's python for the scripts."""
    return {**os.environ, "COLLSYNC_PYTHON": PY, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def launched(cluster, submit_dir: Path) -> Launched:
    """Submit every batch job and start both submitit sweeps, without waiting for any of them."""
    # Jobs start with the submitting process's environment.
    os.environ.update(COLLSYNC_PYTHON=PY, OMP_NUM_THREADS="1")
    # The sweeps first: their jobs then start at once, and submitit, which polls less often the longer it has
    # waited, sees them end soon after they do.
    sweeps = {}
    for name, overrides in {
        # A simulator sweep in which member 1 fails on its config.
        "failing": ["hydra/launcher=submitit_slurm", "sync.backups=1,8"],
        # MPI runs through conf/hydra/launcher/slurm_mpi.yaml: 2 ranks (--ntasks-per-node) fit the node's 2 CPUs.
        "slurm_mpi": ["hydra/launcher=slurm_mpi", "hydra.launcher.tasks_per_node=2", "sync=async"],
    }.items():
        folder = submit_dir / f"multirun-{name}"
        args = [TRAIN, "-m", *overrides, *SHORT, f"hydra.sweep.dir={folder}"]
        proc = subprocess.Popen(args, cwd=submit_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sweeps[name] = (proc, folder)
    deadline = time.monotonic() + 120
    while not all(any((f / ".submitit").glob("*/*_submitted.pkl")) for _, f in sweeps.values()):
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in sweeps.values()), "sweeps not submitted"
        time.sleep(0.2)
    jobs = {}
    for name, (options, overrides, _) in RUNS.items():
        jobs[name] = sbatch(submit_dir, *options, str(ROOT / "slurm/train.sbatch"), *overrides, *SHORT)
    (submit_dir / "sweep.txt").write_text(
        "\n".join(f"{o} {' '.join(SHORT)}" for o in ["sync=bsp", "sync=async optimizer=sgd"]) + "\n"
    )
    array = ["--array=0-1", "--ntasks=2", str(ROOT / "slurm/sweep_array.sbatch"), "sweep.txt"]
    jobs["array"] = sbatch(submit_dir, *array)
    # MPICH's own mpiexec inside an allocation (it launches its proxies through srun).
    mpiexec = f"{Path(PY).parent / 'mpiexec'} -n 2 {PY} -m mpi4py -m collsync.cli sync=async optimizer=sgd"
    jobs["mpiexec-in-sbatch"] = sbatch(
        submit_dir, "--ntasks=2", "--output=slurm-mpiexec-%j.out",
        f"--wrap={mpiexec} hydra.run.dir=outputs/mpiexec-$SLURM_JOB_ID {' '.join(SHORT)}",
    )  # fmt: skip
    return Launched(jobs, sweeps)


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def log_tail(submit_dir: Path, job: str) -> str:
    logs = sorted(submit_dir.glob(f"slurm-*{job}*.out"))
    return "\n".join(path.read_text()[-3000:] for path in logs)


@pytest.mark.parametrize("name", list(RUNS))
def test_train_sbatch_completes(launched, submit_dir, name):
    job = launched.jobs[name]
    print(f"sbatch job {job}: slurm/train.sbatch {name}")
    states = wait_for(job, f"slurm/train.sbatch {name}")
    assert states == {job: "COMPLETED"}, log_tail(submit_dir, job)
    result = summary(submit_dir / "outputs" / f"slurm-{job}")
    assert 0.0 <= result["final_acc"] <= 1.0
    # Trained over MPI with the job's tasks as one world, not as the simulator or as separate one-rank worlds.
    assert result["clock"] == "wall"
    assert result["workers"] == RUNS[name][2]


def test_sweep_array_runs_one_line_per_task(launched, submit_dir):
    job = launched.jobs["array"]
    states = wait_for(job, "slurm/sweep_array.sbatch --array=0-1")
    assert states == {f"{job}_0": "COMPLETED", f"{job}_1": "COMPLETED"}, log_tail(submit_dir, job)
    for task, sync in enumerate(["bsp", "async"]):
        run = submit_dir / "outputs" / f"slurm-{job}" / str(task)
        assert summary(run)["final_acc"] is not None
        assert f"sync={sync}" in (run / ".hydra" / "overrides.yaml").read_text().replace("- ", "")
        assert summary(run)["workers"] == 1


def test_mpiexec_inside_an_allocation(launched, submit_dir):
    job = launched.jobs["mpiexec-in-sbatch"]
    states = wait_for(job, "sbatch --wrap 'mpiexec -n 2 ...'")
    assert states == {job: "COMPLETED"}, log_tail(submit_dir, job)
    result = summary(submit_dir / "outputs" / f"mpiexec-{job}")
    assert result["clock"] == "wall" and result["workers"] == 1


def finish_sweep(launched: Launched, name: str) -> tuple[int, str, Path]:
    proc, folder = launched.sweeps[name]
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the {name} submitit sweep did not end within 240 s:\n{output[-3000:]}")
    # submitit returns once a result is written: its jobs may still be ending. A sweep of several members is an
    # array job (folders <id>_<i>, beside <id> for the array), a sweep of one a plain job (folder <id>).
    folders = [p.name for p in (folder / ".submitit").iterdir() if p.is_dir()]
    for job in sorted(f for f in folders if "_" in f) or folders:
        wait_for(job, f"submitit sweep {name}", timeout=60)
    return proc.returncode, output, folder


def test_submitit_sweep_with_a_failing_member_ends_naming_it(launched):
    code, output, folder = finish_sweep(launched, "failing")
    assert code != 0
    # One line: the job, its state and the member's own error line; no traceback.
    failed = re.search(r"collsync-train: error: sweep job (\d+_1) failed \(state FAILED\): (.*)", output)
    assert failed, output[-3000:]
    assert failed.group(2) == FAILING and "Traceback" not in output
    assert job_states(failed.group(1)) == {failed.group(1): "FAILED"}
    ran = summary(folder / "0")  # the member that could run did: the simulator, in a one-task job
    assert ran["final_acc"] is not None and ran["clock"] == "simulated"


def test_submitit_slurm_mpi_launcher_runs_mpi_jobs(launched):
    code, output, folder = finish_sweep(launched, "slurm_mpi")
    assert code == 0, output[-3000:]
    result = summary(folder / "0")
    assert result["clock"] == "wall" and result["workers"] == 1  # 2 ranks: a server and a worker
    assert result["final_acc"] is not None


def test_srun_without_mpi_plugin_stops_with_one_line(cluster, submit_dir):
    run = submit_dir / "outputs" / "srun-none"
    args = ["srun", "--mpi=none", "--overcommit", "-n", "3", PY, "-m", "collsync.cli", f"hydra.run.dir={run}"]
    proc = subprocess.run([*args, *SHORT], capture_output=True, text=True, timeout=240, cwd=submit_dir, env=env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("collsync-train: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "SLURM_STEP_NUM_TASKS=3" in errors[0] and "srun --mpi=pmi2 -n 3" in errors[0]
    assert not (run / "summary.json").exists()


def test_small_node_needs_overcommit(cluster, submit_dir):
    """What slurm/README.md says of a node with fewer CPUs than tasks: sbatch pends for ever without --overcommit,
    and --ntasks-per-node beyond the CPUs is refused even with it (why the slurm_mpi launcher's tasks_per_node must
    fit the node)."""
    cpus = int(
        subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, timeout=30).stdout.split()[0]
    )
    job = sbatch(submit_dir, f"--ntasks={cpus + 1}", "--wrap=true")
    try:
        time.sleep(2)  # a scheduling pass
        reason = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True).stdout
        assert reason.split() == ["PENDING", "PartitionConfig"]
    finally:
        subprocess.run(["scancel", job], timeout=30)
    wait_for(job, f"sbatch --ntasks={cpus + 1} on {cpus} CPUs (cancelled)")
    args = ["sbatch", f"--ntasks-per-node={cpus + 1}", "--overcommit", "--wrap=true"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=submit_dir)
    assert proc.returncode != 0 and "Requested node configuration is not available" in proc.stderr
