"""Checkpoints with several parameter-server shards (`runtime=mpi runtime.servers=2`, 2 workers, 4 ranks under the
venv's mpiexec): rank 0 writes every shard's state at one version; a run stopped by SIGTERM resumes from it, under
bsp bit for bit where the uninterrupted run ends, under async with every gradient applied or dropped once per
shard (`check_trace` over the resumed trace) and no shard short of its steps. Which blocks a resumed worker sends
again is checked in tests/unit/test_shard_resume.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from collsync import checkpoint
from tests.integration import hits
from tests.integration.test_mpi_cli import MPIEXEC, case_summary, command, launch_runs

pytestmark = [
    pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds a rank's process through /proc"),
]

SHARDS = ["runtime=mpi", "runtime.servers=2", "checkpoint.every=10", "eval_every=50", "sync.deadline=5"]
BSP = ["sync=bsp", "steps=300"]
ASYNC = ["sync=async", "optimizer=sgd"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One 4-rank launch, runs one after another: bsp never stopped (what a resumed bsp run must equal), async to
    200 updates, then async resumed from that run's last checkpoint for 260."""
    tmp_path = tmp_path_factory.mktemp("shards")
    more = [*SHARDS, *ASYNC, "steps=260", f"resume={tmp_path / 'first' / 'run'}"]
    cases = {"plain": [*SHARDS, *BSP], "first": [*SHARDS, *ASYNC, "steps=200"], "more": more}
    return tmp_path, launch_runs(tmp_path, 4, cases)


def _stop_after_a_checkpoint(tmp_path: Path, *overrides: str) -> tuple[int, str]:
    """Launch 4 ranks, wait for the first checkpoint, SIGTERM every rank (as Slurm does); (exit status, stderr)."""
    proc = subprocess.Popen(
        command(tmp_path, 4, *SHARDS, *overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        end = time.monotonic() + 120
        ckpt = tmp_path / "run" / checkpoint.NAME
        while not ckpt.exists() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
        assert ckpt.exists(), proc.communicate(timeout=60)[1][-2000:]
        assert proc.poll() is None, "the run ended before the signal: make it longer"
        pids = [pid for r in range(4) for pid in hits.rank_pids(f"hydra.run.dir={tmp_path / 'run'}", r)]
        assert len(pids) == 4, pids
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()


def _resume(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(tmp_path, 4, *SHARDS, *overrides, "resume=auto"), capture_output=True, text=True, timeout=300
    )


def test_two_shards_checkpoint_at_one_version_and_resume_bit_for_bit_under_bsp(runs, tmp_path: Path) -> None:
    code, err = _stop_after_a_checkpoint(tmp_path / "stopped", *BSP)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM at server step" in err, err[-2000:]
    saved = checkpoint.load(tmp_path / "stopped" / "run" / checkpoint.NAME)
    # One file, both shards at the version it names, each with what every worker had sent it.
    assert len(saved["shards"]) == 1 and 0 < saved["version"] < 300
    assert saved["shards"][0]["server"]["version"] == saved["server"]["version"] == saved["version"]
    for part in (saved["server"], saved["shards"][0]["server"]):
        assert all(n >= saved["version"] for n in part["received"]), part["received"]
    resumed = _resume(tmp_path / "stopped", *BSP)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    case_summary(runs, "plain")
    a = torch.load(tmp_path / "stopped" / "run" / "params.pt", weights_only=False)
    b = torch.load(runs[0] / "plain" / "run" / "params.pt", weights_only=False)
    assert a["version"] == b["version"] == 300
    assert torch.equal(a["params"], b["params"]), f"resumed at {saved['version']}: not the uninterrupted run"


def test_two_shards_resume_under_async_loses_no_gradient(runs) -> None:
    """The last periodic checkpoint of a finished async run, resumed for more steps into a new run folder."""
    case_summary(runs, "first")
    saved = checkpoint.load(runs[0] / "first" / "run" / checkpoint.NAME)
    assert len(saved["shards"]) == 1 and 100 <= saved["version"] < 200
    summary = case_summary(runs, "more")
    assert "incomplete" not in summary
    # Each shard's trace (restored, then continued) passed check_trace: every push applied or dropped once.
    for shard in summary["shards"]:
        assert shard["updates"] == 260 and shard["pushed"] == shard["applied"] + shard["dropped"], shard
    # The shards went on from the checkpoint: their pushes include the ones it holds.
    before = [sum(saved["server"]["received"]), sum(saved["shards"][0]["server"]["received"])]
    assert all(s["pushed"] > b for s, b in zip(summary["shards"], before, strict=True)), (summary["shards"], before)
    events = [json.loads(line) for line in (runs[0] / "more" / "run" / "trace.jsonl").read_text().splitlines()]
    assert sum(e["ev"] == "resume" for e in events) == 1
