"""tests/slurm run against a real Slurm cluster: the one `scripts/slurm_up.sh` starts (tests/run.sh does, where it
can), found through SLURM_CONF or the script's scratch folder. Where none answers, every test skips, saying why.

The job ids and final states of every job the tests submitted are listed at the end of the run, so that a CI log
shows them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import shm
from tests.slurm.cluster import RECORD, unavailable


@pytest.fixture(scope="session")
def cluster() -> None:
    """A Slurm cluster that answers, or a skip that says why there is none."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    shm.clear_stale()  # segments that ranks killed by earlier stages left could make a job's MPI_Init fail


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """List the Slurm jobs of this run with their final states (shown even under -q)."""
    if RECORD.jobs:
        terminalreporter.section("Slurm jobs")
        for what, job, state in RECORD.jobs:
            terminalreporter.write_line(f"job {job:>8}  {state:<10} {what}")


@pytest.fixture(scope="session")
def submit_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The folder jobs are submitted from: their run folders and Slurm logs land in it."""
    yield tmp_path_factory.mktemp("slurm")
