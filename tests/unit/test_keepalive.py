"""collsync.keepalive: the rank's status passed on as an ordinary exit, signals passed on, the launcher's notice
told from a stop, and which runs collsync-run starts under it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collsync import keepalive
from collsync.supervise import launch_command, passed, survives

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, waits with sigwaitinfo")

SHIM = [sys.executable, "-m", "collsync.keepalive", "--"]
# A child that writes "ready" once its handlers are in, then the signals it gets until SIGTERM ends it.
CHILD = (
    "import os, signal, sys, time\n"
    "got = []\n"
    "for s in (signal.SIGUSR1, signal.SIGUSR2):\n"
    "    signal.signal(s, lambda n, f: got.append(signal.Signals(n).name))\n"
    "signal.signal(signal.SIGTERM, lambda n, f: (print(*got, 'TERM', flush=True), os._exit(3)))\n"
    "print('ready', os.environ.get('COLLSYNC_KEEPALIVE'), flush=True)\n"
    "while True:\n"
    "    time.sleep(0.05)\n"
)


def test_a_child_killed_by_a_signal_is_an_ordinary_exit() -> None:
    killed = subprocess.run([*SHIM, sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], timeout=60)
    assert killed.returncode == 128 + signal.SIGKILL
    assert subprocess.run([*SHIM, sys.executable, "-c", "raise SystemExit(5)"], timeout=60).returncode == 5


def test_signals_are_passed_on_and_sigusr1_from_anyone_but_the_launcher_stays_a_stop() -> None:
    """SIGUSR1 from a process other than the shim's parent reaches the child as itself (Slurm's stop); SIGTERM is
    passed on and the child's status comes back."""
    proc = subprocess.Popen([*SHIM, sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().split() == ["ready", str(proc.pid)]  # the shim's pid
    subprocess.run(["kill", "-USR1", str(proc.pid)], check=True)  # sent by a process that is not its parent
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.read().split() == ["SIGUSR1", "TERM"]
    assert proc.wait(timeout=60) == 3


def test_the_launchers_sigusr1_is_the_notice() -> None:
    """From the shim's parent (MPICH's proxy), SIGUSR1 reaches a child that catches the notice as SIGUSR2."""
    proc = subprocess.Popen([*SHIM, sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().split()[0] == "ready"
    proc.send_signal(signal.SIGUSR1)  # this test is the shim's parent
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.read().split() == ["SIGUSR2", "TERM"]
    proc.wait(timeout=60)


# A rank that took the notice (`watch_notice`) and writes its pid, then waits to be killed.
RANK = (
    "import os, time\n"
    "from collsync import keepalive\n"
    "keepalive.watch_notice()\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_rank_dies_with_its_shim() -> None:
    """The launcher ends a job by killing the process group it started, the shim's: the rank (in its own group)
    must not live on as an orphan until its deadline."""
    proc = subprocess.Popen([*SHIM, sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    rank = int(proc.stdout.readline())
    proc.kill()  # SIGKILL to the shim alone, as the launcher's cleanup sends it
    proc.wait(timeout=60)
    end = time.monotonic() + 30
    while Path(f"/proc/{rank}").exists() and time.monotonic() < end:
        zombie = Path(f"/proc/{rank}/stat").read_text().split(") ")[1].startswith("Z")
        if zombie:
            break
        time.sleep(0.05)
    gone = not Path(f"/proc/{rank}").exists() or Path(f"/proc/{rank}/stat").read_text().split(") ")[1][0] == "Z"
    assert gone, f"rank {rank} outlived its shim"


def test_patience_after_the_notice() -> None:
    assert keepalive.patience(600.0) == 600.0 and keepalive.patience(None) is None
    keepalive._notice.append(time.monotonic())
    try:
        assert keepalive.patience(600.0) == keepalive.NOTICE_PATIENCE_S and keepalive.patience(5.0) == 5.0
        assert keepalive.patience(None) is None  # sync.deadline=null: for ever, as asked
    finally:
        keepalive._notice.clear()


@pytest.mark.parametrize(
    ("overrides", "keep"),
    [
        ([], True),  # sync=backup with one backup by default
        (["sync=async"], True),
        (["sync=psp"], True),
        (["runtime=partial", "sync=backup"], True),
        (["sync=bsp"], False),
        (["sync=backup", "sync.backups=0"], False),
        (["runtime=allreduce", "sync=backup"], False),
        (["runtime=partial", "sync=async"], False),
        (["sync=ssp", "sync.max_lead=0"], False),
        (["sync=async", "sync.on_lost=stop"], False),
    ],
)
def test_which_runs_go_on_without_a_lost_worker(overrides: list[str], keep: bool) -> None:
    assert survives(["collsync-train", *overrides]) is keep


def test_a_script_is_not_started_under_the_shim() -> None:
    assert not survives([sys.executable, "train_elastic.py"])


def test_the_launch_under_the_shim() -> None:
    args = launch_command("mpiexec", 4, ["collsync-train", "sync=async"], keep=True)
    assert Path(args[0]).name == "mpiexec"
    assert args[1:] == ["-disable-auto-cleanup", "-n", "4", *SHIM, "collsync-train", "sync=async"]
    assert launch_command("srun", 4, ["x"], keep=True) == [
        "srun",
        "--mpi=pmi2",
        "--kill-on-bad-exit=1",
        "--ntasks=4",
        "x",
    ]
    assert passed(signal.SIGUSR1, True) == signal.SIGTERM and passed(signal.SIGUSR1, False) == signal.SIGUSR1
