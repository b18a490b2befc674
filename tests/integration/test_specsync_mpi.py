"""SpecSync over MPI for real (004_..., Alg. 2): one server rank, four workers with injected gamma stragglers, and
the scheduler in the server's loop (-n 5) or on a rank of its own (-n 6); re-syncs abort gradients at their safe
points. About 25 s per MPI launch and 10 s for the simulator run both are compared with (unloaded)."""

from __future__ import annotations

import pytest

from collsync.checks import check_trace
from collsync.policy import specsync
from collsync.trace import Trace
from tests.integration.test_mpi_cli import MPIEXEC, launch, summary
from tests.integration.test_mpi_cli import simulated as run_simulated

pytestmark = [
    pytest.mark.serial,  # aborts are counted, and how many there are depends on the ranks' timing
    pytest.mark.skipif(not MPIEXEC.exists(), reason="the venv has no mpiexec (install the mpich extra)"),
]

OVERRIDES = ["sync=specsync", "optimizer=sgd", "steps=200"]  # SpecSync-Adaptive over ASP


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> dict:
    """The same config in the simulator with as many workers (in this process: no interpreter to start)."""
    return run_simulated(tmp_path_factory.mktemp("sim"), OVERRIDES, 4)


@pytest.mark.parametrize("scheduler, ranks", [("server", 5), ("rank", 6)])
def test_specsync_over_mpi_aborts_for_real_and_trains_to_the_simulators_accuracy(tmp_path, simulated, scheduler, ranks):
    overrides = [*OVERRIDES, f"sync.scheduler={scheduler}", "runtime.inject_stragglers=true", "runtime.time_scale=0.02"]
    proc = launch(tmp_path / "mpi", ranks, *overrides)
    assert proc.returncode == 0, proc.stderr[-2000:]
    real = summary(tmp_path / "mpi")
    assert real["workers"] == 4
    assert real["trace_checks"]["updates"] == 200
    assert real["best_acc"] >= simulated["best_acc"] - 0.05, (real["best_acc"], simulated["best_acc"])
    trace = Trace.read_jsonl(tmp_path / "mpi" / "run" / "trace.jsonl")
    check_trace(trace, specsync(), 4)  # the abort events included
    spec = real["specsync"]
    aborts = trace.of("abort")
    assert spec["tunings"] > 0 and spec["notifies"] >= 190  # one per push but each worker's first
    assert len(aborts) == spec["aborts"] > 0 and spec["resyncs"] >= spec["aborts"]
    assert all(e["wasted"] > 0 for e in aborts)
    numel = spec["bytes"]["push"] // real["pushed"]  # bytes of one full gradient (and of one full pull)
    # One pull per abort, but where training ended during the abort (at most one per worker: no pull then).
    assert (spec["aborts"] - 4) * numel <= spec["bytes"]["resync_pull"] <= spec["aborts"] * numel
    assert spec["bytes"]["notify"] == 16 * spec["notifies"] + 8 * spec["resyncs"] + 32 * spec["aborts"]
