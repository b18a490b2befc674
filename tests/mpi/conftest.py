"""MPI tests run under `mpiexec -n N python -m mpi4py -m pytest tests/mpi` at any N; every rank runs every test.

Skip decisions depend only on the world size, so they are the same on all ranks (a skip on one rank alone would
deadlock the others in the next collective).
"""

from __future__ import annotations

import pytest


@pytest.fixture
def comm():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    world.Barrier()
    yield world
    world.Barrier()  # keep ranks in step between tests
