"""The `collsync-train` entry point (Hydra); `collsync-report` lives in `collsync.metrics.report_main`.

Errors in the user's input end the run with one line on stderr and exit status 2; under MPI the line names the
rank and the whole world is aborted rather than left hanging.
"""

from __future__ import annotations

import sys
from importlib.resources import files
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from omegaconf import DictConfig
from omegaconf import errors as oc_errors

CONF_DIR = str(files("collsync.conf"))


def _user_error(exc: BaseException) -> str | None:
    """The message of a user-input error (unwrapping Hydra's instantiation wrapper), or None for a bug."""
    while isinstance(exc, InstantiationException) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, InstantiationException):
        return str(exc).splitlines()[-1]
    if isinstance(exc, (ValueError, FileNotFoundError, oc_errors.OmegaConfBaseException, TimeoutError)):
        return str(exc)
    return None


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _train(cfg: DictConfig) -> float | None:
    from collsync.train import run

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = run(cfg, out_dir)
    except Exception as exc:  # noqa: BLE001 - sorted into user errors and bugs just below
        message = _user_error(exc)
        if message is None:
            raise
        _fail(message)
    # Returned for Hydra sweepers (e.g. an optimizer sweep minimising test error).
    return None if result is None else 1.0 - float(result.get("final_acc") or 0.0)


def _fail(message: str) -> None:
    """One line on stderr, exit status 2; under MPI the line names the rank and the world is aborted (a rank that
    failed alone would otherwise leave the others waiting forever)."""
    from collsync.runtime.spec import launched_under_mpi

    if not launched_under_mpi():
        print(f"collsync-train: error: {message}", file=sys.stderr)
        sys.exit(2)
    from mpi4py import MPI

    from collsync.runtime.mpi_world import abort, rank_prefix

    print(f"collsync-train: {rank_prefix(MPI.COMM_WORLD)}: error: {message}", file=sys.stderr, flush=True)
    abort(MPI.COMM_WORLD, 2)


def _shared_run_dir() -> None:
    """Under MPI, every rank must write into one run folder: rank 0 picks the time, the others take it."""
    from collsync.runtime.spec import launched_under_mpi

    if not launched_under_mpi() or any(a.startswith(("hydra.run.dir=", "-m", "--multirun")) for a in sys.argv):
        return
    import time

    from mpi4py import MPI

    stamp = MPI.COMM_WORLD.bcast(time.strftime("%Y-%m-%d/%H-%M-%S") if MPI.COMM_WORLD.Get_rank() == 0 else None)
    sys.argv.append(f"hydra.run.dir=outputs/{stamp}")


def train() -> None:
    """`collsync-train [overrides...]`: see `collsync-train --help` and `conf/`."""
    if "--version" in sys.argv[1:]:
        from collsync import __version__

        print(f"collsync {__version__}")
        return
    _shared_run_dir()
    _train()


if __name__ == "__main__":
    train()
