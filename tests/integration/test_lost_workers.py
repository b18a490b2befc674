"""Runs that go on without a lost worker (runtime=mpi): a worker stopped (SIGSTOP) mid-run is lost at the
deadline; the others finish every step, the summary lists the lost ranks, and the trace's invariants hold (no
gradient of a lost worker in a later update)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from collsync.checks import check_trace
from collsync.policy import asynchronous, backup
from collsync.trace import Trace
from tests.integration.test_mpi_cli import _rank_pids, _watched, command, summary

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks' processes through /proc"),
]


def _when_training(err: list[str], proc, steps: int, at: int) -> None:
    """Wait until rank 0's progress bar shows at least `at` updates."""
    end = time.monotonic() + 180
    while time.monotonic() < end:
        assert proc.poll() is None, "".join(err)[-2000:]
        counts = [int(c) for c in __import__("re").findall(rf" (\d+)/{steps} ", "".join(err[-600:]))]
        if counts and counts[-1] >= at:
            return
        time.sleep(0.02)
    raise AssertionError("training never reached update {at}: " + "".join(err)[-2000:])


def _signal(tmp_path: Path, rank: int, sig: signal.Signals) -> list[int]:
    pids = _rank_pids(f"hydra.run.dir={tmp_path / 'run'}", rank)
    assert pids, f"rank {rank} not found"
    for pid in pids:
        os.kill(pid, sig)
    return pids


def _end(pids: list[int]) -> None:
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def _run(tmp_path: Path, ranks: int, overrides: list[str], steps: int, hits: list[tuple[int, int, signal.Signals]]):
    """Launch (MPICH's mpiexec with -disable-auto-cleanup), send each (update, rank, signal) of `hits` once rank
    0's bar shows that update, wait for the summary; returns (summary, trace, seconds from the last hit to the
    summary, pids hit)."""
    args = command(tmp_path, ranks, *overrides, f"steps={steps}", "progress=true")
    args = [args[0], "-disable-auto-cleanup", *[a for a in args[1:] if a != "progress=false"]]
    proc, err, reader = _watched(args, tmp_path)
    hit: list[int] = []
    try:
        for at, rank, sig in hits:
            _when_training(err, proc, steps, at)
            hit += _signal(tmp_path, rank, sig)
        last = time.monotonic()
        end = last + 150
        while not (tmp_path / "run" / "summary.json").is_file() and time.monotonic() < end:
            time.sleep(0.2)
        took = time.monotonic() - last
        _end(hit)  # a stopped rank never exits by itself: the job ends once it is gone
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        _end(hit)
        if proc.poll() is None:
            proc.kill()
    text = "".join(err)
    assert (tmp_path / "run" / "summary.json").is_file(), text[-3000:]
    assert proc.returncode is not None
    return summary(tmp_path), Trace.read_jsonl(tmp_path / "run" / "trace.jsonl"), took


def test_async_goes_on_without_a_stopped_worker(tmp_path):
    result, trace, took = _run(
        tmp_path, 4, ["sync=async", "optimizer=sgd", "sync.deadline=5"], 3000, [(100, 2, signal.SIGSTOP)]
    )
    assert "incomplete" not in result
    assert [x["rank"] for x in result["lost"]] == [2]
    assert len(trace.of("apply")) == 3000
    counts = check_trace(trace, asynchronous(deadline=5), 3)  # no lost gradient in a later update
    assert counts["pushed"] == counts["applied"] + counts["dropped"]
    assert took < 5 + 2 * 15 + 60, took  # the deadline, the bounded end, and the training left


def test_backup_goes_on_without_two_lost_workers(tmp_path):
    """The issue's shape is 8 workers with backups=2; on two shared cores 4 workers with backups=2 keep the same
    promise (two lost at different times, the quorum of 2 still met) in a bounded time. Stopped, not killed: this
    MPICH's mpiexec ends the whole job when a rank dies by a signal, -disable-auto-cleanup or not (README)."""
    hits = [(50, 2, signal.SIGSTOP), (400, 4, signal.SIGSTOP)]
    overrides = ["sync=backup", "sync.backups=2", "optimizer=sgd", "sync.deadline=5"]
    result, trace, _ = _run(tmp_path, 5, overrides, 1500, hits)
    assert "incomplete" not in result
    assert sorted(x["rank"] for x in result["lost"]) == [2, 4]
    assert len(trace.of("apply")) == 1500
    counts = check_trace(trace, backup(2, deadline=5), 4)
    assert counts["pushed"] == counts["applied"] + counts["dropped"]
