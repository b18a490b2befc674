"""The divergence guard: non-finite gradients and updates stop the run naming where (or are dropped), non-finite
data is refused when it loads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from collsync.checks import check_trace
from collsync.data import npz
from collsync.policy import asynchronous, bsp
from collsync.rules import sgd
from collsync.server import Diverged, Server
from collsync.trace import Trace
from collsync.types import Arrival


def server(guard: str, policy=None, workers: int = 2) -> Server:
    return Server(torch.zeros(3), sgd(lr=0.1), policy or asynchronous(), workers, trace=Trace(), guard=guard)


def test_a_nan_gradient_stops_the_run_naming_worker_and_step():
    s = server("stop")
    s.accept(Arrival(0, 0, torch.ones(3)))
    with pytest.raises(
        Diverged,
        match=r"worker 1 sent a non-finite gradient \(1 of 3 values, the first nan at index 2\) at server step 1",
    ):
        s.accept(Arrival(1, 0, torch.tensor([1.0, 2.0, math.nan])))
    assert torch.equal(s.params, torch.full((3,), -0.1))  # the bad gradient changed nothing


def test_skip_drops_a_nonfinite_gradient_and_the_trace_stays_whole():
    s = server("skip", bsp(), workers=2)
    assert not s.accept(Arrival(0, 0, torch.tensor([math.inf, 0.0, 0.0]), 0))
    assert s.accept(Arrival(1, 0, torch.ones(3), 0)) and s.version == 0  # BSP still waits for worker 0's round 0
    assert s.dropped == 1 and [e["reason"] for e in s.trace.of("drop")] == ["nonfinite"]


def test_off_lets_it_through_and_a_nonfinite_update_is_caught_by_stop():
    s = server("off")
    s.accept(Arrival(0, 0, torch.tensor([math.nan, 0.0, 0.0])))
    assert math.isnan(s.params[0].item())
    huge = Server(torch.zeros(2), sgd(lr=1e308), asynchronous(), 1, guard="stop")
    with pytest.raises(Diverged, match=r"the update of server step 0 is non-finite .* from worker\(s\) \[0\]"):
        huge.accept(Arrival(0, 0, torch.tensor([1e10, 0.0], dtype=torch.float32)))


def test_a_bad_guard_is_refused():
    with pytest.raises(ValueError, match="guard='maybe' must be one of stop, skip, off"):
        server("maybe")


def test_data_with_a_nan_feature_is_refused_when_it_loads(tmp_path):
    x = np.zeros((6, 4), dtype=np.float32)
    x[3, 1] = np.nan
    path = tmp_path / "bad.npz"
    np.savez(path, x_train=x, y_train=np.arange(6) % 2, x_test=x[:2] * 0, y_test=np.array([0, 1]))
    with pytest.raises(
        ValueError, match=r"train features hold non-finite values \(1; the first, nan, in x_train row 3\)"
    ):
        npz(str(path))


def test_check_trace_counts_skipped_gradients_as_dropped():
    s = server("skip")
    s.accept(Arrival(0, 0, torch.tensor([math.nan, 0.0, 0.0])))
    s.accept(Arrival(1, 0, torch.ones(3)))
    counts = check_trace(s.trace, s.policy, 2)
    assert counts["pushed"] == 2 and counts["dropped"] == 1 and counts["applied"] == 1
