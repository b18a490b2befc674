"""The asynchronous soak of the window mailbox (benchmarks/mpi_soak.py) at CI size: 2,000 pushes of 100k floats.

The full soak (20,000 pushes of 1M floats at 4 ranks) is the benchmark script itself; see benchmarks/README.md.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_DRIVER = Path(__file__).resolve().parents[2] / "benchmarks" / "mpi_soak.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("collsync_mpi_soak", _DRIVER)
    assert spec is not None and spec.loader is not None, f"cannot load {_DRIVER}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("rule", "pushes"), [("sgd", 2000), ("momentum", 1000)])
def test_async_soak_settles_every_push_and_replays_bitwise(comm, rule, pushes):
    if comm.Get_size() < 2:
        pytest.skip("the soak needs a server and at least one worker: launch at least 2 ranks")
    soak = _soak_module().soak
    result = soak(comm, pushes=pushes, numel=100_000, max_delay_us=100.0, seed=7, rule=rule)
    assert result["errors"] == []
    assert result["applied"] == result["updates"] == pushes
    assert result["applied"] + result["dropped"] == result["sent"] == result["pushed"]
    assert sum(result["sent_per_worker"]) == result["sent"] and min(result["sent_per_worker"]) > 0
    assert result["replay_equal"]
    # A worker has at most two gradients outstanding when the server stops: one in its slot, one in its hands.
    assert result["dropped"] <= 2 * result["workers"]


def test_soak_rejects_a_world_without_workers(comm):
    if comm.Get_size() != 1:
        pytest.skip("only a world of one rank has no worker")
    with pytest.raises(ValueError, match="no worker beside the server"):
        _soak_module().soak(comm, pushes=10, numel=10)
