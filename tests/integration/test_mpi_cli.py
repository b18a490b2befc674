"""`collsync-train` launched for real with the venv's own mpiexec (a subprocess, so it runs from plain pytest)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration import hits
from tests.integration.hits import MPIEXEC, summary

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)")


def command(tmp_path: Path, ranks: int, *overrides: str) -> list[str]:
    args = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "collsync.cli"]
    return args + [f"hydra.run.dir={tmp_path / 'run'}", "progress=false", *overrides]


def launch(tmp_path: Path, ranks: int, *overrides: str) -> subprocess.CompletedProcess[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        command(tmp_path, ranks, *overrides), capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def applies(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "trace.jsonl").open() if '"apply"' in line]


def launch_runs(tmp_path: Path, ranks: int, runs: dict[str, list[str]]) -> subprocess.CompletedProcess[str]:
    """`runs` (a case's name: its overrides) one after another in one launch of `ranks` ranks
    (tests/scripts/train_runs.py: each rank imports torch and the runtimes once, not once per run); a case's run
    folder is tmp_path / name / "run", as `launch` writes it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps({str(tmp_path / name / "run"): overrides for name, overrides in runs.items()}))
    args = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(SCRIPTS / "train_runs.py"), str(spec)]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def case_summary(launched: tuple[Path, subprocess.CompletedProcess[str]], case: str) -> dict:
    """The summary of `case` from a launch of several runs: one failing run aborts the launch (and fails the tests
    of the runs after it, each showing the launch's stderr)."""
    tmp_path, proc = launched
    assert (tmp_path / case / "run" / "summary.json").is_file(), (proc.returncode, proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return summary(tmp_path / case)


# backup and ssp at 4 ranks: test_five_ranks_reach_the_simulators_accuracy runs both at 5.
FOUR = {
    "async-sgd": ["sync=async", "optimizer=sgd", "steps=300"],
    "allreduce": ["runtime=allreduce", "sync=bsp"],
    "allreduce-unbucketed": ["runtime=allreduce", "sync=bsp", "runtime.bucket_mib=0"],
    # The direct exchange asked for by name (on one host `runtime.protocol=auto` takes the host's windows).
    "partial": ["runtime=partial", "sync=backup", "sync.backups=1", "runtime.protocol=direct"],
}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp_path = tmp_path_factory.mktemp("four")
    return tmp_path, launch_runs(tmp_path, 4, {c: ["steps=150", "eval_every=50", *o] for c, o in FOUR.items()})


@pytest.mark.parametrize("case", list(FOUR))
def test_four_ranks_train_digits(four_ranks, case):
    steps = int(next((o.split("=")[1] for o in FOUR[case] if o.startswith("steps=")), 150))
    result = case_summary(four_ranks, case)
    checks = result["trace_checks"]
    assert checks["updates"] == steps
    assert checks["pushed"] == checks["applied"] + checks["dropped"]
    assert result["best_acc"] >= 0.85


def test_the_summary_names_the_host_of_every_rank(four_ranks):
    """summary.json of an MPI run lists each rank's host name by rank (one host here): the parameter-server run
    and both serverless ones."""
    for case in ("async-sgd", "allreduce", "partial"):
        assert case_summary(four_ranks, case)["hosts"] == [socket.gethostname()] * 4, case


# The README's launch lines at their defaults (300 updates): one (or two) server rank(s) and the workers over MPI.
FIVE = {
    "backup": ["sync=backup", "sync.backups=1"],
    "async-gap-aware": ["sync=async", "penalty=gap_aware"],
    "ssp": ["sync=ssp"],
    "psp-2-shards": ["sync=psp", "runtime.servers=2"],
}
# PSP's partial pull: shard 1's server is slow (1 s per update, scaled by time_scale); 150 updates (at 100 the best
# accuracy ran 0.85-0.90, below the test's 0.85 once in four CI runs under load; at 150, 0.91-0.95 under load).
PARTIAL_PULL = [
    "steps=150",
    "sync=psp",
    "runtime.servers=2",
    "sync.pull_fraction=0.5",
    "runtime.inject_stragglers=true",
]
PARTIAL_PULL += ["stragglers=slow_server", "stragglers.shard=1", "stragglers.seconds=1", "runtime.time_scale=0.005"]


@pytest.fixture(scope="module")
def five_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp_path = tmp_path_factory.mktemp("five")
    return tmp_path, launch_runs(tmp_path, 5, {**FIVE, "psp-partial-pull": PARTIAL_PULL})


def simulated(tmp_path: Path, overrides: list[str], workers: int) -> dict:
    """The same config in the simulator with `workers` workers, run in this process (as `collsync-train` runs it:
    `collsync.cli.execute`)."""
    from hydra import compose, initialize_config_dir

    from collsync.cli import CONF_DIR, execute

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "progress=false", "runtime=sim", f"runtime.workers={workers}"])
    result = execute(cfg, tmp_path)
    assert result is not None and result.get("incomplete") is None, result
    return result


