"""What `collsync-run` restarts and from where: a `collsync-train` run from its run folder's checkpoint, any other
command (a script using `hvd.elastic`) from the commit folder it passes in `COLLSYNC_ELASTIC_DIR`."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# Where `hvd.elastic` (collsync.torch.elastic) writes its commits, and the file it writes there: named here so that
# the supervisor, which imports no torch, and the library agree.
ELASTIC_ENV = "COLLSYNC_ELASTIC_DIR"
ELASTIC_FILE = "elastic-state.pt"


def is_train(command: list[str]) -> bool:
    """Whether `command` runs `collsync-train` (restarted from its run folder's checkpoint) rather than a script."""
    return any(Path(a).name == "collsync-train" or a == "collsync.cli" for a in command)


def _override(command: list[str], key: str, default: str) -> str:
    """The last `key=value` the command gives (Hydra's rule: the last one wins), else `default`."""
    given = [a.split("=", 1)[1] for a in command if a.lstrip("+").startswith(f"{key}=")]
    return given[-1] if given else default


def survives(command: list[str]) -> bool:
    """Whether the collsync-train run of `command` goes on without a lost worker inside one job (README, Lost
    workers): async, bfasgd, specsync, ssp with a bound, psp and backup with `sync.backups` > 0 on the servers,
    and `runtime=partial sync=backup`; not bsp, `runtime=allreduce`, nor `sync.on_lost=stop`. The defaults are
    conf/config.yaml's (`sync=backup`, one backup). A script is not read: it counts as one that does not."""
    if not is_train(command):
        return False
    sync, runtime = _override(command, "sync", "backup"), _override(command, "runtime", "auto")
    if _override(command, "sync.on_lost", "null") == "stop" or runtime in ("allreduce", "sim"):
        return False
    if sync == "backup":
        return _override(command, "sync.backups", "1") not in ("0", "null")
    if sync == "ssp" and _override(command, "sync.max_lead", "1") == "0":
        return False
    return runtime != "partial" and sync in ("async", "bfasgd", "specsync", "ssp", "psp")


def run_dir_of(command: list[str]) -> tuple[list[str], Path]:
    """The run folder the command writes (its `hydra.run.dir=`), adding one the way `collsync-train` names it
    when the command has none: every attempt must write, and resume from, the same folder."""
    if not is_train(command):
        raise ValueError(
            "the command is not a collsync-train run (collsync-train ... or python -m mpi4py -m collsync.cli ...): "
            "only those are restarted from a run folder's checkpoint"
        )
    # Hydra's -m is followed by overrides (key=value), python's -m by a module name.
    multirun = [
        a.startswith("--multirun") or (a == "-m" and "=" in (command[i + 1 : i + 2] or ["="])[0])
        for i, a in enumerate(command)
    ]
    if any(multirun):
        raise ValueError("a multirun (-m) cannot be restarted as one job: run collsync-run once per run")
    for a in command:
        if a.startswith("hydra.run.dir="):
            return command, Path(a.split("=", 1)[1])
    folder = f"outputs/{time.strftime('%Y-%m-%d/%H-%M-%S')}"
    return [*command, f"hydra.run.dir={folder}"], Path(folder)


def resumed(command: list[str], run_dir: Path) -> list[str]:
    """The command of a restart: `resume=auto` (this run folder's checkpoint) in place of any `resume=`, once the
    folder has a checkpoint; without one the command as it was (it starts afresh, as the first attempt did)."""
    if not (run_dir / "checkpoint.pt").exists():
        return command
    return [*(a for a in command if not a.startswith("resume=")), "resume=auto"]


@dataclass
class Target:
    """What the attempts share: the command as first launched, and where a restart resumes from: a collsync-train
    run folder (its checkpoint, `resume=auto`) or a script's `hvd.elastic` commit folder (in its environment)."""

    command: list[str]
    run_dir: Path | None = None  # collsync-train
    elastic_dir: Path | None = None  # a script
    env: dict[str, str] | None = None

    def restart(self) -> tuple[list[str], bool, str]:
        """The next attempt's command, whether it resumes, and from what (for the restart's line)."""
        if self.run_dir is not None:
            args = resumed(self.command, self.run_dir)
            fresh = args is self.command
            return args, not fresh, "the start (no checkpoint yet)" if fresh else "its last checkpoint"
        assert self.elastic_dir is not None
        if (self.elastic_dir / ELASTIC_FILE).exists():
            return self.command, True, f"its last hvd.elastic commit ({self.elastic_dir / ELASTIC_FILE})"
        return self.command, False, "the start (no hvd.elastic commit yet)"

    def where(self) -> Path:
        return self.run_dir if self.run_dir is not None else self.elastic_dir or Path()


def target(command: list[str], elastic_dir: str | None = None) -> Target:
    """The `Target` of `command`: a collsync-train run (its run folder fixed now, `run_dir_of`), else a script
    whose commits go to `elastic_dir`, else to a new folder named as collsync-train names its runs."""
    if is_train(command):
        if elastic_dir is not None:
            raise ValueError(
                "--elastic-dir is for scripts using hvd.elastic; a collsync-train run resumes from its run folder"
            )
        command, run_dir = run_dir_of(command)
        return Target(command, run_dir=run_dir)
    folder = Path(elastic_dir or f"outputs/elastic/{time.strftime('%Y-%m-%d/%H-%M-%S')}").absolute()
    return Target(command, elastic_dir=folder, env={**os.environ, ELASTIC_ENV: str(folder)})
