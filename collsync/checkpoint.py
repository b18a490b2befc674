"""Checkpoints: what a run needs to go on exactly where it stopped, and the signals that ask it to stop.

A checkpoint is one file, `checkpoint.pt` in the run folder, written atomically (a temporary name in the same
folder, fsync, rename, fsync of the folder), so a rank killed while writing leaves the previous checkpoint whole.
It holds only tensors, numbers, strings, lists and dicts, and is read back with `torch.load(weights_only=True)`:
loading a checkpoint never runs code from the file. Its keys:

    format    FORMAT (a later layout is refused, naming both)
    config    the run's resolved config (a resume with a config that differs in a key that matters is refused)
    version   the server version (updates applied) when it was written
    server    `Server.state_dict()`: parameters, EMA, rule states, buffered gradients, what each worker sent
    shards    (`runtime.servers` M >= 2) shards 1..M-1's `{server, events}` at that version; `server` is shard 0
    driver    the runtime's own state (the simulator's clock, event queue and workers; empty for MPI runtimes)
    events    the trace up to this point, so the resumed run's trace continues it
    evaluator the divergence guard's reference loss

Signals: SIGTERM, SIGINT and SIGUSR1 (what Slurm sends before a time limit with `--signal`) only raise a flag
(`requested()`); the training loops look at it between two updates, write a checkpoint and the run folder, and
end with `Preempted` (exit status 128 + the signal's number). Start-up waits look at it too (`stop_now`: nothing
to save yet, so the process ends at once with that status), and a second signal ends the process at once.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from collsync import ending, keepalive
from collsync.rules.base import plain, unplain  # noqa: F401  (rule-state algebra, kept importable from here)

FORMAT = 1
NAME = "checkpoint.pt"
SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")

# Config keys a resume may change: how long to train, how often to evaluate, checkpoint, show progress and draw.
MAY_DIFFER = ("steps", "eval_every", "progress", "plots", "checkpoint", "resume", "guard", "guard_loss")


class Preempted(Exception):
    """A signal asked the run to stop; it checkpointed first. `code` is the exit status (128 + signal number)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.code = 128 + signum


# -- files --------------------------------------------------------------------------------------------------


def save(payload: dict[str, Any], path: Path) -> Path:
    """Write `payload` to `path` atomically: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # as open() would make it, not mkstemp's owner-only mode
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash of the node
    finally:
        os.close(dir_fd)
    return path


def locate(resume: str | os.PathLike[str], run_dir: Path) -> Path | None:
    """The checkpoint to resume from: `resume=auto` takes this run folder's if it has one (a requeued Slurm job
    starts fresh the first time), a folder its `checkpoint.pt`, a file itself."""
    if str(resume) == "auto":
        found = run_dir / NAME
        return found if found.exists() else None
    path = Path(resume)
    if path.is_dir():
        path = path / NAME
    if not path.exists():
        raise FileNotFoundError(f"resume={resume}: no checkpoint at {path}")
    return path


def load(path: Path) -> dict[str, Any]:
    """Read a checkpoint (weights only), refusing a damaged file or another format in one line."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle is a damaged or foreign file
        raise ValueError(f"resume: {path} is not a readable collsync checkpoint ({type(exc).__name__})") from None
    if not isinstance(payload, dict) or "format" not in payload:
        raise ValueError(f"resume: {path} is not a collsync checkpoint (no 'format' key)")
    if payload["format"] != FORMAT:
        raise ValueError(f"resume: {path} has checkpoint format {payload['format']}, this collsync reads {FORMAT}")
    return payload


