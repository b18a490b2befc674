"""`collsync-run`: run a training job under an MPI launcher and, when it loses a rank, run it again on the ranks
left from its last checkpoint (a `collsync-train` run) or its last `hvd.elastic` commit (any other script).

    collsync-run -n 8 --max-restarts 2 -- collsync-train sync=bsp steps=5000 checkpoint.every=200
    collsync-run -n 8 --max-restarts 2 --launcher srun -- .venv/bin/python -m mpi4py -m collsync.cli sync=bsp
    collsync-run -n 4 --max-restarts 2 -- .venv/bin/python -m mpi4py train_elastic.py --epochs 5

bsp, `runtime=allreduce`, `runtime=partial` and backup with more workers lost than `sync.backups` cannot go on
inside one MPI job when a rank is lost: the run stops with its checkpoint (exit 2 after `sync.deadline` for a
stopped rank; at once, by the launcher, for a killed one). This supervisor then launches the same command again
with `resume=auto` in the same run folder on n - lost ranks, where lost is what the run left: the ranks its log and
its summary's `incomplete` line name, else 1 (the launcher reports a dead process without its rank, and a rank that
never started holds the others inside MPI's start-up, where each can only say that it waited: they end within
`sync.deadline`, `collsync.runtime.startup`); never fewer than `--min-np`. The resumed run starts at the
checkpoint's step (`runs.resume.refit` carries the server's state to the new number of workers). A job that
finished, failed without losing a rank (a config error), or was stopped by a signal is not restarted. Each restart
is one line on stderr; at the end the run folder's `summary.json` gets a `restarts` list (attempt, ranks, lost,
why, from_step). SIGTERM, SIGINT and SIGUSR1 to the supervisor go to the job (which checkpoints and stops) and end
the supervisor with the job's status, without a restart.

A run that goes on without a lost worker (`survives`: async, ssp, psp, backup within `sync.backups`, ...) is not
restarted for a killed one: under the venv's mpiexec (MPICH) its ranks run under `collsync.keepalive` with
`-disable-auto-cleanup`, so the launcher keeps the ranks left and the run finishes without the dead worker.

Any other command is a script (a Horovod-style one, `collsync.torch`): every attempt gets `COLLSYNC_ELASTIC_DIR`
(`--elastic-dir`, else a new folder `outputs/elastic/DATE/TIME`) in its environment, where `hvd.elastic`'s
`commit()` writes each commit and from which `hvd.elastic.run` resumes the relaunched job (MPICH's `mpiexec` and
`srun` pass the environment on; with Open MPI's `mpirun` on several hosts add `-x COLLSYNC_ELASTIC_DIR` to
`--launcher`). The same rules decide a restart. The world only shrinks: horovodrun's options that let it grow
(`--host-discovery-script`, a `--max-np` above `-n`) are refused.

The names follow torchrun (`--max-restarts`) and horovodrun (`-np`, `--min-np`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from collsync.supervise_target import ELASTIC_ENV as ELASTIC_ENV
from collsync.supervise_target import ELASTIC_FILE as ELASTIC_FILE
from collsync.supervise_target import Target as Target
from collsync.supervise_target import is_train as is_train
from collsync.supervise_target import resumed as resumed
from collsync.supervise_target import run_dir_of as run_dir_of
from collsync.supervise_target import survives, target

PROG = "collsync-run"
SUMMARY = "summary.json"  # the run folder's summary (collsync.rundir); named here so no torch loads for it
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # what collsync turns into "checkpoint and stop"
NOT_STARTED = b"start-up: MPI's start-up (MPI_Init) did not complete"
START_GRACE_S, END_GRACE_S = 2.0, 30.0  # NOT_STARTED (collsync.runtime.startup's line) ends a kept attempt
TAIL_BYTES = 64 * 1024  # how much of the job's output is kept to read the lost ranks from

# Lines that name a lost rank: collsync's own (the start-up roll call, a server waiting on a worker, a worker
# without its server) and the launchers' reports of a process that died (Open MPI's mpirun; srun's below).
_NAMED = (
    re.compile(r"\brank (\d+) on \S+ did not arrive"),
    re.compile(r"\bworker \d+ \(rank (\d+) on "),
    re.compile(r"no word from the server, rank (\d+) "),
    re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on\s+signal"),  # prterun wraps it
)
# srun names each task that ended badly, the first one and then those it ended itself once it ended the step
# (--kill-on-bad-exit): only the lines before it said so name lost ranks, and only a task that died of a signal (a
# collsync rank that exits with a status, 2 or 128 + n, chose to: after a deadline or a signal).
_SRUN = re.compile(r"srun: error: \S+: task (\d+): (?:Killed|Terminated|Segmentation fault|Aborted|Bus error)")
_SRUN_ENDS = re.compile(r"_step_signal: Terminating|CANCELLED AT|Force Terminated")
_ROLL = re.compile(r"rank\(s\) ([\d, -]+) of \d+ did not arrive")
# Signs that a rank stopped, died or hung without a rank the supervisor can read: counted as one lost.
_DIED = (
    "BAD TERMINATION",  # MPICH's mpiexec (Hydra): a process died by a signal
    "exited on signal",  # Open MPI
    "did not complete within deadline",  # the runtime's waits, and MPI's start-up (collsync.runtime.startup)
    "got no gradient within deadline",
    "no word from the server",
    "did not arrive",
)
_STOPPED = re.compile(r"stopped by SIG(?:TERM|INT|USR1)")


@dataclass(frozen=True)
class Outcome:
    """What one attempt left: its exit status, whether its run folder is complete, and what its output and
    summary say about lost ranks."""

    code: int  # the launcher's exit status (128 + n when it died of signal n)
    finished: bool  # this attempt wrote a summary without an `incomplete` line
    lost: frozenset[int]  # ranks named lost
    died: bool  # a rank stopped or died, named or not
    stopped: bool  # a signal asked the run to stop (it checkpointed): a preemption, not a loss


@dataclass(frozen=True)
class Decision:
    restart: bool
    ranks: int  # the ranks of the next attempt (restart) or of this one (none)
    why: str


def decide(outcome: Outcome, ranks: int, min_ranks: int, restarts_left: int) -> Decision:
    """What comes after an attempt on `ranks` ranks: stop, or restart on the ranks left (n minus the ranks named
    lost, n - 1 where none is named), never below `min_ranks` and only while restarts are left."""
    if outcome.code == 0 or outcome.finished:
        return Decision(False, ranks, "finished")
    if not outcome.died and not outcome.lost:
        why = "stopped by a signal" if outcome.stopped else f"failed (exit {outcome.code}) without losing a rank"
        return Decision(False, ranks, why)
    lost = len(outcome.lost) or 1
    named = ", ".join(str(r) for r in sorted(outcome.lost)) if outcome.lost else "one rank (not named)"
    why = f"lost rank {named}" if len(outcome.lost) == 1 else f"lost {named}"
    left = ranks - lost
    if left < min_ranks:
        return Decision(False, ranks, f"{why}: {left} rank(s) left, fewer than --min-np={min_ranks}")
    if restarts_left <= 0:
        return Decision(False, ranks, f"{why}: no restart left")
    return Decision(True, left, why)


def lost_ranks(text: str) -> frozenset[int]:
    """The ranks `text` (a job's output, a summary's `incomplete` line) names as lost."""
    found = {int(m.group(1)) for pattern in _NAMED for m in pattern.finditer(text)}
    ended = _SRUN_ENDS.search(text)
    found.update(int(m.group(1)) for m in _SRUN.finditer(text[: ended.start()] if ended else text))
    for m in _ROLL.finditer(text):
        for part in m.group(1).replace(" ", "").split(","):
            low, _, high = part.partition("-")
            if low.isdigit():
                found.update(range(int(low), int(high or low) + 1))
    return frozenset(found)


def observe(code: int, output: str, run_dir: Path | None, started: float) -> Outcome:
    """Read an attempt's outcome from its exit status, its output and what it wrote into `run_dir` since
    `started` (a summary from an earlier attempt says nothing about this one; a script has no run folder)."""
    summary = None if run_dir is None else _summary(run_dir, started)
    finished = summary is not None and "incomplete" not in summary
    text = output + ("\n" + str(summary.get("incomplete", "")) if summary is not None else "")
    lost = lost_ranks(text)
    died = bool(lost) or any(sign in " ".join(text.split()) for sign in _DIED)  # prterun wraps its lines
    return Outcome(code, finished, lost, died, bool(_STOPPED.search(text)))


def _summary(run_dir: Path, started: float) -> dict[str, Any] | None:
    path = run_dir / SUMMARY
    try:
        if path.stat().st_mtime < started:
            return None
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


# -- the job ---------------------------------------------------------------------------------------------------


def launch_command(
    launcher: str, ranks: int, command: list[str], kill_on_bad_exit: bool = True, keep: bool = False
) -> list[str]:
    """`launcher` (mpiexec, srun, or either with options of its own) starting `command` on `ranks` ranks.

    srun gets `--mpi=pmi2` (what the mpich wheel speaks) unless the launcher names one, and `--kill-on-bad-exit=1`:
    a rank that dies ends the step at once, so the restart comes now rather than after `sync.deadline`. `keep` (a
    run that goes on without a lost worker, `survives`), under the venv's mpiexec (MPICH's Hydra): each rank runs
    under `collsync.keepalive` with `-disable-auto-cleanup`, so that a rank killed is an ordinary exit to the
    launcher, which then keeps the others (it kills them all when one dies of a signal)."""
    words = shlex.split(launcher)
    if not words:
        raise ValueError("--launcher is empty: give mpiexec, srun or a path to one")
    if Path(words[0]).name == "srun":
        extra = [] if any(w.startswith("--mpi") for w in words) else ["--mpi=pmi2"]
        if kill_on_bad_exit and not any(w.startswith(("-K", "--kill-on-bad-exit")) for w in words):
            extra.append("--kill-on-bad-exit=1")
        return [*words, *extra, f"--ntasks={ranks}", *command]
    if words[0] == "mpiexec":
        # The venv's own mpiexec (the mpich wheel's) before any other on PATH: another MPI's launcher would start
        # n separate one-rank jobs.
        beside = Path(sys.executable).parent / "mpiexec"
        words[0] = str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")
        if keep:
            words += [] if "-disable-auto-cleanup" in words else ["-disable-auto-cleanup"]
            command = [sys.executable, "-m", "collsync.keepalive", "--", *command]
    return [*words, "-n", str(ranks), *command]


class Job:
    """One attempt: the launcher in a session of its own (a terminal's Ctrl-C reaches it once, through the
    supervisor, not twice), its output passed through as it comes, the last `TAIL_BYTES` of it kept."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, keep: bool = False) -> None:
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env
        )
        self.keep = keep  # the ranks run under collsync.keepalive: the launcher ends nothing by itself
        self.ending = False
        self.tail = bytearray()
        self.lock = threading.Lock()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.readers = [
            threading.Thread(target=self._copy, args=(src, dst), daemon=True)
            for src, dst in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))
        ]
        for reader in self.readers:
            reader.start()

    def _copy(self, src: IO[bytes], dst: IO[str]) -> None:
        while chunk := os.read(src.fileno(), 65536):
            dst.buffer.write(chunk) if hasattr(dst, "buffer") else dst.write(chunk.decode(errors="replace"))
            dst.flush()
            with self.lock:
                self.tail += chunk
                del self.tail[:-TAIL_BYTES]
            if self.keep and not self.ending and NOT_STARTED in chunk:
                self.ending = True
                threading.Thread(target=self._end, daemon=True).start()

    def _end(self) -> None:
        """A rank never started: under collsync.keepalive the launcher would wait for it, so it is told to end (each
        shim passes SIGTERM on, waking a stopped rank for it), and killed past the grace."""
        time.sleep(START_GRACE_S)  # the other ranks' lines first
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=END_GRACE_S)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self) -> tuple[int, str]:
        """The job's exit status (128 + n when its launcher died of signal n) and the tail of its output."""
        code = self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=10)
        with self.lock:
            text = self.tail.decode(errors="replace")
        return (128 - code if code < 0 else code), text


