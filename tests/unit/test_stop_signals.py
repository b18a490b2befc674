"""Stop signals (collsync.checkpoint): before training starts a start-up wait ends the process at once with
128 + the signal's number and one line; during training a first signal is only a request, and a second one of any
kind ends the process at once."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")

PRELUDE = "import os, signal, time\nfrom collsync import checkpoint\ncheckpoint.install()\n"


def _run(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, timeout=120)


def test_a_signal_seen_by_a_start_up_wait_ends_the_process_at_once():
    proc = _run(
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "assert checkpoint.requested() == signal.SIGTERM\n"
        "checkpoint.stop_now('during start-up')\n"
        "print('went on')\n"
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "went on" not in proc.stdout
    assert proc.stderr.strip() == "collsync: stopped by SIGTERM during start-up"


def test_one_signal_is_a_request_and_a_second_ends_the_process_at_once():
    proc = _run(
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "print('requested', checkpoint.requested(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(5)\n"
        "print('went on')\n"
    )
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert proc.stdout.split() == ["requested", str(int(signal.SIGUSR1))]
    assert "Traceback" not in proc.stderr and "stopped by SIGINT again" in proc.stderr


def test_without_a_signal_a_start_up_wait_goes_on():
    proc = _run("checkpoint.stop_now('during start-up')\nprint('went on')\n")
    assert proc.returncode == 0 and proc.stdout.strip() == "went on", proc.stderr
