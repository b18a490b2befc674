"""Runs that go on without a lost worker (runtime=mpi): a worker stopped (SIGSTOP) or killed (SIGKILL) mid-run is
lost at the deadline; the others finish every step, the summary lists the lost ranks, the job exits 0 by itself,
and the trace's invariants hold (no update applied twice, no gradient of a lost worker in a later update).

A killed rank needs a launcher that keeps the others: Open MPI's `mpirun --enable-recovery`. MPICH's mpiexec ends
every rank once one dies by a signal, `-disable-auto-cleanup` or not (README, Lost workers); there the workers are
stopped instead, which the same code sees the same way (a rank run under `collsync.keepalive` is the exception:
test_keepalive.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from collsync.checks import check_trace
from collsync.lost import END_PATIENCE_S
from collsync.policy import asynchronous, backup
from collsync.trace import Trace
from tests.integration.hits import (
    MPICH,
    OPENMPI_RECOVERY,
    Hit,
    Launcher,
    ended,
    rank_pids,
    run_hitting,
    train_command,
    watched,
    when_checkpointed,
)

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks' processes through /proc"),
]

# The deadline a lost worker is given (start-up is bounded by it too: 5 s failed at load 19 on two cores), and how
# often rank 0 writes the checkpoint the hits are timed by.
DEADLINE = 10
FAST = ["optimizer=sgd", f"sync.deadline={DEADLINE}", "checkpoint.every=50"]
# From the last hit to the end of the job: the deadline, the training left (seconds at ~100 updates/s under load),
# and the end's bound: twice the grace (3 x the deadline, at most 30 s) for rank 0 to write the run folder.
BOUND = DEADLINE + 90 + 2 * 30


def _launcher(launcher: Launcher) -> Launcher:
    if not launcher.available():
        pytest.skip(f"{launcher.name}: no {launcher.head[0]} (scripts/setup.sh; Open MPI: scripts/setup_openmpi.sh)")
    return launcher


def _finished_without(hit: Hit, ranks: list[int], steps: int) -> None:
    """Every step trained, exit 0 with a warning, `lost` names exactly `ranks` (with host and last update)."""
    assert hit.returncode == 0, hit.stderr[-3000:]
    assert "incomplete" not in hit.summary
    assert sorted(x["rank"] for x in hit.summary["lost"]) == ranks
    assert all(x["host"] and x["last_update"] is not None for x in hit.summary["lost"]), hit.summary["lost"]
    assert len(hit.trace.of("apply")) == steps
    assert "finished without lost worker(s)" in hit.stderr


def test_async_goes_on_without_a_stopped_worker(tmp_path):
    hit = run_hitting(_launcher(MPICH), tmp_path, 4, ["sync=async", *FAST], 3000, [(100, 2, signal.SIGSTOP)], BOUND)
    _finished_without(hit, [2], 3000)
    counts = check_trace(hit.trace, asynchronous(deadline=DEADLINE), 3)  # no lost gradient in a later update
    assert counts["pushed"] == counts["applied"] + counts["dropped"]
    assert hit.took < BOUND, hit.took


def test_async_goes_on_without_a_killed_worker(tmp_path):
    """Open MPI with recovery: the killed worker's rank is gone; the server loses it at the deadline and the
    survivors leave without waiting for it (no MPI_Finalize)."""
    hit = run_hitting(
        _launcher(OPENMPI_RECOVERY), tmp_path, 4, ["sync=async", *FAST], 3000, [(100, 2, signal.SIGKILL)], BOUND
    )
    _finished_without(hit, [2], 3000)
    counts = check_trace(hit.trace, asynchronous(deadline=DEADLINE), 3)
    assert counts["pushed"] == counts["applied"] + counts["dropped"]
    assert hit.took < BOUND, hit.took


@pytest.mark.parametrize(
    ("launcher", "sig"), [(MPICH, signal.SIGSTOP), (OPENMPI_RECOVERY, signal.SIGKILL)], ids=["stopped", "killed"]
)
def test_backup_goes_on_without_two_lost_workers(tmp_path, launcher, sig):
    """The issue's shape is 8 workers with backups=2; on two shared cores (load 7-13) that run takes about two
    minutes, so 6 workers with backups=2 keep the same promise (two lost at different times, the quorum of 4
    still met) in a bounded time."""
    hits = [(50, 2, sig), (200, 5, sig)]
    hit = run_hitting(_launcher(launcher), tmp_path, 7, ["sync=backup", "sync.backups=2", *FAST], 400, hits, BOUND)
    _finished_without(hit, [2, 5], 400)
    counts = check_trace(hit.trace, backup(2, deadline=DEADLINE), 6)
    assert counts["pushed"] == counts["applied"] + counts["dropped"]
    lost = {e["worker"]: e for e in hit.trace.of("lost")}
    assert sorted(lost) == [1, 4]
    # No update after the last one a lost worker was part of holds its gradient: those came from live workers.
    for event in hit.trace.of("apply"):
        late = [w for w in event["workers"] if w in lost and event["version"] > lost[w]["last_update"]]
        assert not late, event


# The run folder is written this long at most after training ended, where a worker is still out then (the server's
# patience, lost.END_PATIENCE_S, plus writing it, on two busy cores).
WRITTEN = 60


def _written(run: Path, proc, err: list[str], bound: float) -> dict:
    """The summary.json rank 0 writes while the job still waits on a worker, read as soon as it is whole."""
    path = run / "summary.json"
    end_at = time.monotonic() + bound
    while time.monotonic() < end_at:
        assert proc.poll() is None, "the job ended before the run folder was written: " + "".join(err)[-3000:]
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.1)  # not there yet, or being written
    raise AssertionError(f"no summary.json {bound}s after training: " + "".join(err)[-3000:])


def test_the_run_folder_is_written_before_the_end_waits_on_a_stopped_worker_at_the_default_deadline(tmp_path):
    """Training ends long before a stopped worker reaches the default deadline (600 s): rank 0 writes the whole
    run folder first, naming the worker it waits on (`waiting_on`), and nothing ends the job meanwhile; once the
    worker runs again (SIGCONT: what the test does instead of waiting out the deadline) it stops and the job ends
    by itself, exit 0, every step trained, nobody lost."""
    steps = 3000
    run = tmp_path / "run"
    args = train_command(_launcher(MPICH), tmp_path, 4, "sync=async", "optimizer=sgd", "checkpoint.every=50")
    proc, err, reader = watched([*args, f"steps={steps}"], tmp_path, MPICH.env)
    with ended(proc) as pids:
        when_checkpointed(run, proc, err, 100)
        pids += rank_pids(f"hydra.run.dir={run}", 2)
        assert pids, "rank 2 not found"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        written = _written(run, proc, err, 120 + WRITTEN)
        assert time.monotonic() - stopped < 600  # well before the deadline
        assert (run / "params.pt").is_file() and (run / "trace.jsonl").is_file()
        assert [x["rank"] for x in written["waiting_on"]] == [2] and "lost" not in written
        assert len(Trace.read_jsonl(run / "trace.jsonl").of("apply")) == steps
        time.sleep(5)
        assert proc.poll() is None, "the job ended while it waited on the stopped worker: " + "".join(err)[-3000:]
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=120)
        reader.join(timeout=10)
    text = "".join(err)
    assert proc.returncode == 0, text[-3000:]
    final = json.loads((run / "summary.json").read_text())
    assert "waiting_on" not in final and "lost" not in final and "incomplete" not in final, final
    trace = Trace.read_jsonl(run / "trace.jsonl")
    assert len(trace.of("apply")) == steps
    counts = check_trace(trace, asynchronous(), 3)
    assert counts["pushed"] == counts["applied"] + counts["dropped"]
    assert "waiting for worker(s) rank 2" in text


def test_a_worker_stopped_near_the_end_is_lost_at_a_short_deadline_after_the_run_folder_was_written(tmp_path):
    """Stopped a third of the run before its end (training ends a few seconds later, before the deadline), the
    worker is still out when training ends: the run folder is written naming it (`waiting_on`), the worker is
    lost at the deadline, the folder written again with `lost`, and the job ends by itself, exit 0. (A worker
    stopped after it left, inside the final teardown, is another case: MPI_Finalize waits for it.) Paced at 10 ms
    a gradient: unpaced, an idle machine trained 900 updates/s, the last 1,000 ended before the checkpoint at 2,000
    was seen, and the worker was stopped after it had left (CI: no `lost`, the job ended by the grace's abort)."""
    steps, deadline = 3000, 20
    paced = ["stragglers=none", "runtime.inject_stragglers=true", "runtime.time_scale=0.01"]  # <= 300 updates/s
    overrides = ["sync=async", "optimizer=sgd", f"sync.deadline={deadline}", "checkpoint.every=50", *paced]
    hit = run_hitting(_launcher(MPICH), tmp_path, 4, overrides, steps, [(2000, 2, signal.SIGSTOP)], BOUND)
    _finished_without(hit, [2], steps)
    assert "waiting_on" not in hit.summary
    assert hit.took < BOUND, hit.took
    lost, last = hit.trace.of("lost")[0]["t"], hit.trace.of("apply")[-1]["t"]
    if lost > last + END_PATIENCE_S:  # lost at the end, not during training (a loaded machine may train slower)
        assert "waiting for worker(s) rank 2" in hit.stderr, hit.stderr[-3000:]
