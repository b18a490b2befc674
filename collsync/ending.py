"""How a collsync process ends: the end state recorded in one place, one exit hook that acts on it, and one
function, `end`, that every ending other than Python's own goes through.

A rank of an MPI job cannot simply exit when something went wrong elsewhere. `MPI_Finalize` waits for every rank
of the world (MPICH's does, a lost one included, for ever), a rank that raised leaves the others waiting for it in
their next collective until the deadline, and a launcher keeps a job whose ranks merely exit waiting on a host it
can no longer reach. So each way a collsync process ends is one row of `ENDINGS` (the README's table "How a process
ends" is tested against it), and:

* `end(status, ...)` ends the process now: one line on stderr, then `MPI_Abort(status)` on the communicator given
  (the launcher ends every rank) or `os._exit(status)` (no `MPI_Finalize`);
* `leave_at_exit` / `abort_at_exit` record how to end at exit once a rank was lost, and `at_exit` what a front does
  first (collsync.torch's `shutdown`); the one exit hook (`_at_exit`) runs those, then acts on the record;
* `watch_failures` installs the one `sys.excepthook`: an exception that ends a rank's script ends the job at once,
  as Horovod's shutdown does, instead of leaving the other ranks in a collective until the deadline; so does a
  script's `sys.exit(n)` with n other than 0, seen at exit;
* `request_stop` / `stop_requested` / `stop_now` hold a stop asked for by a signal (collsync.checkpoint installs the
  handlers; start-up waits in the transport look at the request, so it lives here, below both).

This module imports no MPI: communicators are handed in, so the transport, the core's checkpoint and both fronts
can use it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from collsync.say import say

if TYPE_CHECKING:
    from mpi4py import MPI

# How long a rank that aborts waits between writing its line and aborting. MPI_Abort has the launcher kill every
# process at once, and output still in the pipes to the launcher's proxies is lost with them (seen with MPICH's
# Hydra: the error line vanished in about one run of ten); a moment's wait lets the proxies forward it first.
ABORT_GRACE_S = 1.0
# The exit status of a script that an exception ended (Python's own), and of one a deadline ended (cli._fail).
FAILED = 1
DEADLINE = 2


@dataclass(frozen=True)
class Ending:
    """One way a collsync process ends (a row of the README's table)."""

    name: str
    status: str
    how: str
    when: str


ENDINGS: tuple[Ending, ...] = (
    Ending("finished", "0", "Python's exit: mpi4py's exit hook calls `MPI_Finalize`", "every rank is there at the end"),
    Ending(
        "left",
        "0",
        "`os._exit` at exit, without `MPI_Finalize` (which would wait for the lost rank), after a linger",
        "a rank was lost and the run finished without it",
    ),
    Ending(
        "ended by rank 0",
        "0",
        "`MPI_Abort(0)` at exit, once the run folder is written: the launcher ends every rank it can reach",
        "a rank was lost (MPICH: `mpiexec` would wait for it)",
    ),
    Ending(
        "failed",
        "1",
        "one line naming the rank and the exception after its traceback, then `MPI_Abort(1)`",
        "an exception ended a rank's script",
    ),
    Ending(
        "exited",
        "n",
        "one line naming the rank and its status at exit, then `MPI_Abort(n)`",
        "a rank's script called `sys.exit(n)` with n other than 0",
    ),
    Ending(
        "stalled",
        "1",
        "one line on each waiting worker naming the collective and the workers that did not call it, then "
        "`MPI_Abort(1)`",
        "a collective some workers never called, past `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS` or the deadline",
    ),
    Ending(
        "error",
        "2",
        "one line naming the rank (rank 0's, the others wait for it), then `MPI_Abort(2)`",
        "a bad input, a rank lost where the mode cannot go on, a deadline",
    ),
    Ending(
        "cut off",
        "2",
        "one line from the worker's watchdog thread, then `os._exit(2)`",
        "a worker's servers did not answer within its silence bound",
    ),
    Ending(
        "not started",
        "1",
        "one line from the start-up watchdog's child process, then `_exit(1)` by `faulthandler`'s timer (no Python "
        "thread runs inside MPI_Init); under `srun` the child then cancels the step",
        "MPI's start-up did not complete within the deadline: a rank never started (`collsync.runtime.startup`)",
    ),
    Ending(
        "stopped",
        "128 + signal",
        "`Preempted` after a checkpoint; a second signal, or one during start-up: one line, then `os._exit`",
        "SIGTERM, SIGINT or SIGUSR1",
    ),
)


@dataclass
class _Record:
    """The end state: how to end at exit, and what to run first."""

    mode: Literal["finish", "leave", "abort"] = "finish"
    status: int = 0
    linger: float = 0.0
    comm: MPI.Comm | None = None  # what `abort_at_exit` aborts
    first: list[Callable[[], None]] = field(default_factory=list)
    failure: BaseException | None = None
    exit_status: object = None  # what the script gave `sys.exit` (or, under `python -m mpi4py`, `SystemExit`)
    stop: int | None = None  # the signal that asked the run to stop


_RECORD = _Record()


def end(
    status: int, line: str | None = None, comm: MPI.Comm | None = None, linger: float = 0.0, defer: float = 0.0
) -> NoReturn:
    """End this process now with `status`: after `defer` seconds (a rank other than 0 lets rank 0's line come first,
    and rank 0's abort end it meanwhile) one `line` on stderr; then `MPI_Abort(status)` on `comm` once the output had
    time to reach the launcher, or, without `comm`, `os._exit(status)` after `linger` seconds (no `MPI_Finalize`)."""
    time.sleep(defer)
    if line is not None:
        say(line)
    sys.stdout.flush()
    sys.stderr.flush()
    if comm is not None:
        time.sleep(ABORT_GRACE_S)
        comm.Abort(status)
        # Abort returns only where the world is already being torn down (another rank aborted first): leave anyway.
    else:
        time.sleep(linger)
    os._exit(status)


def abort(comm: MPI.Comm, status: int) -> NoReturn:
    """Abort the world with `status` once this rank's stdout and stderr have had time to reach the launcher."""
    end(status, comm=comm)


# -- at exit --------------------------------------------------------------------------------------------------


def _hook() -> None:
    """(Re-)register the one exit hook last, so that it runs first: before mpi4py's (which finalizes MPI)."""
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def at_exit(first: Callable[[], None]) -> None:
    """Run `first` at exit before the record is acted on; hooks run in the order given (a front's `shutdown`,
    registered at its `init`, before what a later loss adds)."""
    if first not in _RECORD.first:
        _RECORD.first.append(first)
    _hook()


def leave_at_exit(status: int = 0, linger: float = 0.0) -> None:
    """After a rank was lost: end this process at exit with `status` and without `MPI_Finalize`, which would wait
    for the lost rank (MPICH's waits on every rank of the world; Open MPI's on windows a dead rank never frees).
    What the process does before it exits (rank 0 writing the run folder, Hydra's own end) runs as usual.
    `linger`: seconds to wait first, for another rank to end the job (MPICH's Hydra sends SIGUSR1, a stop to
    collsync, to the ranks left once one exits without `MPI_Finalize`: a rank that leaves early stops one still
    writing the run folder). An `abort_at_exit` already recorded wins."""
    if _RECORD.mode != "abort":
        _RECORD.mode, _RECORD.status, _RECORD.linger = "leave", status, linger
    _hook()


def abort_at_exit(comm: MPI.Comm, status: int = 0) -> None:
    """Rank 0 after a rank was lost: at exit, once the run folder is written, `MPI_Abort(status)` instead of
    `MPI_Finalize`. Finalize would wait for the lost rank for ever, and so would the launcher for ranks that merely
    exit: MPICH's mpiexec keeps waiting for the proxy on a host it can no longer reach (measured: still waiting
    120 s after the host's link went down). An abort is the word the launcher acts on at once: it ends every rank it
    can reach and exits with the abort's status (0 under MPICH's mpiexec, measured)."""
    _RECORD.mode, _RECORD.status, _RECORD.comm = "abort", status, comm
    _hook()


def _quiet_usr1() -> None:
    """At exit, SIGUSR1 is ignored. The run is over, so Slurm's "checkpoint and stop" has nothing left to stop; and
    MPICH's Hydra (`-disable-auto-cleanup`) sends SIGUSR1 to the ranks still running once one leaves without
    `MPI_Finalize` (a rank lost, or one that left first), while Python's finalization puts a handler it installed
    back to the default, which kills: a run that finished and wrote its folder then ended with status 10."""
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def leaving() -> bool:
    """Whether this process ends without `MPI_Finalize` (a rank was lost): then nothing waits for every rank."""
    return _RECORD.mode != "finish"


def _at_exit() -> None:
    record = _RECORD
    _quiet_usr1()
    _end_if_exited(record.exit_status)
    for first in list(record.first):
        first()
    if record.mode == "abort":
        assert record.comm is not None
        end(record.status, comm=record.comm)
    if record.mode == "leave":
        end(record.status, linger=record.linger)


# -- lost ranks -----------------------------------------------------------------------------------------------


def lost_rank(rank: int, host: str | None, last_update: int | None, world_rank: int | None = None) -> dict[str, Any]:
    """The one record of a rank the others went on without, as `summary.json`'s `lost` and `opt.lost` list it:
    its rank (among the workers, or in the run's world), its host, the last update it was part of (None: not
    known), and in a `collsync.torch` script its rank in the whole MPI world."""
    record: dict[str, Any] = {"rank": rank}
    if world_rank is not None:
        record["world_rank"] = world_rank
    return {**record, "host": host, "last_update": last_update}


# -- failures -------------------------------------------------------------------------------------------------

_previous_hook = sys.excepthook


@dataclass
class _Watch:
    comm: MPI.Comm
    who: Callable[[], str]
    quiet: tuple[type[BaseException], ...]


_WATCH: _Watch | None = None


def watch_failures(comm: MPI.Comm, who: Callable[[], str], quiet: tuple[type[BaseException], ...] = ()) -> None:
    """Install the one `sys.excepthook` (once): an exception that reaches the top of a script on one rank of `comm`
    ends the job. Without it the other ranks wait for this one in their next collective (and the exit's own
    `shutdown` waits for them) until the deadline; Horovod ends such a job as well. Its traceback is shown as Python
    shows it, then one line naming the rank (`who()`) and the exception, then `MPI_Abort(1)`. Exceptions of a
    `quiet` type (a rank lost: its message says everything) get only the line, and end with status 2."""
    global _WATCH, _previous_hook
    _WATCH = _Watch(comm, who, quiet)
    _watch_exits()
    if sys.excepthook is not _excepthook:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def _exit(status: str | int | None = None) -> NoReturn:
    """`sys.exit` while failures are watched: the status is recorded for the exit hook, then Python's own."""
    _RECORD.exit_status = status
    _sys_exit(status)


_sys_exit = sys.exit


def _watch_exits() -> None:
    """Record the status a script exits with: `sys.exit` is wrapped, and under `python -m mpi4py` the function its
    runner hands a `SystemExit` to (which also sees `raise SystemExit(n)` and `exit(n)`). Python's exit hooks are
    not told the status, and the one that matters here (`_at_exit`) must act before `shutdown` waits for the
    others."""
    global _sys_exit
    if sys.exit is not _exit:
        _sys_exit = sys.exit
        sys.exit = _exit
    run = sys.modules.get("mpi4py.run")
    hand_over = getattr(run, "set_abort_status", None)
    if run is not None and callable(hand_over) and not getattr(hand_over, "_collsync", False):

        def set_abort_status(status: object) -> None:
            if isinstance(status, SystemExit):
                _RECORD.exit_status = status.code
            hand_over(status)

        set_abort_status._collsync = True  # type: ignore[attr-defined]
        run.set_abort_status = set_abort_status  # type: ignore[attr-defined]


def exit_status(status: object) -> int:
    """The process status Python gives `sys.exit(status)`: None is 0, an int itself, anything else (a message) 1."""
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def _end_if_exited(status: object) -> None:
    """At exit, a script that called `sys.exit` with a status other than 0 on one rank of a watched world ends the
    job as an exception does (`_excepthook`): otherwise `shutdown` would wait for the other ranks, which wait for
    this one in their next collective, until the deadline. Horovod's shutdown ends the others' collectives as
    well. A status of 0 keeps the usual exit (the other ranks finish and meet it in `shutdown`)."""
    code = exit_status(status)
    watch = _WATCH
    if code == 0 or watch is None or watch.comm.Get_size() == 1:
        return
    end(
        code,
        f"collsync: {watch.who()}: this rank's script exited with status {code} (SystemExit({status!r})); ending the "
        f"job (MPI_Abort({code})) rather than leaving the other ranks waiting for it",
        comm=watch.comm,
    )


def failed() -> BaseException | None:
    """The exception that ended the script on this rank, if one did."""
    return _RECORD.failure


# How long a rank other than 0 waits before it reports a quiet failure itself: rank 0 reports the same loss and
# aborts the job meanwhile, so the line appears once.
REPORT_GRACE_S = 3.0


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    _RECORD.failure = exc
    watch = _WATCH
    if watch is None or watch.comm.Get_size() == 1:
        _previous_hook(kind, exc, tb)
        return
    if isinstance(exc, watch.quiet):
        end(DEADLINE, f"collsync: {exc}", comm=watch.comm, defer=REPORT_GRACE_S if watch.comm.Get_rank() else 0.0)
    _previous_hook(kind, exc, tb)
    status = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else FAILED
    end(
        status,
        f"collsync: {watch.who()}: {kind.__name__}: {exc}: this rank's script ended with an exception; ending the "
        f"job (MPI_Abort({status})) rather than leaving the other ranks waiting for it",
        comm=watch.comm,
    )


# -- stops asked for by a signal ------------------------------------------------------------------------------


def request_stop(signum: int = signal.SIGTERM) -> None:
    """Ask the run to stop as the signal `signum` would (the signal handlers, tests, callers embedding a run)."""
    _RECORD.stop = signum


def clear_stop() -> None:
    _RECORD.stop = None


def stop_requested() -> int | None:
    """The signal that asked the run to stop, or None."""
    return _RECORD.stop


def stop_now(when: str) -> None:
    """Where nothing is trained yet (start-up waits): a signal that asked the run to stop ends the process at once
    (exit 128 + its number) rather than wait for a training loop to look at the request."""
    if _RECORD.stop is not None:
        stopped(_RECORD.stop, when)


def stopped(signum: int, when: str) -> NoReturn:
    """End this process at once with 128 + `signum`, after one line (MPI's launcher then ends the other ranks)."""
    end(128 + signum, f"collsync: stopped by {signal.Signals(signum).name} {when}")
