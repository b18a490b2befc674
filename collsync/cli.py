"""The `collsync-train` entry point (Hydra); `collsync-report` lives in `collsync.report`.

Errors in the user's input end the run with one line on stderr and exit status 2: Hydra's own (an unknown key or
option, an override that does not parse), the schema's (`collsync.schema`: a value of the wrong type), the
factories' (a value out of range), the data files', the run folder's, and those of a launch that cannot work.
Under MPI the line names the rank, is printed once (by rank 0 when every rank meets the same error) and the whole
world is aborted rather than left hanging. Anything else is a bug and keeps its traceback.

collsync's own modules, and mpi4py, are imported inside the functions that use them: `--version` answers without
loading torch, and under a launcher MPI is initialised in `_check_world`, before the stop-signal handlers go in
(a rank held inside MPI_Init would never run them) and before torch loads, bounded by the start-up watchdog
(`collsync.runtime.startup`: a rank that never starts ends the job within `sync.deadline`).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf import errors as oc_errors

from collsync.runtime.spec import SIZE_VARS, launched_under_mpi, launcher_rank

CONF_DIR = str(files("collsync.conf"))

# How long a rank other than 0 waits before printing a user error under MPI: when every rank meets the same error
# (a bad config), rank 0 prints it and aborts the world meanwhile, so the line appears once; an error of this rank
# alone is printed after the wait.
_PRINT_GRACE_S = 3.0
# Under a launcher, a shorter `sync.deadline` ends every start-up (issue 36: sync.deadline=0.01 timed out in MPI_Init
# or in the start-up exchange on every rank), so it is refused before MPI starts.
MIN_LAUNCH_DEADLINE_S = 1.0


def _failed_job(report: str) -> str:
    """submitit's report of a failed job (its id, state and error stream) as one line: the job and the error line
    the member printed (collsync's own, when there is one)."""
    job = re.search(r"Job (\S+) \(task: \d+\)", report)
    state = re.search(r"\(state: (\w+)\)", report)
    lines = [line.strip() for line in report.splitlines() if line.strip() and not line.startswith("---")]
    said = [line for line in lines if line.startswith("collsync-train:")] or lines[-1:]
    return (
        f"sweep job {job[1] if job else '?'} failed (state {state[1] if state else 'unknown'}): "
        f"{said[-1] if said else 'no error stream'}"
    )


def user_error(exc: BaseException) -> str | None:
    """The one-line message of an error in the user's input (config, data, run folder, launch), or None for a bug.

    Shared by `collsync-train` and the tests that compose configs in-process, so both sort errors the same way.
    """
    from collsync.rundir import RunFolderError, describe
    from collsync.sim import Deadlock

    while isinstance(exc, InstantiationException) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        return _missing_option(exc)
    if type(exc).__name__ == "UncompletedJobError":  # submitit: a sweep member's job failed on the cluster
        return _failed_job(str(exc))
    if isinstance(exc, OverrideParseException):
        detail = exc.message.splitlines()[0] if exc.message else "does not parse"
        if detail.startswith("LexerNoViableAltException"):
            detail = _unquoted(str(exc.override))
        return f"{exc.override}: {detail} (Hydra's override grammar: key=value, group=option, +key=value)"
    if isinstance(exc, RunFolderError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:
        return describe(exc)
    if isinstance(exc, oc_errors.OmegaConfBaseException):
        return _omegaconf_error(exc)
    unknown = re.match(r"Could not override '([^']+)'\.\s+To append to your config use \+(\S+)", str(exc))
    if isinstance(exc, HydraException) and unknown:
        return f"{unknown[2]}: {unknown[1]!r} is not a key of the config (to add a new key anyway: +{unknown[2]})"
    if isinstance(exc, (HydraException, ValueError, FileNotFoundError, TimeoutError, Deadlock)):
        cause = exc.__cause__
        text = str(exc)
        if isinstance(exc, HydraException) and isinstance(cause, oc_errors.OmegaConfBaseException):
            text = f"{text} {_omegaconf_error(cause)}"
        return _one_line(text)
    return None


def _unquoted(override: str) -> str:
    """What Hydra's lexer means when it stops on a character: `~` that no shell expanded (after `key=`, where the key
    has a dot, bash leaves it), or a character Hydra's grammar takes only inside quotes."""
    key, _, value = override.partition("=")
    if value.startswith("~"):
        full = Path(value).expanduser()
        return f"~ is not expanded here (the shell leaves it after {key}=): give the full path, {key}={full}"
    return f"holds a character Hydra takes only inside quotes: quote the value, '{key}=\"{value}\"'"


def _one_line(text: str) -> str:
    """Join a multi-line message into one line (dropping blank lines)."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _missing_option(exc: MissingConfigException) -> str:
    """`sync=nope`: Hydra says "Could not find 'sync/nope'" and lists the options; say it as the user typed it."""
    group, _, option = str(exc.missing_cfg_file).rpartition("/")
    if not group:
        return _one_line(str(exc).split("Config search path:")[0])
    from collsync.suggest import did_you_mean

    options = ", ".join(exc.options or [])
    said = f"{group}={option}: no such option of {group}{did_you_mean(option, exc.options or [])}"
    return said + (f" (options: {options})" if options else "")


def _omegaconf_error(exc: oc_errors.OmegaConfBaseException) -> str:
    """OmegaConf's message without its `full_key:` / `object_type=` lines, the key named in front."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(line for line in lines if not line.startswith(("full_key:", "object_type=", "reference_type=")))
    key = getattr(exc, "full_key", None)
    return f"{key}: {text}" if key and str(key) not in text else text


def execute(
    cfg: DictConfig, out_dir: Path, choices: Mapping[str, Any] | None = None, overrides: Sequence[str] = ()
) -> dict[str, Any] | None:
    """What `collsync-train` does with a composed config: probe the run folder, then train (`collsync.train.run`,
    which checks the config against its schema before it builds anything). `choices`: Hydra's option per group,
    which tells a group given a list of options (see `schema.check`); `overrides`: Hydra's task overrides, which
    tell a value given on the command line from a default (`schema.check_overrides`)."""
    from collsync import rundir, schema
    from collsync.train import run

    schema.check(cfg, choices)  # first: `run` reads top-level keys (the seed) before it builds the parts
    for warning in schema.check_overrides(overrides):
        if launcher_rank() == 0:  # once, not once per rank
            logging.getLogger("collsync.train").warning(warning)
    rundir.probe(out_dir)
    return run(cfg, out_dir, overrides)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _train(cfg: DictConfig) -> float | None:
    from collsync import checkpoint

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    checkpoint.stop_now("during start-up")  # a signal since `train()` began: nothing to save, end now
    checkpoint.install()  # SIGTERM / SIGINT / SIGUSR1: checkpoint, write the run folder, exit 128 + the signal
    if _local_sweep() and int(HydraConfig.get().job.num) == 0:
        _check_members()
    try:
        result = execute(cfg, out_dir, HydraConfig.get().runtime.choices, list(HydraConfig.get().overrides.task))
    except checkpoint.Preempted as exc:
        _fail(str(exc), code=exc.code, what="")
    except Exception as exc:  # noqa: BLE001 - sorted into user errors and bugs just below
        message = user_error(exc)
        if message is None:
            raise
        if _member_failed(message):
            return None
        _fail(message)
    # Returned for Hydra sweepers (e.g. an optimizer sweep minimising test error).
    return None if result is None else 1.0 - float(result.get("final_acc") or 0.0)


# The sweep members (Hydra's job numbers) that failed on a user error: the sweep ran on, and the exit status is 2.
_FAILED_MEMBERS: list[int] = []


def _local_sweep() -> bool:
    """Whether one process runs a sweep's members in turn (`-m` with Hydra's basic launcher, no MPI)."""
    config = HydraConfig.get()
    if config.mode != RunMode.MULTIRUN or launched_under_mpi():
        return False
    return config.runtime.choices.get("hydra/launcher") == "basic"


def _check_members() -> None:
    """Before the first member of a local sweep trains: every member's config through the checks a run makes
    before its first gradient (`collsync.sweep`); each member refused is named in one line, and nothing trains."""
    from collsync import schema, sweep, train

    def check(cfg: DictConfig, choices: dict[str, str], overrides: list[str]) -> None:
        schema.check(cfg, choices)
        schema.check_overrides(overrides)
        train.check(cfg)

    given = [a for a in sys.argv[1:] if not a.startswith("-") and ("=" in a or a.startswith("~"))]  # not -m, -cn
    found = sweep.refused(str(HydraConfig.get().job.config_name), given, check, user_error)
    for job, said, message in found:
        print(f"collsync-train: error: sweep member {job} ({said}): {message}", file=sys.stderr, flush=True)
    if found:
        jobs = ", ".join(str(job) for job, _, _ in found)
        print(f"collsync-train: the sweep trained no member: member(s) {jobs} refused (above)", file=sys.stderr)
        sys.exit(2)


def _member_failed(message: str) -> bool:
    """A sweep member's user error met while it trained, where one process runs the members in turn (each was
    checked before the first trained: `_check_members`): one line naming the member, and the sweep goes on, since
    the members after it are runs of their own. False where the error ends the process: a single run, or under
    MPI, where a rank alone meeting it would leave the others in another member."""
    if not _local_sweep():
        return False
    config = HydraConfig.get()
    _close_progress_bars()
    said = " ".join(config.overrides.task)
    print(f"collsync-train: error: sweep member {config.job.num} ({said}): {message}", file=sys.stderr, flush=True)
    _FAILED_MEMBERS.append(int(config.job.num))
    return True


def _close_progress_bars() -> None:
    """Clear any progress bar still drawn, so that an error line starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is None:
        return
    bars = list(getattr(tqdm.tqdm, "_instances", ()))
    for bar in bars:
        bar.close()  # a bar that is not kept (leave=False) clears its line and returns to its start
    if bars and not sys.stderr.isatty():
        # In a log file the cleared bar is still text on the line: start the error on the next one.
        sys.stderr.write("\n")
    sys.stderr.flush()


def _fail(message: str, code: int = 2, what: str = "error") -> None:
    """One line on stderr, exit status `code`; under MPI the line names the rank and the world is aborted (a rank
    that failed alone would otherwise leave the others waiting forever). A stop asked for by a signal is no error
    (`what=""`) and exits 128 + the signal's number, as a shell reports a process a signal ended."""
    _close_progress_bars()
    if not launched_under_mpi():
        print(f"collsync-train: {what + ': ' if what else ''}{message}", file=sys.stderr, flush=True)
        sys.exit(code)
    from mpi4py import MPI

    from collsync.ending import end
    from collsync.runtime.mpi_world import rank_prefix

    who = rank_prefix(MPI.COMM_WORLD)
    message = message.removeprefix(f"{who}: ")  # the runtime's own errors name the rank already: once is enough
    # A newline first: another rank's progress bar may hold the launcher's merged stream mid-line. A rank other
    # than 0 defers: rank 0 prints the error all ranks meet, and aborts the world meanwhile.
    line = f"\ncollsync-train: {who}: {what + ': ' if what else ''}{message}"
    end(code, line, comm=MPI.COMM_WORLD, defer=_PRINT_GRACE_S if MPI.COMM_WORLD.Get_rank() != 0 else 0.0)


def _check_world() -> None:
    """Under a launcher, stop at once when MPI's world is not the launcher's (another MPI's mpiexec started this
    python: every rank is a world of its own). The launcher's rank 0 prints one line; the others exit quietly."""
    if not launched_under_mpi():
        return
    from collsync.runtime import startup  # stdlib only: the watchdog is armed before torch loads

    deadline = _startup_deadline(sys.argv[1:])
    if deadline is not None and deadline < MIN_LAUNCH_DEADLINE_S:
        if launcher_rank() == 0:  # before MPI, where each rank would say it: the launcher's rank 0 alone
            size = next((os.environ[v] for v in SIZE_VARS if os.environ.get(v, "").isdigit()), "?")
            print(
                f"collsync-train: rank 0 of {size} on {socket.gethostname()}: error: sync.deadline={deadline:g} is "
                f"under {MIN_LAUNCH_DEADLINE_S:g} s, shorter than any launch's start-up (each rank imports torch and "
                f"starts MPI within it): {startup.too_short(deadline)}",
                file=sys.stderr,
                flush=True,
            )
        sys.exit(2)
    # MPI_Init waits for every rank (one that never starts holds it for ever): bounded, armed before torch's seconds
    startup.arm("collsync-train", deadline)
    _start_mpi()
    startup.mpi_up()
    from collsync.runtime.mpi_world import world  # torch and numpy load now, under the exchange's bound

    try:
        world()
    except RuntimeError as exc:  # check_world_size's mismatch: MPI itself is up, but each rank is alone in it
        if launcher_rank() == 0:
            print(f"collsync-train: rank 0: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def _start_mpi() -> None:
    from mpi4py import MPI  # noqa: F401 - MPI_Init, bounded by the start-up watchdog armed before it


def _startup_deadline(argv: list[str]) -> float | None:
    """The deadline of MPI's start-up and of the start-up exchange, before Hydra composed the config (which needs
    every rank in to report an error once): `sync.deadline=` as given on the command line (null: none), else the
    policies' default, also for a value the config refuses (not a number, not > 0), which it then names."""
    from collsync.deadline import DEADLINE  # not collsync.policy's import: that loads torch, after the watchdog

    given = [a.split("=", 1)[1] for a in argv if a.startswith(("sync.deadline=", "++sync.deadline="))]
    if not given:
        return DEADLINE
    if given[-1] in ("null", "None"):
        return None
    try:
        value = float(given[-1])
    except ValueError:
        return DEADLINE  # Hydra's composition names the bad value in its own words, once every rank is in
    return value if 0 < value < float("inf") else DEADLINE


def _shared_run_dir() -> None:
    """Under MPI, every rank must write into one run folder: rank 0 picks the time, the others take it. First, the
    start-up exchange (`mpi_world.hello`, bounded by the deadline): a rank that never arrives is named in one
    line and the job ends, rather than wait in this broadcast for ever."""
    if not launched_under_mpi():
        return
    from mpi4py import MPI

    from collsync.runtime import startup
    from collsync.runtime.mpi_world import RankLost, hello

    startup.exchange_begins()  # the backstop counts from here: the imports since MPI_Init are not the exchange's
    try:
        hello(MPI.COMM_WORLD, _startup_deadline(sys.argv[1:]))
    except RankLost as exc:
        _fail(str(exc))  # ends the job well before the start-up watchdog's backstop would
    startup.disarm()
    if any(a.startswith(("hydra.run.dir=", "-m", "--multirun")) for a in sys.argv):
        return
    stamp = MPI.COMM_WORLD.bcast(time.strftime("%Y-%m-%d/%H-%M-%S") if MPI.COMM_WORLD.Get_rank() == 0 else None)
    sys.argv.append(f"hydra.run.dir=outputs/{stamp}")


def _check_run_dir(argv: list[str]) -> None:
    """An empty `hydra.run.dir=` (or `hydra.sweep.dir=`) would make the current folder the run folder, mixing the
    run's files with whatever is there: refused, before Hydra writes anything into it."""
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and key in ("hydra.run.dir", "hydra.sweep.dir") and not value.strip().strip("'\"").strip():
            _fail(f"{key}={value}: an empty folder is the current folder: name the run folder, e.g. {key}=runs/a")


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError on a path that caused `exc` (itself included), or None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.filename is not None and not isinstance(seen, HydraException):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def train() -> None:
    """`collsync-train [overrides...]`: see `collsync-train --help` and `conf/`."""
    if "--version" in sys.argv[1:]:
        from collsync import __version__

        print(f"collsync {__version__}")
        return
    _check_world()  # MPI_Init: before the handlers, which a rank held inside it (by a rank that never came) never runs
    from collsync import checkpoint  # lazily, as in `_train`: torch loads once MPI is up, and not for --version

    # From here a stop signal is a request that the start-up waits look at (they end the process at once, 128 + n):
    # Python's defaults would leave a traceback (SIGINT) or nothing at all to say which rank stopped.
    checkpoint.install()
    _shared_run_dir()
    _check_run_dir(sys.argv[1:])
    # Hydra prints its own errors (an unknown key, a missing option, a run folder it cannot create) over several
    # lines and exits 1; with HYDRA_FULL_ERROR it raises them instead, and they are printed here as one line. A user
    # who set HYDRA_FULL_ERROR gets Hydra's full report.
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    if full_error is not None:
        _train()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _train()
        if _FAILED_MEMBERS:  # named above, one line each; the members after them ran
            failed = ", ".join(map(str, _FAILED_MEMBERS))
            print(f"collsync-train: the sweep ran every member; member(s) {failed} failed (above)", file=sys.stderr)
            sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - sorted into user errors and bugs just below
        cause = _os_error_in(exc)
        if cause is not None:
            # Before the task runs, Hydra creates the run folder, writes its .hydra/ files there and opens the log
            # file (logging wraps that error in a ValueError).
            from collsync.rundir import describe

            _fail(f"the run folder cannot be written: {describe(cause)}")
        message = user_error(exc)
        if message is None:
            raise
        _fail(message)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)


if __name__ == "__main__":
    train()
