"""`collsync-train` launched for real with the venv's own mpiexec (a subprocess, so it runs from plain pytest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = Path(sys.executable).parent / "mpiexec"
pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)")


def launch(tmp_path: Path, ranks: int, *overrides: str) -> subprocess.CompletedProcess[str]:
    args = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "collsync.cli"]
    args += [f"hydra.run.dir={tmp_path / 'run'}", "progress=false", *overrides]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [
        ["sync=backup", "sync.backups=1"],
        # Stale gradients and heavy momentum do not mix (001_...): plain SGD for the asynchronous policies.
        ["sync=async", "optimizer=sgd", "steps=300"],
        ["sync=ssp", "optimizer=sgd"],
        ["runtime=allreduce", "sync=bsp"],
    ],
    ids=["backup", "async", "ssp", "allreduce"],
)
def test_four_ranks_train_digits(tmp_path, overrides):
    proc = launch(tmp_path, 4, "steps=150", "eval_every=50", *overrides)
    steps = int(next((o.split("=")[1] for o in overrides if o.startswith("steps=")), 150))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    checks = summary["trace_checks"]
    assert checks["updates"] == steps
    assert checks["pushed"] == checks["applied"] + checks["dropped"]
    assert summary["best_acc"] >= 0.85


def test_too_many_backups_for_the_world_fails_with_the_rank_named(tmp_path):
    proc = launch(tmp_path, 3, "sync=backup", "sync.backups=2")
    assert proc.returncode != 0
    assert "backups=2 must be < workers=2" in proc.stderr
    assert "rank " in proc.stderr


FROZEN = ["runtime.inject_stragglers=true", "stragglers=frozen_worker", "stragglers.worker=1", "stragglers.at=5"]


def test_a_frozen_worker_does_not_stop_backup_sync(tmp_path):
    proc = launch(tmp_path, 4, "sync=backup", "sync.backups=1", "steps=120", *FROZEN)
    assert proc.returncode == 0, proc.stderr[-2000:]
    applies = [json.loads(line) for line in (tmp_path / "run" / "trace.jsonl").open() if '"apply"' in line]
    assert len(applies) == 120
    assert all(1 not in e["workers"] for e in applies[20:])  # worker 1 froze early and was never waited for


def test_bsp_names_the_frozen_worker_after_its_deadline(tmp_path):
    proc = launch(tmp_path, 4, "sync=bsp", "sync.deadline=2", "steps=120", *FROZEN)
    assert proc.returncode != 0
    assert "deadline=2" in proc.stderr and "waiting on worker(s) [1]" in proc.stderr
    assert "rank 0 of 4" in proc.stderr