def passed(signum: int, keep: bool) -> int:
    """The signal the job gets for `signum` sent to the supervisor: itself, but SIGUSR1 (a stop) as SIGTERM where
    the ranks run under `collsync.keepalive`. MPICH's mpiexec passes SIGUSR1 on to the ranks through its proxies,
    from which the shim takes it as the launcher's notice that a rank died; SIGTERM stops the run the same way."""
    return signal.SIGTERM if keep and signum == signal.SIGUSR1 else signum


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _record(run_dir: Path, restarts: list[dict[str, Any]]) -> None:
    """Add the restarts to the run's summary (the last attempt wrote it), atomically."""
    path = run_dir / SUMMARY
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    summary["restarts"] = restarts
    tmp = path.with_name(f".{path.name}.restarts")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, path)


def _from_steps(run_dir: Path, resumed: list[bool]) -> list[int | None]:
    """The step each restart started at: 0 for one without a checkpoint, else the version of its `world` event
    (the run's trace marks each resume on another number of workers with one; the restarts' are the last ones, a
    requeued job's resume may come before them)."""
    try:
        with open(run_dir / "trace.jsonl") as f:
            worlds = [json.loads(line)["version"] for line in f if '"ev": "world"' in line]
    except (OSError, ValueError, KeyError):
        worlds = []
    count = sum(resumed)
    found: list[int | None] = list(worlds[-count:]) if count and len(worlds) >= count else [None] * count
    return [found.pop(0) if r else 0 for r in resumed]


