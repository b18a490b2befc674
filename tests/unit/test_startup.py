"""The start-up watchdog (collsync/runtime/startup.py) without MPI: the deadline each entry point arms it with, the
line it writes, the Slurm step it cancels, how `collsync-run` reads its line, and the mechanism itself on a process
that holds Python's GIL in C (as MPI_Init does inside mpi4py's import), where no Python thread could run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collsync import cli
from collsync.policy import DEADLINE
from collsync.runtime import mpi_world, startup
from collsync.supervise import decide, observe

LAUNCHED = {"PMI_SIZE": "4", "PMI_RANK": "1"}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """`startup.arm`, MPI_Init and `mpi_up` recorded instead of run; `mpi_world.world` a stub (no MPI in-process)."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(startup, "arm", lambda prog, deadline: calls.append((prog, deadline)))
    monkeypatch.setattr(startup, "mpi_up", lambda: calls.append(("mpi_up", None)))
    monkeypatch.setattr(cli, "_start_mpi", lambda: calls.append(("MPI_Init", None)))
    monkeypatch.setattr(mpi_world, "world", lambda: None)
    for var, value in LAUNCHED.items():
        monkeypatch.setenv(var, value)
    return calls


@pytest.mark.parametrize(
    ("argv", "deadline"),
    [
        ([], DEADLINE),
        (["sync=async"], DEADLINE),
        (["sync=async", "sync.deadline=15"], 15.0),
        (["++sync.deadline=2.5"], 2.5),
        (["sync.deadline=null"], None),
        (["sync.deadline=0"], DEADLINE),  # refused by the config once composed, which names it
        (["sync.deadline=soon"], DEADLINE),
    ],
)
def test_collsync_train_arms_the_watchdog_with_the_run_deadline_before_mpi(recorded, monkeypatch, argv, deadline):
    monkeypatch.setattr(sys, "argv", ["collsync-train", *argv])
    cli._check_world()
    assert recorded == [("collsync-train", deadline), ("MPI_Init", None), ("mpi_up", None)]


def test_the_default_deadline_is_the_policies(recorded, monkeypatch):
    """Nothing on the command line: the watchdog gets policy.DEADLINE, which every sync option's default is."""
    monkeypatch.setattr(sys, "argv", ["collsync-train"])
    cli._check_world()
    assert recorded[0] == ("collsync-train", 600.0) and DEADLINE == 600.0
    options = sorted((Path(cli.CONF_DIR) / "sync").glob("*.yaml"))
    assert options
    for option in options:
        assert "\ndeadline: 600.0\n" in option.read_text(), option.name


# collsync-train in a fresh interpreter, as a launcher starts it, with `arm` replaced by a report of what had loaded.
_ARMS_FIRST = """
import json, os, sys
from collsync.runtime import startup
def arm(prog, deadline):
    loaded = sorted(m for m in ("torch", "numpy", "mpi4py.MPI") if m in sys.modules)
    print(json.dumps([prog, deadline, loaded]), flush=True)
    os._exit(0)
startup.arm = arm
sys.argv = ["collsync-train", "sync=async", "sync.deadline=15"]
from collsync import cli
cli.train()
"""