@pytest.mark.parametrize("case", list(FIVE))
def test_five_ranks_reach_the_simulators_accuracy(five_ranks, tmp_path, case):
    """Each run of the 5-rank launch against the simulator with as many workers."""
    overrides = FIVE[case]
    servers = 2 if "runtime.servers=2" in overrides else 1
    real = case_summary(five_ranks, case)
    sim = simulated(tmp_path, [o for o in overrides if not o.startswith("runtime.")], 5 - servers)
    assert real["trace_checks"]["updates"] == 300
    assert real["best_acc"] >= sim["best_acc"] - 0.05, (real["best_acc"], sim["best_acc"])
    if servers == 2:
        assert [shard["updates"] for shard in real["shards"]] == [300, 300]


def test_psp_partial_pull_goes_on_without_a_slow_shard(five_ranks):
    result = case_summary(five_ranks, "psp-partial-pull")
    assert [shard["updates"] for shard in result["shards"]] == [150, 150]
    assert result["partial_pulls"] > 0  # workers went on with shard 0's block while shard 1 was busy
    assert result["best_acc"] >= 0.85  # and with shard 1's newest published block, not the one they started with


# Too many backups for the world, refused in one line naming rank 0: test_bad_inputs.py, row mpi-backups-once.


FROZEN = ["runtime.inject_stragglers=true", "stragglers=frozen_worker", "stragglers.worker=1", "stragglers.at=5"]


FROZEN_AT = {
    "backup": ["sync=backup", "sync.backups=1"],
    "ssp-timeout": ["sync=ssp", "sync.timeout=0.05"],
    "psp": ["sync=psp", "sync.pushes=2"],
}


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp_path = tmp_path_factory.mktemp("frozen")
    return tmp_path, launch_runs(tmp_path, 4, {c: ["steps=120", *o, *FROZEN] for c, o in FROZEN_AT.items()})


@pytest.mark.serial
@pytest.mark.parametrize("case", list(FROZEN_AT))
def test_a_frozen_worker_does_not_stop_training(frozen, case):
    case_summary(frozen, case)
    done = applies(frozen[0] / case)
    assert len(done) == 120
    assert all(1 not in e["workers"] for e in done[20:])  # worker 1 froze early and was never waited for


def _watched(args: list[str], cwd: Path) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    """Start a run whose stderr (the progress bar) is collected as it comes."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    return proc, err, reader


def _stop_rank_once_training(proc: subprocess.Popen[str], err: list[str], tmp_path: Path, bar: str) -> list[int]:
    """Wait until rank 0's progress bar matches `bar` (window creation is collective: stop a rank before it and
    nobody trains), then SIGSTOP rank 2 (worker 1); returns its pids."""
    end = time.monotonic() + 120
    while not re.search(bar, "".join(err[-400:])) and time.monotonic() < end:
        assert proc.poll() is None, "".join(err)[-2000:]
        time.sleep(0.02)
    pids = hits.rank_pids(f"hydra.run.dir={tmp_path / 'run'}", 2)
    assert pids, "rank 2 not found"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def _bar_count(err: list[str]) -> int:
    """The latest update count rank 0's progress bar shows (0 before the first)."""
    counts = re.findall(r" (\d+)/\d+ ", "".join(err[-400:]))
    return int(counts[-1]) if counts else 0


