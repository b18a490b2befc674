"""collsync.ending: the one record of how a process ends, its exit hook, its excepthook and the README's table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from collsync import ending

README = Path(__file__).parents[2] / "README.md"


def test_the_readme_table_is_the_endings():
    """The README's "How a process ends" table has one row per `ENDINGS` entry, in order, word for word."""
    text = README.read_text()
    table = text[text.index("| ending | exit status | how | when |") :].split("\n\n")[0].splitlines()[2:]
    assert table == [f"| {e.name} | {e.status} | {e.how} | {e.when} |" for e in ending.ENDINGS]


def _run(code: str) -> subprocess.CompletedProcess:
    head = "from collsync import ending\n"
    return subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True, timeout=60)


# Enough of an mpi4py communicator for ending: a size, a rank, and an Abort that says so.
COMM = (
    "class Comm:\n"
    "    def Get_size(self): return 2\n"
    "    def Get_rank(self): return 1\n"
    "    def Abort(self, code): print(f'abort {code}', flush=True)\n"
    "ending.ABORT_GRACE_S = 0.0\n"
)


def test_hooks_run_in_order_then_the_recorded_leave():
    proc = _run(
        "ending.at_exit(lambda: print('first', flush=True))\n"
        "ending.at_exit(lambda: print('second', flush=True))\n"
        "ending.leave_at_exit(status=3)\n"
        "print('script end', flush=True)\n"
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == ["script", "end", "first", "second"]


def test_an_abort_recorded_wins_over_a_leave():
    proc = _run(COMM + "ending.abort_at_exit(Comm(), 0)\nending.leave_at_exit(status=5)\n")
    assert proc.stdout.split() == ["abort", "0"] and proc.returncode == 0, proc.stderr


def test_an_uncaught_exception_ends_the_job_naming_the_rank():
    """The hooks registered for a normal exit (a front's shutdown, which would wait for the other ranks) never run."""
    proc = _run(
        COMM + "ending.watch_failures(Comm(), lambda: 'worker 1 (rank 1 of 2 on n)')\n"
        "ending.at_exit(lambda: print('shutdown', flush=True))\n"
        "raise RuntimeError('boom')\n"
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.split() == ["abort", "1"]
    assert "Traceback" in proc.stderr and "collsync: worker 1 (rank 1 of 2 on n): RuntimeError: boom:" in proc.stderr


def test_a_quiet_exception_is_one_line_and_status_2():
    proc = _run(
        COMM + "ending.REPORT_GRACE_S = 0.0\n"
        "class Lost(Exception): pass\n"
        "ending.watch_failures(Comm(), lambda: 'w', quiet=(Lost,))\n"
        "raise Lost('rank 3 on n did not arrive')\n"
    )
    assert proc.returncode == 2 and proc.stdout.split() == ["abort", "2"], proc.stderr
    assert proc.stderr.strip() == "collsync: rank 3 on n did not arrive"


def test_a_single_rank_fails_as_python_does():
    """One rank alone: no abort, Python's traceback and status 1, and the exit hooks still run."""
    proc = _run(
        "class One:\n    def Get_size(self): return 1\n"
        "ending.watch_failures(One(), lambda: 'w')\n"
        "raise RuntimeError('alone')\n"
    )
    assert proc.returncode == 1 and "RuntimeError: alone" in proc.stderr and "ending the job" not in proc.stderr


def test_a_stop_request_is_held_until_cleared():
    ending.clear_stop()
    assert ending.stop_requested() is None
    ending.request_stop(15)
    assert ending.stop_requested() == 15
    ending.clear_stop()
    assert ending.stop_requested() is None


def test_sigusr1_is_ignored_once_the_exit_hook_ran():
    """A finished rank that gets SIGUSR1 while it exits (MPICH's notice that another rank left without
    MPI_Finalize) must not die of it: Python's finalization puts the stop handler back to the default, which kills
    (status 10). So the exit hook ignores it; an exit function that runs after it (registered before) sees that."""
    proc = _run(
        "import atexit, signal\n"
        "from collsync import checkpoint\n"
        "atexit.register(lambda: print(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN, flush=True))\n"
        "checkpoint.install()\n"
        "ending.at_exit(lambda: print(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN, flush=True))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