def test_collsync_train_arms_the_watchdog_before_torch_loads():
    """The deadline counts from `arm`: torch's import (seconds, more with several ranks to a core: 14 s measured
    with 4 ranks under Open MPI's mpirun here) must come after it, or a job whose rank never starts ends that much
    later than the deadline."""
    env = {**os.environ, **LAUNCHED}
    env.pop(startup.STALL_ENV, None)
    proc = subprocess.run([sys.executable, "-c", _ARMS_FIRST], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == ["collsync-train", 15.0, []]


class _Armed(Exception):
    """Raised by the stub `arm` to stop `init` before it imports mpi4py."""


@pytest.mark.parametrize(
    ("kwargs", "deadline"),
    [({}, DEADLINE), ({"deadline": 12.0}, 12.0), ({"sync": "backup", "deadline": 7.0}, 7.0)],
)
def test_collsync_torch_init_arms_the_watchdog_before_mpi(monkeypatch, kwargs, deadline):
    from collsync.torch import _world

    def arm(prog: str, given: float | None) -> None:
        raise _Armed(prog, given)

    monkeypatch.setattr(startup, "arm", arm)
    with pytest.raises(_Armed) as caught:
        _world.init(**kwargs)
    assert caught.value.args == ("collsync", deadline)


def test_the_line_names_the_rank_the_size_the_launcher_announced_and_the_host():
    text = startup.line("collsync-train", 15.0, {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"}, "node7")
    assert "\n" not in text
    assert text.startswith("collsync-train: rank 3 of 4 on node7: start-up: MPI's start-up (MPI_Init) did not ")
    assert "within deadline=15s" in text and "(OMPI_COMM_WORLD_SIZE=4)" in text


def test_a_short_deadline_is_named_as_too_short_for_the_start_up(monkeypatch):
    """Issue 36: under a deadline shorter than a start-up takes, every rank may arrive late: the MPI_Init line says
    so beside its own reading, and the exchange, whose roll call finds every rank, says only that (no empty list
    of lost ranks), with a value to give instead. A long deadline's line is unchanged."""
    env = {"PMI_SIZE": "3", "PMI_RANK": "1"}
    assert startup.line("collsync-train", 0.01, env, "node7").endswith(
        "; if every rank says so, they may all have started, only later: deadline=0.01s is too short for the "
        "start-up: give sync.deadline=60 or more (collsync.torch: init(deadline=60))"
    )
    assert startup.line("collsync-train", 600.0, env, "node7").endswith("so that the launcher ends the job")

    class Never:
        def Test(self) -> bool:  # noqa: N802 - mpi4py's name
            return False

    class Comm:
        def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
            return 3

        def Iallgather(self, *buffers: object) -> Never:  # noqa: N802 - mpi4py's name
            return Never()

    monkeypatch.setattr(mpi_world, "roll_call", lambda comm, window: [])
    monkeypatch.setattr(mpi_world, "rank_prefix", lambda comm: "collsync-train: rank 0 of 3 on node7")
    with pytest.raises(mpi_world.RankLost) as caught:
        mpi_world.hello(Comm(), 0.01)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "collsync-train: rank 0 of 3 on node7: start-up: every rank of 3 arrived, but not within deadline=0.01s of "
        "this one: deadline=0.01s is too short for the start-up: give sync.deadline=60 or more (collsync.torch: "
        "init(deadline=60))"
    )


def test_the_backstop_on_the_exchange_comes_after_its_own_report():
    """Once MPI is up, `hello` waits `deadline`, then its roll call (up to ROLL_WINDOW_S), then reports (3 s for a
    rank other than 0, 1 s before MPI_Abort): the backstop leaves room beyond all of it."""
    for deadline in (1.0, 10.0, 600.0):
        roll = min(mpi_world.ROLL_WINDOW_S, max(1.0, deadline))
        assert startup.exchange_bound(deadline) >= deadline + roll + 10.0


@pytest.mark.parametrize(
    ("env", "step"),
    [
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"}, "7.0"),
        # MPICH's mpiexec inside an allocation: the ranks are in its proxies' step, one task a node
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, ""),
        ({"SLURM_JOB_ID": "7"}, ""),  # a batch script's own shell
        ({}, ""),
    ],
)
def test_the_child_cancels_only_a_step_whose_tasks_are_the_ranks(env, step):
    assert startup.slurm_step({"PMI_SIZE": "4", "PMI_RANK": env.get("SLURM_PROCID", "2"), **env}) == step


def test_collsync_run_reads_the_start_up_line_as_one_lost_rank(tmp_path):
    """The waiting ranks cannot know which rank never started: one lost, unnamed (never the rank that says it),
    and the job is restarted on one rank fewer."""
    output = "\n".join(startup.line("collsync-train", 15.0, {"PMI_SIZE": "4", "PMI_RANK": str(r)}) for r in (0, 1, 3))
    seen = observe(1, output, tmp_path, time.time())
    assert seen.died and not seen.lost
    decision = decide(seen, ranks=4, min_ranks=1, restarts_left=1)
    assert decision.restart and decision.ranks == 3


# A process that arms the watchdog, then holds the GIL in C for a minute (ctypes' PyDLL keeps it through the call,
# as mpi4py's import does through MPI_Init); with DISARM it disarms first and exits 0 after a few seconds.
_HOLDER = """
import ctypes, sys, time
from collsync.runtime import startup
startup.arm("collsync-test", float(sys.argv[1]))
if sys.argv[2:] == ["disarm"]:
    startup.mpi_up()
    startup.disarm()
    time.sleep(float(sys.argv[1]) + startup.EXIT_GRACE_S + 1)
    print("still here", flush=True)
    sys.exit(0)
ctypes.PyDLL(None).sleep(60)
"""


def _hold(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, **LAUNCHED}
    env.pop(startup.STALL_ENV, None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _HOLDER, *args], capture_output=True, text=True, env=env, timeout=60)
    return proc, time.monotonic() - start


def test_a_process_held_in_c_with_the_gil_ends_after_one_line():
    proc, took = _hold("1")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "rank 1 of 4 on " in lines[0] and "within deadline=1s" in lines[0], proc.stderr
    assert 1.0 + startup.EXIT_GRACE_S <= took < 20.0, took


def test_a_disarmed_watchdog_says_nothing_and_leaves_no_child():
    proc, _ = _hold("1", "disarm")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "still here\n", "")


# A rank that ends inside MPI's start-up (MPI_Init failing aborts it) where srun launched it: DIED says so and
# cancels the step; a `scancel` on PATH records what it was asked.
_DIES = """
import os, sys
from collsync.runtime import startup
startup.arm("collsync-test", 30.0)
if sys.argv[1:] == ["up"]:
    startup.mpi_up()
os._exit(15)
"""


@pytest.mark.parametrize("up", [False, True], ids=["inside-mpi-init", "after-mpi-init"])
def test_a_rank_that_dies_inside_mpi_init_under_srun_cancels_its_step(tmp_path, up):
    """A plain `srun` keeps a step for as long as any task lives, and one stopped before it started never ends: a
    rank whose MPI_Init failed (its child sees the pipe close before "UP") cancels the step in one line; one that
    ended after MPI_Init returned leaves the step to the launcher and its own error."""
    record = tmp_path / "scancel.args"
    (tmp_path / "scancel").write_text(f'#!/bin/sh\necho "$@" > {record}\n')
    (tmp_path / "scancel").chmod(0o755)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "1"}
    env = {**os.environ, **LAUNCHED, **slurm, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env.pop(startup.STALL_ENV, None)
    args = [sys.executable, "-c", _DIES, *(["up"] if up else [])]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    # the child holds the rank's stderr, so the run returns once the child is done too
    assert proc.returncode == 15
    if up:
        assert not record.exists() and proc.stderr == "", proc.stderr
    else:
        assert record.read_text().split() == ["--quiet", "7.0"]
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("collsync-test: rank 1 of 4 on "), proc.stderr
        assert "ended inside MPI's start-up" in lines[0] and "cancelling Slurm step 7.0" in lines[0], lines[0]
