"""A bound on MPI's start-up: a rank that never starts ends the job within the deadline, rather than hold every
other rank inside MPI_Init for ever.

`from mpi4py import MPI` runs MPI_Init, whose exchange with the launcher (PMI's fence, PMIx's) returns only once
every rank the launcher started has joined it. A node that hangs while the job starts, or a process stopped before
it imported mpi4py, holds the others there without a word, and collsync's own deadlines (`mpi_world.hello` and the
gates after it) only begin once MPI is up. Nothing in the waiting process can bound that wait from Python: mpi4py
calls MPI_Init holding the GIL, so no Python thread and no Python signal handler runs until it returns (measured
under MPICH: a thread's ticks all came at once, when the late rank arrived). So `arm` starts two things that need
no GIL:

* a small child process (a fresh interpreter, `-I -S`, in a session of its own) that at the deadline writes the one
  line naming what this rank waited for: MPI's start-up, the rank count the launcher announced, this host;
* `faulthandler`'s timer, a thread of C, which `EXIT_GRACE_S` later ends the process with `_exit(1)` (its traceback
  goes to /dev/null): the launcher's proxies forward the line first, then see a rank exit non-zero and end the job
  (MPICH's `mpiexec`, Open MPI's `mpirun`, `srun --kill-on-bad-exit`). A plain `srun` keeps a step whose task exited
  until the others end, and the stopped one never does (measured: still waiting after 40 s): where `srun` launched
  the ranks, the child then cancels the step (`scancel`, what MPI_Abort has slurmstepd do) once the rank is gone.

Once MPI is up (`mpi_up`), the bound becomes a backstop for the start-up exchange that follows, which bounds itself
by the same deadline and names the ranks that did not arrive (it is given that time, its roll call and its report
first; `exchange_begins` restarts it where a front imports more in between); `disarm`, after the exchange, ends
both. `collsync-train` arms it before torch loads (this module and `spec` import only the standard library), so that
its deadline counts from about the process's start. The deadline is the run's own `sync.deadline` (`init(deadline=...)`
in a `collsync.torch` script): a rank missing at the start is a rank lost, and a second knob would only be set to
the same value. It counts from this rank's own `arm`, so it must also cover how much later the last healthy rank
gets there (its imports: seconds, or more from a shared file system on a large job). `faulthandler` keeps one such
timer per process: a script's own `dump_traceback_later` is replaced while the start-up is watched.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

from collsync.runtime.spec import SIZE_VARS, launched_under_mpi, launcher_rank

__all__ = [
    "STALL_ENV",
    "STALL_PID_ENV",
    "arm",
    "mpi_up",
    "exchange_begins",
    "disarm",
    "armed",
    "exchange_bound",
    "line",
    "slurm_step",
]

# Test hook: the rank whose launcher rank this names stops itself (SIGSTOP) before it arms anything or imports
# mpi4py, as a process stopped (or a node hung) while the job starts; it first writes its pid to the file
# STALL_PID_ENV names, if any, so that a test can end it.
STALL_ENV = "COLLSYNC_TEST_STALL_STARTUP"
STALL_PID_ENV = "COLLSYNC_TEST_STALL_STARTUP_PID"
# Between the line and the exit: time for the launcher's proxies to forward the line before the job is ended (as
# `mpi_world.ABORT_GRACE_S`), and for the other waiting ranks, armed a little earlier or later, to write theirs.
EXIT_GRACE_S = 3.0
# After the line, how long the child waits for the rank to exit before it kills it (SIGKILL): only where the timer
# that should have ended it was cancelled by something else in the process.
KILL_AFTER_S = 10.0
# After the exchange's own report (a rank other than 0 defers 3 s, then 1 s before MPI_Abort): room on a loaded
# machine before the backstop would speak over it.
_REPORT_S = 15.0

# The child: waits on its stdin (the pipe from the rank) until the end time; a line "END\tTEXT" re-arms it, "UP" says
# MPI_Init returned, "DONE" that the rank disarmed it. EOF after "UP" or "DONE" ends it quietly. EOF before either is
# a rank that ended inside MPI's start-up (MPI_Init failed and aborted it, or it was killed): where a plain `srun`
# launched it, the step would then be held by a rank that never started (MPI_Init can fail on the ranks that came
# while one is stopped, rather than wait), so the child writes DIED and cancels the step. At the end time it writes
# TEXT, and then, where the rank does not exit, cancels the Slurm step (once the rank is gone) or kills the rank.
_CHILD = r"""
import os, select, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
text, end, grace, kill_after, rank_pid, step, died = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(
    sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
def cancel():
    time.sleep(grace)
    try:
        subprocess.run(["scancel", "--quiet", step], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.SubprocessError):
        pass
pending, up = b"", False
while True:
    left = end - time.monotonic()
    if left <= 0:
        break
    if select.select([0], [], [], left)[0]:
        data = os.read(0, 65536)
        if not data:
            if not up and step:
                os.write(2, died.encode() + b"\n")
                cancel()
            os._exit(0)
        pending += data
        while b"\n" in pending:
            message, pending = pending.split(b"\n", 1)
            if message in (b"UP", b"DONE"):
                up = True
                continue
            when, text = message.decode().split("\t", 1)
            end = float(when)
os.write(2, text.encode() + b"\n")
gone = select.select([0], [], [], grace + kill_after)[0] and not os.read(0, 1)
if not gone and os.getppid() == rank_pid:
    os.kill(rank_pid, signal.SIGKILL)
if step:
    cancel()
"""


@dataclass
class _Watch:
    """What `arm` started: the child, the pipe to it, the file the timer's traceback goes to, and the deadline."""

    prog: str
    deadline: float
    child: subprocess.Popen[bytes] | None
    pipe: int
    sink: IO[str]


_ARMED: _Watch | None = None


def armed() -> bool:
    """Whether the start-up is watched now (between `arm` and `disarm`)."""
    return _ARMED is not None


def _announced(env: Mapping[str, str]) -> tuple[str | None, str]:
    """The launcher's variable that gives the world size, and that size ("?" where none does)."""
    var = next((v for v in SIZE_VARS if env.get(v, "").isdigit()), None)
    return var, env[var] if var is not None else "?"


def line(prog: str, deadline: float, env: Mapping[str, str] | None = None, host: str | None = None) -> str:
    """The line of a rank whose MPI start-up did not complete within `deadline`: it names the rank and the world
    size as the launcher announced them (MPI has not said yet), the host, and what it waited for."""
    env = os.environ if env is None else env
    var, size = _announced(env)
    announced = f" ({var}={size})" if var is not None else ""
    return (
        f"{prog}: rank {launcher_rank(env)} of {size} on {host or socket.gethostname()}: start-up: MPI's start-up "
        f"(MPI_Init) did not complete within deadline={deadline:g}s: it waits until all {size} ranks the launcher "
        f"announced{announced} have started, and one never did (a node that hangs, a process stopped or dead); "
        f"this rank exits (status 1) so that the launcher ends the job{_short_hint(deadline)}"
    )


def died_line(prog: str, env: Mapping[str, str] | None = None, host: str | None = None) -> str:
    """The line of a rank that ended inside MPI's start-up where `srun` launched it: its step is cancelled, since a
    plain `srun` keeps it for as long as any task lives, and a rank that never started never ends."""
    env = os.environ if env is None else env
    _, size = _announced(env)
    return (
        f"{prog}: rank {launcher_rank(env)} of {size} on {host or socket.gethostname()}: start-up: this rank ended "
        f"inside MPI's start-up (MPI_Init failed or the process died); cancelling Slurm step {slurm_step(env)} so "
        f"that no rank still starting holds it"
    )


# Below this, a deadline is likely shorter than a start-up itself (importing torch, MPI_Init): seconds on a busy node.
SHORT_S = 60.0


def _short_hint(deadline: float) -> str:
    """What the MPI_Init line adds under a short deadline: every rank may have started, only later than it."""
    if deadline >= SHORT_S:
        return ""
    return f"; if every rank says so, they may all have started, only later: {too_short(deadline)}"


def too_short(deadline: float) -> str:
    """Why every rank can arrive and still miss the deadline, and the value to give instead: a start-up that takes
    longer than `deadline` is no lost rank, and restarting on fewer ranks would not help."""
    value = f"{max(SHORT_S, 10 * deadline):g}"
    return (
        f"deadline={deadline:g}s is too short for the start-up: give sync.deadline={value} or more "
        f"(collsync.torch: init(deadline={value}))"
    )


def exchange_bound(deadline: float) -> float:
    """The backstop on the start-up exchange once MPI is up: its own deadline, its roll call (at most
    `mpi_world.ROLL_WINDOW_S`) and the time its report takes, so that it never speaks over that report."""
    return deadline + min(30.0, max(1.0, deadline)) + _REPORT_S


def _stall_for_tests() -> None:
    """The test hook: stop this process here when STALL_ENV names its launcher rank."""
    wanted = os.environ.get(STALL_ENV, "")
    if not launched_under_mpi() or not wanted.isdigit() or int(wanted) != launcher_rank():
        return
    pid_file = os.environ.get(STALL_PID_ENV)
    if pid_file:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def slurm_step(env: Mapping[str, str] | None = None) -> str:
    """The Slurm step ("job.step") whose tasks are this job's ranks, one task a rank (`srun` launched them), or ""
    otherwise: a batch script's own shell, or MPICH's `mpiexec` inside an allocation, whose ranks belong to a step
    of its proxies (one task a node), which its own launcher ends."""
    env = os.environ if env is None else env
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    tasks, task = env.get("SLURM_STEP_NUM_TASKS", ""), env.get("SLURM_PROCID", "")
    size = next((env[v] for v in SIZE_VARS if env.get(v, "").isdigit()), None)
    if not (job.isdigit() and step.isdigit() and tasks == size and task == str(launcher_rank(env))):
        return ""
    return f"{job}.{step}"


def arm(prog: str, deadline: float | None) -> None:
    """Before MPI's start-up (`from mpi4py import MPI`): end this rank with one line (`prog`'s) when MPI_Init has
    not returned within `deadline` seconds. Nothing to do without a launcher of several ranks, without a deadline
    (None: wait for ever), or once mpi4py is loaded (MPI is up already)."""
    global _ARMED
    _stall_for_tests()
    if deadline is None or _ARMED is not None or not launched_under_mpi() or "mpi4py.MPI" in sys.modules:
        return
    end = time.monotonic() + deadline
    sink = open(os.devnull, "w")  # noqa: SIM115 - held open while the timer may write to it
    read, write = os.pipe()
    try:
        child: subprocess.Popen[bytes] | None = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-c",
                _CHILD,
                line(prog, deadline),
                repr(end),
                repr(EXIT_GRACE_S),
                repr(KILL_AFTER_S),
                str(os.getpid()),
                slurm_step(),
                died_line(prog),
            ],
            stdin=read,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C or a launcher's signal to the group is for the rank
        )
    except OSError:
        child = None  # no line then, but the timer still ends the rank
    os.close(read)
    faulthandler.dump_traceback_later(deadline + EXIT_GRACE_S, exit=True, file=sink)
    _ARMED = _Watch(prog, deadline, child, write, sink)


