"""A launch that does not fit the runtime stops before training with one line saying what to pass instead.

The srun side (`srun --mpi=none -n 3`) runs against a real Slurm in tests/slurm; here: the check's decisions from
the environment alone, and `mpiexec -n 3 ... runtime=sim` for real.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from collsync.runtime.spec import mpi, sim

MPIEXEC = Path(sys.executable).parent / "mpiexec"

# What Slurm puts in the environment of the tasks of `srun -n 3` (a step of 3 tasks), with and without an MPI plugin.
SRUN_NONE = {"SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3", "SLURM_PROCID": "0"}
SRUN_PMI2 = {**SRUN_NONE, "PMI_SIZE": "3", "PMI_RANK": "0"}
SRUN_PMIX = {**SRUN_NONE, "PMIX_RANK": "0"}


def test_srun_without_mpi_plugin_stops_on_rank_0_with_the_flag_to_pass():
    with pytest.raises(ValueError, match=r"SLURM_STEP_NUM_TASKS=3 .*--mpi=none.*srun --mpi=pmi2 -n 3"):
        mpi().check_launcher(SRUN_NONE)
    with pytest.raises(ValueError, match="--mpi=pmi2"):
        sim().check_launcher(SRUN_NONE)  # runtime=auto resolves to the simulator there


def test_srun_without_mpi_plugin_exits_silently_on_other_tasks():
    with pytest.raises(SystemExit) as stop:
        mpi().check_launcher({**SRUN_NONE, "SLURM_PROCID": "2"})
    assert stop.value.code == 2


@pytest.mark.parametrize(
    "env",
    [
        SRUN_PMI2,
        SRUN_PMIX,
        {"SLURM_NTASKS": "5"},  # a batch script's own shell: no step, one process
        {"SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"},  # a one-task step (a submitit sweep member)
        {"PMI_SIZE": "4", "PMI_RANK": "0", "SLURM_STEP_NUM_TASKS": "1"},  # mpiexec's proxy step inside sbatch
        {},
    ],
    ids=["srun-pmi2", "srun-pmix", "batch-shell", "one-task-step", "mpiexec-in-allocation", "no-launcher"],
)
def test_fitting_launches_pass(env):
    mpi().check_launcher(env)


def test_simulator_under_one_rank_passes_and_under_several_stops():
    sim().check_launcher({"PMI_SIZE": "1", "PMI_RANK": "0"})
    with pytest.raises(ValueError, match=r"runtime=sim .* 4 ranks.*runtime=mpi"):
        sim().check_launcher({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"})


@pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)")
def test_mpiexec_runtime_sim_stops_with_one_line(tmp_path):
    run = tmp_path / "run"
    args = [str(MPIEXEC), "-n", "3", sys.executable, "-m", "mpi4py", "-m", "collsync.cli", "runtime=sim"]
    proc = subprocess.run(
        [*args, f"hydra.run.dir={run}", "progress=false"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("collsync-train: rank 0 of 3 on ")
    assert "runtime=sim" in errors[0] and "pass runtime=mpi" in errors[0]
    assert not (run / "summary.json").exists()