def supervise(
    launcher: str, ranks: int, min_ranks: int, max_restarts: int, command: list[str], elastic_dir: str | None = None
) -> int:
    """Run `command` on `ranks` ranks, restarting it as `decide` says; returns the last attempt's exit status."""
    goal = target(command, elastic_dir)
    keep = False  # whether the attempt's ranks run under collsync.keepalive
    asked: list[int] = []  # signals the supervisor was sent: passed to the job, and no restart after them
    job: Job | None = None

    def forward(signum: int, frame: Any) -> None:
        asked.append(signum)
        if job is not None:
            job.signal(passed(signum, keep))

    for signum in FORWARDED:
        signal.signal(signum, forward)
    restarts: list[dict[str, Any]] = []
    from_checkpoint: list[bool] = []  # per restart: did it resume from a checkpoint (or a commit)
    args = goal.command
    while True:
        started = time.time()
        keep = survives(args)
        job = Job(launch_command(launcher, ranks, args, keep=keep), goal.env, keep=keep)
        if asked:
            job.signal(passed(asked[-1], keep))  # a signal that came while the launcher started
        code, output = job.wait()
        if asked:
            _say(f"stopped by {signal.Signals(asked[0]).name}: the job ended with status {code}, not restarted")
            return code
        decision = decide(observe(code, output, goal.run_dir, started), ranks, min_ranks, max_restarts - len(restarts))
        if not decision.restart:
            if restarts:
                if goal.run_dir is not None:
                    for entry, step in zip(restarts, _from_steps(goal.run_dir, from_checkpoint), strict=True):
                        entry["from_step"] = step
                    _record(goal.run_dir, restarts)
                _say(f"{decision.why} after {len(restarts)} restart(s), on {ranks} rank(s) (exit {code})")
            elif code != 0:
                _say(f"{decision.why}: not restarted (exit {code})")
            return code
        args, resumes, start = goal.restart()
        from_checkpoint.append(resumes)
        restarts.append({"attempt": len(restarts) + 2, "ranks": decision.ranks, "was": ranks, "why": decision.why})
        _say(
            f"attempt {len(restarts) + 1} of {max_restarts + 1}: {decision.why} (exit {code}); restarting on "
            f"{decision.ranks} rank(s) (was {ranks}) from {start} in {goal.where()}"
        )
        ranks = decision.ranks


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run a collsync-train job or a script under an MPI launcher; when it loses a rank, run it again "
        "on the ranks left from its last checkpoint (resume=auto in the same run folder) or, for a script, its last "
        "hvd.elastic commit (COLLSYNC_ELASTIC_DIR).",
        usage=f"{PROG} -n N [--max-restarts K] [--min-np M] [--launcher mpiexec|srun] [--elastic-dir D] -- COMMAND ...",
    )
    parser.add_argument("-n", "-np", "--np", dest="np", type=int, required=True, help="ranks of the first attempt")
    parser.add_argument(
        "--max-restarts", "--restarts", dest="restarts", type=int, default=3, help="restarts at most (default 3)"
    )
    parser.add_argument("--min-np", "--min-ranks", dest="min_np", type=int, default=1, help="never fewer ranks")
    parser.add_argument(
        "--launcher", default="mpiexec", help="mpiexec (the venv's, default), srun, or either with its own options"
    )
    parser.add_argument(
        "--elastic-dir", help="a script's hvd.elastic commit folder (default: a new outputs/elastic/DATE/TIME)"
    )
    # horovodrun's options for a world that grows: refused by name below.
    parser.add_argument("--max-np", dest="max_np", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--host-discovery-script", dest="discovery", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the job: collsync-train overrides ... (after --)")
    ns = parser.parse_args(argv)
    ns.command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not ns.command:
        parser.error("no command to run: give it after --, e.g. -- collsync-train sync=bsp")
    if ns.discovery is not None or (ns.max_np is not None and ns.max_np > ns.np):
        flag = "--host-discovery-script" if ns.discovery is not None else f"--max-np {ns.max_np} above -n {ns.np}"
        parser.error(
            f"{flag} (horovodrun's elastic growth) is not supported: the world never grows, collsync-run only "
            "relaunches on the ranks left"
        )
    if ns.np < 1 or ns.restarts < 0 or not 1 <= ns.min_np <= ns.np:
        parser.error(
            f"need -n >= 1, --max-restarts >= 0 and 1 <= --min-np <= -n (got {ns.np}, {ns.restarts}, {ns.min_np})"
        )
    return ns


def main(argv: Sequence[str] | None = None) -> None:
    """`collsync-run -n N [--max-restarts K] [--min-np M] [--launcher L] -- COMMAND ...`"""
    ns = parse(sys.argv[1:] if argv is None else argv)
    try:
        code = supervise(ns.launcher, ns.np, ns.min_np, ns.restarts, ns.command, ns.elastic_dir)
    except (ValueError, OSError) as exc:
        launcher = shlex.split(ns.launcher)[:1]
        if isinstance(exc, FileNotFoundError) and exc.filename is not None and [exc.filename] == launcher:
            exc = ValueError(  # the launcher itself: name the flag and what it takes
                f"--launcher {ns.launcher!r}: {exc.filename!r} is no command here (not on PATH, not a file): give "
                "mpiexec (the venv's, the default), srun, or a path to one, with its own options"
            )
        _say(f"error: {exc}")
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
