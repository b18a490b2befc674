"""SpecSync through `collsync.torch` (004_..., Alg. 2), launched for real: one server rank (the scheduler in its
loop) and four workers running `tests/scripts/torch_specsync.py`, the run `collsync-train sync=specsync
optimizer=sgd steps=200` makes, with the gamma stragglers injected as sleeps (x 0.02). Each launch is a few seconds
of training after the ranks import torch; the refusals need no launch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import collsync.torch as hvd
from tests.integration.test_torch_launch import ENV, MPIEXEC, ROOT, SCRIPTS

pytestmark = pytest.mark.serial  # each launch counts aborts and thrown gradients, which depend on the timing

# collsync-train's SpecSync run over MPI with these settings (final test accuracy 0.8775, best 0.8953, 40 aborts):
#   mpiexec -n 5 python -m mpi4py -m collsync.cli sync=specsync optimizer=sgd steps=200
#       runtime.inject_stragglers=true runtime.time_scale=0.02
# and 0.8909 in the simulator (runtime=sim runtime.workers=4). A script through collsync.torch is held to within
# 5 points of the MPI run, as tests/integration/test_specsync_mpi.py holds that run to the simulator's.
COLLSYNC_TRAIN_ACC = 0.8775
OVERRIDES = ["runtime=mpi", "sync=specsync", "optimizer=sgd", "steps=200"]


def launch(tmp_path: Path, form: str, *overrides: str) -> dict:
    if not MPIEXEC.exists():
        pytest.skip("the venv has no mpiexec (install the mpich extra)")
    out = tmp_path / f"{form}.json"
    script = [str(SCRIPTS / "torch_specsync.py"), "--form", form, "--out", str(out), *OVERRIDES, *overrides]
    cmd = [str(MPIEXEC), "-n", "5", sys.executable, "-m", "mpi4py", *script]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def check_counts(result: dict) -> list[dict]:
    """The scheduler and the workers agree on the aborts (> 0) and the notifies; returns each worker's counts."""
    counts = [w["specsync"] for w in result["workers"]]
    scheduler = counts[0]["scheduler"]
    assert scheduler is not None and all(c["scheduler"] == scheduler for c in counts)  # told to every worker
    assert scheduler["aborts"] == sum(c["aborts"] for c in counts) > 0
    assert scheduler["resyncs"] >= scheduler["aborts"]
    assert scheduler["notifies"] == sum(c["notifies"] for c in counts)
    assert scheduler["tunings"] > 0  # Adaptive tuned its period and rate on the notifies (Alg. 1)
    assert all(c["wasted_s"] > 0 for c in counts if c["aborts"])
    return counts


def test_wrapper_reruns_aborted_steps_on_fresh_parameters_and_trains(tmp_path):
    """`hvd.speculative(step)`: every batch is pushed exactly once; each attempt a re-sync aborted ran again on a
    newer version; aborts happened at forward and backward safe points, before the push."""
    result = launch(tmp_path, "wrapper")
    counts = check_counts(result)
    for worker, count in zip(result["workers"], counts, strict=True):
        attempts = worker["attempts"]
        assert len(attempts) == 50 + count["aborts"]  # 200 / 4 batches, and one more run per abort
        by_batch: dict[int, list[dict]] = {}
        for a in attempts:
            by_batch.setdefault(a["batch"], []).append(a)
        assert sorted(by_batch) == list(range(50))
        for runs in by_batch.values():
            assert [a["reached"] for a in runs][-1] == "pushed"
            assert all(a["reached"] in ("forward", "backward", "step") for a in runs[:-1])
            versions = [a["version"] for a in runs]
            assert versions == sorted(set(versions)), versions  # each re-run on fresher parameters
    aborted = [a["reached"] for w in result["workers"] for a in w["attempts"] if a["reached"] != "pushed"]
    assert {"forward", "backward"} & set(aborted)  # the hooks' safe points, not only step()'s
    assert result["accuracy"] >= COLLSYNC_TRAIN_ACC - 0.05, result["accuracy"]


def test_plain_loop_throws_the_stale_gradient_away_at_step(tmp_path):
    """A Horovod loop without the wrapper: forward and backward run whole; a re-sync seen at `step()` throws the
    gradient away (`opt.aborted`), the model holds fresh parameters for the next batch, and no notify follows."""
    result = launch(tmp_path, "plain")
    counts = check_counts(result)
    for worker, count in zip(result["workers"], counts, strict=True):
        attempts = worker["attempts"]
        thrown = [i for i, a in enumerate(attempts) if a["reached"] == "thrown"]
        assert len(thrown) == worker["thrown"] == count["aborts"]
        assert len(attempts) == 50 + len(thrown)  # a thrown batch is skipped; the loop runs until 50 pushes
        assert [a["batch"] for a in attempts] == list(range(len(attempts)))
        assert all(a["reached"] in ("thrown", "pushed") for a in attempts)  # never interrupted before step()
        assert all(attempts[i + 1]["version"] > attempts[i]["version"] for i in thrown if i + 1 < len(attempts))
        assert count["notifies"] == 50  # a notify follows each push, none an abort
    assert result["accuracy"] >= COLLSYNC_TRAIN_ACC - 0.05, result["accuracy"]


def test_closure_reruns_over_ssp_with_cherrypick(tmp_path):
    """`opt.step(closure)` re-runs the closure on fresh parameters; SpecSync-Cherrypick over SSP (fixed period
    and rate, wall seconds here)."""
    cherry = ["sync.base=ssp", "sync.adaptive=false", "sync.abort_time=0.01", "sync.abort_rate=0.2"]
    result = launch(tmp_path, "closure", *cherry)
    counts = [w["specsync"] for w in result["workers"]]
    scheduler = counts[0]["scheduler"]
    assert scheduler["aborts"] == sum(c["aborts"] for c in counts) > 0
    assert scheduler["abort_time"] == 0.01 and scheduler["tunings"] == 0
    for worker in result["workers"]:
        runs: dict[int, list[dict]] = {}
        for a in worker["attempts"]:
            runs.setdefault(a["batch"], []).append(a)
        assert sum(len(v) - 1 for v in runs.values()) == worker["specsync"]["aborts"]
        for attempts in runs.values():
            # Once training ended (a worker left SSP's rounds), an abort finds nothing newer to pull.
            versions = [a["version"] for a in attempts if not a["finished"]]
            assert versions == sorted(set(versions)), versions


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scheduler": "rank"}, "scheduler='rank' .a rank of its own. runs in collsync-train only"),
        ({"servers": 0}, "servers=0; SpecSync's scheduler runs on a parameter server"),
        ({"base": "bsp"}, "base='bsp' must be 'async' or 'ssp'"),
    ],
)
def test_what_stays_unsupported_is_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as info:
        hvd.sync_config("specsync", **options)
    assert "\n" not in str(info.value)


def test_speculative_needs_init_and_names_the_call():
    step = hvd.speculative(lambda: None)
    with pytest.raises(ValueError, match=r"speculative: collsync.torch is not initialised"):
        step()
