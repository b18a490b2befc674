"""benchmarks/ssp_cnn.py's study of ssp's momentum: the quadratic's stability bounds against their closed forms, and
the extrapolated look-ahead candidate's update and view on a tiny tensor."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from collsync.types import Context

_spec = importlib.util.spec_from_file_location(
    "ssp_cnn", Path(__file__).resolve().parents[2] / "benchmarks" / "ssp_cnn.py"
)
assert _spec is not None and _spec.loader is not None
study = importlib.util.module_from_spec(_spec)
sys.modules["ssp_cnn"] = study  # its NamedTuples look their module up there
_spec.loader.exec_module(study)


def test_fresh_heavy_ball_is_stable_to_two_times_one_plus_gamma() -> None:
    """Heavy ball on h x^2 / 2 is stable iff eta h < 2 (1 + gamma) (Polyak): 3.8 at gamma 0.9."""
    assert study.largest_stable(study.Linear(), stale=0.0) == pytest.approx(2 * (1 + 0.9), rel=0.005)


def test_sgd_one_round_stale_is_stable_to_one() -> None:
    """x_{k+1} = x_k - eta h x_{k-1}: the roots of z^2 - z + eta h have |z|^2 = eta h once complex: bound 1."""
    assert study.largest_stable(study.Linear(gamma=0.0), stale=1.0) == pytest.approx(1.0, rel=0.01)


def test_staleness_shrinks_every_candidates_bound_below_bsps() -> None:
    fresh = study.largest_stable(study.Linear(), stale=0.0)
    lookahead = study.largest_stable(study.Linear(c1=0.9 + 0.81), stale=1.0)
    extrapolated = study.largest_stable(study.Linear(c1=0.45, c2=1.0), stale=1.0)
    assert lookahead < extrapolated < fresh / 4


def test_extrapolated_steps_heavy_ball_and_reads_ahead_by_momentum_and_last_gradient() -> None:
    rule = study.extrapolated(lr=0.5, gamma=0.9, c1=0.45, c2=0.75)
    params = torch.tensor([1.0, -2.0])
    state = rule.init(params)
    assert torch.equal(rule.view(params, state), params)  # no stale round yet: bsp's read
    fresh = Context(step=0, worker=-1, staleness=0)
    delta, state = rule.update(torch.tensor([2.0, 4.0]), state, params, fresh)
    assert torch.allclose(delta, torch.tensor([-1.0, -2.0]))
    assert torch.equal(rule.view(params, state), params)  # still no stale round
    stale = Context(step=1, worker=-1, staleness=1)
    delta, state = rule.update(torch.tensor([1.0, 0.0]), state, params, stale)
    v = torch.tensor([0.9 * 2 + 1, 0.9 * 4 + 0])
    assert torch.allclose(delta, -0.5 * v)
    want = params - 0.5 * (0.45 * v + 0.75 * torch.tensor([1.0, 0.0]))
    assert torch.allclose(rule.view(params, state), want)
