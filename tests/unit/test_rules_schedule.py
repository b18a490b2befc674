"""The step schedule of 001_... App. C.4 (lr x lr_decay at each milestone) and weight decay inside SA's penalised
gradient (App. C.5), worked out by hand."""

from __future__ import annotations

import pytest
import torch

from collsync.rules import chain, dana, momentum, nesterov, rmsprop, sgd, staleness_aware
from collsync.rules.base import step_lr
from collsync.types import Context


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def ctx(step: int, staleness: int = 0) -> Context:
    return Context(step, 0, staleness, 1, None, 1)


def test_step_lr_by_hand() -> None:
    # lr 1, warm-up over 4 updates, x 0.1 at update 6 and again at 8.
    got = [step_lr(1.0, 4, k, (6, 8), 0.1) for k in range(10)]
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_sgd_and_momentum_follow_the_schedule() -> None:
    rule = sgd(lr=1.0, milestones=[2], lr_decay=0.5)
    deltas = [float(rule.update(t(1.0), (), t(0.0), ctx(k))[0]) for k in range(4)]
    assert deltas == [-1.0, -1.0, -0.5, -0.5]
    # Heavy ball, momentum 0.5, g = 1: v = 1, 1.5, 1.75; eta = 1, 1, 0.5 -> -1, -1.5, -0.875 (v holds no eta).
    rule, state, out = momentum(lr=1.0, momentum=0.5, milestones=[2], lr_decay=0.5), None, []
    state = rule.init(t(0.0))
    for k in range(3):
        delta, state = rule.update(t(1.0), state, t(0.0), ctx(k))
        out.append(float(delta))
    assert out == pytest.approx([-1.0, -1.5, -0.875])


def test_dana_view_uses_the_decayed_step() -> None:
    # One worker, momentum 0.5, lr 1, x 0.1 from update 1: v = 2 then 0.5 * 2 + 2 = 3; delta -2, then -0.3;
    # the look-ahead after the second update is theta - eta_k gamma v = 0 - 0.1 * 0.5 * 3 = -0.15.
    rule = dana(lr=1.0, momentum=0.5, milestones=[1], lr_decay=0.1)
    state = rule.init(t(0.0))
    d1, state = rule.update(t(2.0), state, t(0.0), ctx(0))
    d2, state = rule.update(t(2.0), state, t(0.0), ctx(1))
    assert [float(d1), float(d2)] == pytest.approx([-2.0, -0.3])
    assert float(rule.view(t(0.0), state)) == pytest.approx(-0.15)


def test_no_milestones_is_the_optimizer_unchanged() -> None:
    for a, b in ((nesterov(lr=0.3), nesterov(lr=0.3, milestones=[], lr_decay=0.5)), (rmsprop(), rmsprop(lr_decay=1.0))):
        sa, sb = a.init(t(0.0, 0.0)), b.init(t(0.0, 0.0))
        for k in range(3):
            da, sa = a.update(t(1.0, -2.0), sa, t(0.5, 0.5), ctx(k))
            db, sb = b.update(t(1.0, -2.0), sb, t(0.5, 0.5), ctx(k))
            assert torch.equal(da, db)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: sgd(milestones=[5, 3]), r"sgd: milestones=\[5, 3\] must be increasing update counts >= 1"),
        (lambda: momentum(milestones=[0]), r"momentum: milestones=\[0\] must be increasing"),
        (lambda: dana(lr_decay=0.0), r"dana: lr_decay=0.0 must be in \(0, 1\]"),
        (lambda: staleness_aware(weight_decay=-1.0), r"staleness_aware: weight_decay=-1.0 must be >= 0"),
    ],
)
def test_bad_schedules_are_refused_naming_the_key(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(("tau", "expected"), [("staleness", -1.5), ("boxes", -0.75)])
def test_sa_weight_decay_is_inside_the_penalised_gradient(tau: str, expected: float) -> None:
    # g = 1, theta = 2, lambda = 0.25: (g + lambda theta) / tau = 1.5 / tau at staleness 1 (tau 1 or 2), lr 1.
    rule = chain(staleness_aware(tau, weight_decay=0.25), sgd(lr=1.0))
    delta, _ = rule.update(t(1.0), rule.init(t(2.0)), t(2.0), ctx(0, staleness=1))
    assert float(delta) == pytest.approx(expected)
