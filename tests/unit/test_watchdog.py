"""A worker's watchdog (`collsync.runtime.watchdog`): a thread that ends the process, with one line naming the rank
and its servers, once the servers have not answered for its bound, even while the main thread is blocked (here in
a sleep standing for an MPI call towards an unreachable host); and that never fires while answers come."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from collsync.runtime.watchdog import EXIT_CODE, Watchdog

SCRIPT = """
import time
from collsync.runtime.watchdog import Watchdog

answered = [time.monotonic()]
watchdog = Watchdog(lambda: answered[0], {bound}, "rank 3 on node2: worker 2", "rank 0 on node0").start()
end = time.monotonic() + {run}
while time.monotonic() < end:
    if {answers}:
        answered[0] = time.monotonic()
    time.sleep(0.2)  # the main thread busy or blocked: the watchdog is the one that looks
watchdog.stop()
print("finished", flush=True)
"""


def _run(bound: float, run: float, answers: bool) -> tuple[subprocess.CompletedProcess[str], float]:
    code = textwrap.dedent(SCRIPT.format(bound=bound, run=run, answers=answers))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


def test_a_silent_server_ends_the_worker_with_one_line_naming_it():
    proc, took = _run(bound=1.0, run=30.0, answers=False)
    assert proc.returncode == EXIT_CODE, proc.stderr
    assert "finished" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "rank 3 on node2: worker 2" in lines[0] and "rank 0 on node0" in lines[0], lines
    assert took < 15, took  # the bound and the thread's period, not the main thread's 30 s


def test_answers_keep_the_worker_and_stop_disarms_it():
    proc, _ = _run(bound=1.0, run=3.0, answers=True)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr


def test_silent_for_counts_from_the_last_answer():
    answered = time.monotonic() - 5.0
    watchdog = Watchdog(lambda: answered, 60.0, "rank 1", "rank 0")
    assert 5.0 <= watchdog.silent_for() < 6.0
