"""Deterministic runs end with the same parameters across hosts as on one host, bit for bit (as
tests/integration/test_torch_launch.py holds them bitwise on one host): `collsync-train` on one host under MPICH
against the same runs across two hosts under MPICH and under Open MPI, and a script through collsync.torch across
hosts against `collsync-train` on one host.

Each case has two workers, whose server's sum of two gradients does not depend on which arrives first. Ranks: the
server on node0, both workers on node1, so every push and pull crosses hosts. Why not a worker per host: collsync
gives each rank an equal share of its node's cores as torch threads, so a worker alone on a host (2 cores) computes
with 2 threads where on one host (3 ranks, 2 cores) it has 1, and its matrix products then sum in another order:
measured, the final parameters then differ in the last bits (1.5e-8 to 3e-8). The server's own arithmetic is
elementwise, the same whatever its thread count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.cluster.box import ENV, ROOT, finished, launch_runs, mpirun, need, rank_hosts

CASES = {
    "bsp-on-server": ["sync=bsp"],
    "ssp-s0": ["sync=ssp", "sync.max_lead=0"],
    "backup-b0": ["sync=backup", "sync.backups=0"],
}
COMMON = ["runtime=mpi", "steps=20", "stragglers=none"]
# Under Open MPI one case: between hosts its one-sided calls cost about 1.5 s per update here (MPICH 0.25 s), so the
# other cases would add a minute and a half to CI.
ACROSS = [("mpich", case) for case in CASES] + [("openmpi", "bsp-on-server")]
HOSTS = "node0:1,node1:2"


def params(run: Path) -> torch.Tensor:
    return torch.load(run / "params.pt", weights_only=False)["params"]


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cases on this machine's own host (no cluster: the venv's mpiexec, shared memory between ranks)."""
    folder = tmp_path_factory.mktemp("one-host")
    spec = folder / "runs.json"
    spec.write_text(json.dumps({str(folder / c): ["progress=false", *COMMON, *o] for c, o in CASES.items()}))
    script = ROOT / "tests" / "scripts" / "train_runs.py"
    cmd = [
        str(Path(sys.executable).parent / "mpiexec"),
        "-n",
        "3",
        sys.executable,
        "-m",
        "mpi4py",
        str(script),
        str(spec),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=folder, env=ENV)
    for case in CASES:
        finished(folder, proc, case)
    return folder


@pytest.fixture(scope="module")
def across(box: None, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The cases across hosts under an MPI, launched once on the first test that asks."""
    done: dict[str, Path] = {}

    def get(mpi: str) -> Path:
        if mpi not in done:
            folder = tmp_path_factory.mktemp(f"across-{mpi}")
            cases = [case for name, case in ACROSS if name == mpi]
            proc = launch_runs(mpi, HOSTS, 3, folder, {c: [*COMMON, *CASES[c]] for c in cases})
            for case in cases:
                finished(folder, proc, case)
            assert rank_hosts(folder) == ["node0", "node1", "node1"]
            done[mpi] = folder
        return done[mpi]

    return get


@pytest.mark.parametrize(("mpi", "case"), ACROSS)
def test_across_hosts_equals_one_host_bitwise(one_host, across, mpi, case):
    ours, theirs = params(across(need(mpi)) / case), params(one_host / case)
    assert torch.equal(ours, theirs), f"{mpi}, {case}: max difference {(ours - theirs).abs().max().item()}"


@pytest.mark.parametrize("case", ["bsp-on-server", "backup-b0"])
def test_collsync_torch_across_hosts_equals_collsync_train_on_one_host(one_host, box, tmp_path, case):
    """tests/scripts/train_equal.py (the same run written through collsync.torch) across hosts, under MPICH."""
    mpi = "mpich"
    out = tmp_path / "t.pt"
    script = ROOT / "tests" / "scripts" / "train_equal.py"
    cmd = mpirun(mpi, HOSTS, 3, str(script), "--out", str(out), *COMMON, *CASES[case])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = torch.load(out), params(one_host / case)
    assert torch.equal(ours, theirs), f"{mpi}, {case}: max difference {(ours - theirs).abs().max().item()}"