def mpi_up() -> None:
    """MPI_Init returned: what is left is the start-up exchange, which bounds itself; keep a backstop on it."""
    _tell(_ARMED, b"UP\n")
    exchange_begins()


def _tell(watch: _Watch | None, message: bytes) -> None:
    """Write `message` to `watch`'s child, if one is watching."""
    if watch is not None:
        try:
            os.write(watch.pipe, message)
        except OSError:
            pass  # the child is gone: the timer still bounds the start-up


def exchange_begins() -> None:
    """(Re)start the backstop on the start-up exchange from now: at `mpi_up`, and again where a front loads more
    between MPI_Init and the exchange (`collsync-train` imports torch then), so that the backstop never speaks over
    the exchange's own report however long those imports took."""
    watch = _ARMED
    if watch is None:
        return
    bound = exchange_bound(watch.deadline)
    text = (
        f"{watch.prog}: rank {launcher_rank()} on {socket.gethostname()}: start-up: the start-up exchange did not "
        f"complete within {bound:g}s (deadline={watch.deadline:g}s); this rank exits (status 1) so that the "
        f"launcher ends the job"
    )
    _tell(watch, f"{time.monotonic() + bound!r}\t{text}\n".encode())
    faulthandler.dump_traceback_later(bound + EXIT_GRACE_S, exit=True, file=watch.sink)


def disarm() -> None:
    """The start-up is over (every rank arrived): stop the timer and the child."""
    global _ARMED
    watch, _ARMED = _ARMED, None
    if watch is None:
        return
    faulthandler.cancel_dump_traceback_later()
    _tell(watch, b"DONE\n")  # an end the child must not take for a rank that died starting
    os.close(watch.pipe)  # the child reads EOF and exits
    watch.sink.close()
    if watch.child is not None:
        try:
            watch.child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watch.child.kill()
            watch.child.wait()
