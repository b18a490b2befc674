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


# A test that fails on one rank leaves the others waiting in its next collective, and the job would hang until CI's
# own limit with nothing said. Past this bound the stuck rank says which test it is in, prints every thread's stack
# and exits, so the launcher ends the job with the place it hung in the log (faulthandler's own timer, which needs no
# GIL, ends it a little later if the message cannot be written). Far above any test here (the longest take seconds).
BOUND_S = 300.0


@pytest.fixture(autouse=True)
def _bounded(request):
    import faulthandler
    import os
    import sys
    import threading

    def expire() -> None:
        capture = request.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=True)  # pytest holds fd 2 while a test runs
        sys.stderr.write(f"tests/mpi: {request.node.nodeid} still running after {BOUND_S:.0f} s (pid {os.getpid()})\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(BOUND_S, expire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(BOUND_S + 30, exit=True)
    yield
    timer.cancel()
    faulthandler.cancel_dump_traceback_later()
