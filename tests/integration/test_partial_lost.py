"""collsync-train's serverless backup (`runtime=partial sync=backup`) goes on without a lost rank as
collsync.torch's does (one driver, `collsync.rounds`; the same transport, `runtime/mpi_partial_lost`): a rank
stopped mid-run is lost at the deadline while at most `backups` are, the others train every step, the summary lists
it, and the job exits 0 by itself (under MPICH rank 0 ends it once the run folder is written: the stopped rank
with it). More lost than `backups`: the run stops naming them, as before."""

from __future__ import annotations

import signal
import sys

import pytest

from tests.integration.hits import MPICH, run_hitting

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not MPICH.available(), reason="the venv has no mpiexec (install the mpich extra)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks' processes through /proc"),
]

DEADLINE = 10
# Paced (100 ms of injected compute a step, no other straggling) and the stop timed inside that compute
# (`between_rounds`: the rank seen asleep there): the stop lands between two rounds, as in the API's test. A rank
# stopped inside a round it counts in (holding its block of the ring's sum) ends the run naming it, under either
# front (README, Lost workers): the transport cannot finish that round without it.
PACED = ["stragglers=none", "runtime.inject_stragglers=true", "runtime.time_scale=0.1"]
BACKUP = ["runtime=partial", "sync=backup", "optimizer=sgd", f"sync.deadline={DEADLINE}", "checkpoint.every=50", *PACED]
# What the run says where the stop landed inside a round (the limitation above): "round 121 is being summed ...".
INSIDE_A_ROUND = "partial allreduce: round "
# From the stop: the deadline, the training left, and the end (every live rank at the end, then the run folder).
BOUND = DEADLINE + 90 + 2 * 30


def test_backup_over_the_partial_allreduce_goes_on_without_a_stopped_rank(tmp_path):
    steps = 250
    for attempt in range(3):  # again only where the stop landed inside a round (the limitation above)
        run = tmp_path / str(attempt)
        run.mkdir()
        hit = run_hitting(
            MPICH, run, 4, [*BACKUP, "sync.backups=1"], steps, [(100, 2, signal.SIGSTOP)], BOUND, between_rounds=True
        )
        if hit.returncode != 2 or INSIDE_A_ROUND not in hit.stderr:
            break
    assert hit.returncode == 0, hit.stderr[-3000:]
    assert "incomplete" not in hit.summary
    assert [x["rank"] for x in hit.summary["lost"]] == [2], hit.summary.get("lost")
    assert (
        hit.summary["lost"][0]["host"] and hit.summary["lost"][0]["last_update"] >= 50
    )  # stopped once the checkpoint at 100 was out
    assert len(hit.trace.of("apply")) == steps
    assert "finished without lost worker(s) rank 2" in hit.stderr


def test_more_lost_than_backups_stops_the_run_naming_them(tmp_path):
    hits = [(100, 1, signal.SIGSTOP), (100, 2, signal.SIGSTOP)]
    hit = run_hitting(MPICH, tmp_path, 4, [*BACKUP, "sync.backups=1"], 3000, hits, BOUND)
    assert hit.returncode == 2, hit.stderr[-3000:]
    assert hit.summary.get("incomplete"), hit.summary