def check_config(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Refuse to resume under a config that trains something else, naming the first key that differs."""
    first = _first_difference(saved, current, "")
    if first is not None:
        key, there, here = first
        raise ValueError(
            f"resume: {path} was written by a different config: {key}={there!r} there, {here!r} here "
            f"(only {', '.join(MAY_DIFFER)} may change on resume)"
        )


def _first_difference(a: Any, b: Any, key: str) -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys(), key=str):
            if not key and k in MAY_DIFFER:
                continue
            found = _first_difference(a.get(k), b.get(k), f"{key}.{k}" if key else str(k))
            if found is not None:
                return found
        return None
    return None if a == b else (key, a, b)


class Schedule:
    """When to write the next periodic checkpoint: every `every` updates and/or every `seconds` of wall time
    (either None to switch it off)."""

    def __init__(self, every: int | None, seconds: float | None, version: int = 0) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"checkpoint.every={every!r} must be a whole number >= 1 (or null)")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0
        ):
            raise ValueError(f"checkpoint.seconds={seconds!r} must be a number > 0 (or null)")
        self.every, self.seconds = every, (float(seconds) if seconds is not None else None)
        self.version, self.time = version, time.monotonic()

    def due(self, version: int) -> bool:
        by_count = self.every is not None and version >= self.version + self.every
        by_time = self.seconds is not None and time.monotonic() - self.time >= self.seconds
        return version > self.version and (by_count or by_time)

    def written(self, version: int) -> None:
        self.version, self.time = version, time.monotonic()


class Keeper:
    """A run's checkpoints: the file they go to, when the next is due, and the one the run resumes from.

    `config` is the run's resolved config (plain dicts); `resume` None, "auto", a run folder or a checkpoint file.
    `disabled`: why this runtime cannot checkpoint (yet); a signal still stops the run cleanly, without one.
    """

    def __init__(
        self,
        config: dict[str, Any],
        out_dir: Path,
        every: int | None,
        seconds: float | None,
        resume: str | None,
        *,
        disabled: str | None = None,
    ) -> None:
        self.config, self.path = config, out_dir / NAME
        self.enabled, self.disabled = disabled is None, disabled
        self.schedule = Schedule(every, seconds)
        self.source = locate(resume, out_dir) if resume else None

    def resumed(self) -> dict[str, Any] | None:
        """The checkpoint to go on from (read and checked against this config), or None to start afresh."""
        if self.source is None:
            return None
        if self.disabled:
            raise ValueError(f"resume: {self.disabled}")
        payload = load(self.source)
        check_config(payload["config"], self.config, self.source)
        version, steps = int(payload["version"]), self.config.get("steps")
        if isinstance(steps, int) and version > steps:  # the run would end at once, with nothing said
            raise ValueError(
                f"resume: {self.source} is at server step {version}, already past steps={steps}: "
                f"pass steps > {version} to train on from it"
            )
        self.schedule.written(int(payload["version"]))
        return payload

    def step(self, version: int, state: Callable[[], dict[str, Any]]) -> None:
        """Between two updates: write a checkpoint when one is due; after a signal, write one and raise `Preempted`.

        `state()` gives the payload (`server`, `driver`, `events`, `evaluator`); it is called only when writing.
        """
        if not self.due(version):
            return
        if self.enabled:
            self.write(version, state())
        self.stop_if_asked(version)

    def due(self, version: int) -> bool:
        """Is a checkpoint due at `version`: by the schedule, or because a signal asked the run to stop?"""
        return requested() is not None or (self.enabled and self.schedule.due(version))

    def stop_if_asked(self, version: int) -> None:
        """After a signal (and the checkpoint it asked for): raise `Preempted`, saying where the run can go on."""
        signum = requested()
        if signum is None:
            return
        name = signal.Signals(signum).name
        kept = f"checkpoint {self.path} (go on with resume={self.path.parent})"
        if not self.enabled:
            kept = f"no checkpoint ({self.disabled})"
        raise Preempted(signum, f"stopped by {name} at server step {version}: {kept}")

    def write(self, version: int, payload: dict[str, Any]) -> None:
        save({"config": self.config, "version": version, **payload}, self.path)
        self.schedule.written(version)


# -- signals ------------------------------------------------------------------------------------------------
# The request itself is part of a process's end state (`collsync.ending`), where the transport's start-up waits
# read it too; here are the handlers that make it.

requested = ending.stop_requested
stop_now = ending.stop_now
request = ending.request_stop
clear = ending.clear_stop


def _handler(signum: int, frame: Any) -> None:
    if ending.stop_requested() is not None:
        ending.stopped(signum, "again")  # a second signal: stop now, without a checkpoint
    ending.request_stop(signum)


def install() -> None:
    """Turn SIGTERM / SIGINT / SIGUSR1 into a request to checkpoint and stop (main thread only); under
    `collsync.keepalive`, the launcher's failure notice into "a rank died" (its SIGUSR1 is not a stop there)."""
    ending.clear_stop()
    for name in SIGNALS:
        signal.signal(getattr(signal, name), _handler)
    keepalive.watch_notice()
