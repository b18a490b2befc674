"""`python -m collsync.keepalive -- COMMAND ...`: run one rank's command so that its death does not end the job.

MPICH's `mpiexec` (Hydra) kills every rank once one dies of a signal, `-disable-auto-cleanup` or not; a rank that
merely exits, whatever its status, is left to the others, and the launcher sends the ranks still running SIGUSR1 as
its notice of the failure. So each rank runs under this shim, launched as

    mpiexec -disable-auto-cleanup -n 4 python -m collsync.keepalive -- python -m mpi4py -m collsync.cli ...

which starts the command as its child, in a process group of its own (Hydra signals the whole group of the process
it started), and exits with the child's status, 128 + n where the child died of signal n: an ordinary exit, to the
launcher. SIGTERM, SIGINT and SIGHUP are passed on to the child. SIGUSR1 is passed on as it came (Slurm's
"checkpoint and stop", sent by `scancel --signal` or a batch script) unless the launcher's proxy sent it (the
shim's parent): that notice goes to the child as `NOTICE_SIGNAL` where the child catches it (a collsync rank,
told by `KEEPALIVE_ENV` in its environment, `watch_notice`), else nowhere (its default action would kill). The rank
then knows that a rank died (`rank_failed`), and its waits on a silent rank end sooner than the deadline
(`patience`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Set in the child's environment: the launcher's failure notice comes as NOTICE_SIGNAL, and SIGUSR1 is a stop.
KEEPALIVE_ENV = "COLLSYNC_KEEPALIVE"
NOTICE_SIGNAL = signal.SIGUSR2
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
USAGE = "usage: python -m collsync.keepalive -- COMMAND [ARG ...]"


def exit_status(wait_status: int) -> int:
    """The status a shell would report for a child's `wait_status`: its exit code, or 128 + n for signal n."""
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def spawn(command: Sequence[str], blocked: set[signal.Signals]) -> int:
    """Start `command` in a process group of its own, with this process's signal mask and dispositions undone
    (the shim blocks what it waits for; the child must get those signals as a rank started directly would). The
    child's `KEEPALIVE_ENV` holds this shim's pid (`watch_notice` ties the rank's life to it)."""
    env = {**os.environ, KEEPALIVE_ENV: str(os.getpid())}
    path = command[0]
    return os.posix_spawnp(path, list(command), env, setpgroup=0, setsigmask=(), setsigdef=blocked)


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux's /proc; elsewhere: no)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (signum - 1) & 1)


def run(command: Sequence[str]) -> int:
    """Run `command` as the rank's child and return its status (`exit_status`), passing signals on meanwhile."""
    waited = {signal.SIGCHLD, signal.SIGUSR1, *PASSED_ON}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)  # taken by sigwaitinfo below, never by a handler
    child = spawn(command, waited)
    parent = os.getppid()
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo == signal.SIGCHLD:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid == child:
                return exit_status(status)
            continue
        signum = info.si_signo
        if signum == signal.SIGUSR1 and info.si_pid == parent:
            if not catches(child, NOTICE_SIGNAL):
                continue  # a rank that does not take the notice runs on, as one that ignores SIGUSR1 would
            signum = NOTICE_SIGNAL
        try:
            os.killpg(child, signum)  # the child's whole group: an `mpi4py` rank's helpers with it
            if signum in PASSED_ON:
                os.killpg(child, signal.SIGCONT)  # a stopped child acts on it too (one that never started, say)
        except ProcessLookupError:
            pass  # it just ended: the SIGCHLD that follows says how


# -- in the rank: the notice ----------------------------------------------------------------------------------

# How long a wait on a silent rank lasts at most once the launcher said that a rank died (`patience`): the dead one
# never answers, and a live one answers within a step; a step longer than this needs `sync.deadline` alone.
NOTICE_PATIENCE_S = 30.0
_notice: list[float] = []  # when (time.monotonic) the notice came


def _noted(signum: int, frame: Any) -> None:
    if not _notice:
        _notice.append(time.monotonic())


def watch_notice() -> None:
    """In a rank run under this shim, take the launcher's failure notice (`NOTICE_SIGNAL`) as "a rank died"
    (`rank_failed`), so that the run goes on without it where the mode can. Without the shim the notice is SIGUSR1
    itself, a stop to collsync, and the launcher ends the job anyway. Main thread only (Python's signal handlers).

    The rank also dies with its shim (`die_with_shim`)."""
    if os.environ.get(KEEPALIVE_ENV) and threading.current_thread() is threading.main_thread():
        signal.signal(NOTICE_SIGNAL, _noted)
        die_with_shim()


def die_with_shim() -> None:
    """Where the launcher kills a job it ends (an abort, its own SIGKILL) it kills the process group it started,
    the shim's, not the rank's own group: the rank would live on as an orphan until its deadline. So the rank asks
    Linux for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), as a rank started directly dies with the job, and
    exits at once if the shim is already gone. Elsewhere (no prctl) nothing changes."""
    shim = os.environ.get(KEEPALIVE_ENV, "")
    if not sys.platform.startswith("linux") or not shim.isdigit():
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != int(shim):  # the shim died before the request: nobody would send the signal
        os._exit(128 + signal.SIGKILL)


def rank_failed() -> float | None:
    """When (`time.monotonic`) the launcher said that a rank died, or None."""
    return _notice[0] if _notice else None


def patience(timeout: float | None) -> float | None:
    """How long to wait on a rank that may be dead: `timeout` (a deadline; None: for ever, as asked), or, once the
    launcher said that a rank died, at most `NOTICE_PATIENCE_S`. Waits reread it as they go, so one under way when
    the notice comes ends sooner too."""
    if not _notice or timeout is None:
        return timeout
    return min(timeout, NOTICE_PATIENCE_S)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    try:
        code = run(args)
    except OSError as exc:
        print(f"collsync.keepalive: cannot run {args[0]!r}: {exc}", file=sys.stderr)
        code = 127
    sys.exit(code)


if __name__ == "__main__":
    main()