@pytest.mark.serial
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process through /proc")
@pytest.mark.parametrize(
    "overrides",
    # Steps: the stop (from update 100 until 150 more) with room to spare, the rest run after the rank is continued.
    # Async runs ~900 updates/s on a quiet machine (its stop may come hundreds of updates late); backup and ssp
    # train far slower (44 and 82 updates/s on two busy cores): 1,000 steps leave them 150 updates past the stop many
    # times over, where 3,000 cost 25-45 s more of training nothing asserts on.
    [
        ["sync=async", "optimizer=sgd", "steps=3000"],
        ["sync=backup", "sync.backups=1", "steps=1000"],
        ["sync=ssp", "sync.timeout=0.01", "optimizer=sgd", "steps=1000"],
    ],
    ids=["async", "backup", "ssp-timeout"],
)
def test_a_stopped_rank_does_not_stop_training(tmp_path, overrides):
    """SIGSTOP a worker rank for real once training is under way; SIGCONT it later so the run can end cleanly."""
    args = [o for o in command(tmp_path, 4, *overrides) if o != "progress=false"] + ["progress=true"]
    proc, err, reader = _watched(args, tmp_path)
    with hits.ended(proc) as pids:
        pids += _stop_rank_once_training(proc, err, tmp_path, r" ([1-9]\d{2,})/\d+ ")
        # Stopped until the bar shows 150 more updates (a count, not a time: a loaded machine fits fewer updates in a
        # second), or for 60 s where the others wait for the stopped worker: then the assertion below fails.
        stopped_at, end = _bar_count(err), time.monotonic() + 60
        while _bar_count(err) < stopped_at + 150 and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.02)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=240)
        reader.join(timeout=10)
    assert proc.returncode == 0, "".join(err)[-2000:]
    longest = run = 0
    for e in applies(tmp_path):
        run = 0 if 1 in e["workers"] else run + 1
        longest = max(longest, run)
    # Otherwise worker 1 is in every second or third update at least; here the others went on without it.
    assert longest >= 100, longest
    checks = summary(tmp_path)["trace_checks"]
    assert checks["pushed"] == checks["applied"] + checks["dropped"]


@pytest.mark.serial
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process through /proc")
@pytest.mark.parametrize(
    ("overrides", "wait"),
    [
        (["sync=bsp", "steps=2000"], "got no gradient within deadline=3"),
        # Async runs ~900 updates/s on the two workers left: 2,000 steps could end before the 3 s deadline fires.
        (["sync=async", "optimizer=sgd", "steps=30000", "sync.on_lost=stop"], "got no gradient within deadline=3"),
    ],
    ids=["bsp", "async-on_lost-stop"],
)
def test_a_stopped_worker_ends_the_run_by_the_deadline_keeping_what_was_trained(tmp_path, overrides, wait):
    """SIGSTOP worker 1 (rank 2) for good under a policy that cannot go on without it (BSP, or async told
    sync.on_lost=stop; async by default goes on: tests/integration/test_lost_workers.py): the run ends within the
    deadline naming the rank and its host, and the run folder holds what was trained."""
    args = [o for o in command(tmp_path, 4, *overrides, "sync.deadline=3") if o != "progress=false"]
    proc, err, reader = _watched(args + ["progress=true"], tmp_path)
    with hits.ended(proc) as pids:
        pids += _stop_rank_once_training(proc, err, tmp_path, r" ([1-9]\d+)/\d+ ")
        stopped = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - stopped
        reader.join(timeout=10)
    text = "".join(err)
    assert proc.returncode != 0
    assert wait in text and "worker 1 (rank 2 on " in text, text[-2000:]
    assert took < 60, took
    result = summary(tmp_path)
    assert wait in result["incomplete"]
    assert result["best_acc"] is not None and (tmp_path / "run" / "params.pt").is_file()
    assert torch_load(tmp_path / "run" / "params.pt")["version"] >= 10


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=False)
