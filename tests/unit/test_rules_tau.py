"""`tau=`: the delay a staleness penalty divides by, worked out by hand for both conventions.

`staleness` (the default) divides by max(staleness, 1), as 001_... §4's prose reads; `boxes` divides by
staleness + 1, as 001_... Alg. 3, 5, 7 and 10 compute tau = k - iter[i] (and 002_...'s FRED code). A gradient with
one update in between (staleness 1) is untouched by the first and halved by the second.
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from collsync import schema
from collsync.cli import CONF_DIR
from collsync.rules import adam_sa, chain, combine, dana, fasgd, momentum, sgd, staleness_aware, staleness_aware_step
from collsync.rules.staleness import staleness_tau
from collsync.types import Context


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def ctx(step: int = 0, staleness: int = 0, worker: int = 0, workers: int = 1) -> Context:
    return Context(step, worker, staleness, workers, None, 1)


def test_staleness_tau_by_hand() -> None:
    assert [staleness_tau(ctx(staleness=s)) for s in (0, 1, 2, 5)] == [1, 1, 2, 5]
    assert [staleness_tau(ctx(staleness=s), "boxes") for s in (0, 1, 2, 5)] == [1, 2, 3, 6]


@pytest.mark.parametrize(("tau", "expected"), [("staleness", [-2.0, -4.0, -2.0]), ("boxes", [-2.0, -2.0, -1.5])])
def test_sa_gradient_variant_under_sgd(tau: str, expected: list[float]) -> None:
    # g = 2, 4, 6 at staleness 0, 1, 3 with lr 1: staleness divides by 1, 1, 3; boxes by 1, 2, 4.
    rule = chain(staleness_aware(tau), sgd(lr=1.0))
    state = rule.init(t(0.0))
    out = []
    for step, (g, s) in enumerate([(2.0, 0), (4.0, 1), (6.0, 3)]):
        delta, state = rule.update(t(g), state, t(0.0), ctx(step, s))
        out.append(float(delta))
    assert out == pytest.approx(expected)


@pytest.mark.parametrize(("tau", "expected"), [("staleness", [-2.0, -5.0]), ("boxes", [-1.0, -5.0])])
def test_sa_step_variant_divides_the_step_not_the_buffer(tau: str, expected: list[float]) -> None:
    # momentum 0.5, lr 1: v1 = 2 (staleness 1), v2 = 0.5 * 2 + 4 = 5 (fresh). boxes halves the first step only.
    rule = staleness_aware_step(momentum(lr=1.0, momentum=0.5), tau)
    state = rule.init(t(0.0))
    d1, state = rule.update(t(2.0), state, t(0.0), ctx(0, 1))
    d2, state = rule.update(t(4.0), state, t(0.0), ctx(1, 0))
    assert [float(d1), float(d2)] == pytest.approx(expected)


@pytest.mark.parametrize(("tau", "expected"), [("staleness", [-2.0, -4.0]), ("boxes", [-1.0, -2.5])])
def test_dana_sa_divides_what_enters_the_worker_momentum(tau: str, expected: list[float]) -> None:
    # DANA-SA (001_... Alg. 7), one worker, momentum 0.5, lr 1; g = 2 at staleness 1, then g = 6 at staleness 2.
    # staleness: v = 2 / 1 = 2, then 0.5 * 2 + 6 / 2 = 4. boxes: v = 2 / 2 = 1, then 0.5 * 1 + 6 / 3 = 2.5.
    rule = chain(staleness_aware(tau), dana(lr=1.0, momentum=0.5))
    state = rule.init(t(0.0))
    d1, state = rule.update(t(2.0), state, t(0.0), ctx(0, 1))
    d2, state = rule.update(t(6.0), state, t(0.0), ctx(1, 2))
    assert [float(d1), float(d2)] == pytest.approx(expected)


@pytest.mark.parametrize(("tau", "expected"), [("staleness", -1.0), ("boxes", -0.5)])
def test_adam_sa_first_step(tau: str, expected: float) -> None:
    # Alg. 10, first update: m_hat = g / tau, u_hat = g^2, so delta = -lr (g / tau) / |g| = -1 / tau at lr 1.
    rule = adam_sa(lr=1.0, beta1=0.5, beta2=0.5, eps=1e-12, tau=tau)
    delta, _ = rule.update(t(2.0), rule.init(t(0.0)), t(0.0), ctx(0, 1))
    assert float(delta) == pytest.approx(expected)


@pytest.mark.parametrize(("tau", "expected"), [("staleness", -4.0), ("boxes", -2.0)])
def test_fasgd_first_step(tau: str, expected: float) -> None:
    # gamma = beta = 0.5, g = 2: n = 2, b = 1, sqrt(n - b^2) = 1, v = 0.5; delta = -lr g / (v tau) = -4 / tau.
    rule = fasgd(lr=1.0, gamma=0.5, beta=0.5, eps=1e-12, tau=tau)
    delta, _ = rule.update(t(2.0), rule.init(t(0.0)), t(0.0), ctx(0, 1))
    assert float(delta) == pytest.approx(expected)


def test_fresh_gradients_are_untouched_either_way() -> None:
    for tau in ("staleness", "boxes"):
        g, _ = staleness_aware(tau).update(t(3.0), (), t(0.0), ctx(0, 0))
        assert float(g) == 3.0


@pytest.mark.parametrize("build", [staleness_aware, lambda tau: adam_sa(tau=tau), lambda tau: fasgd(tau=tau)])
def test_an_unknown_tau_is_refused_naming_it(build) -> None:
    with pytest.raises(ValueError, match="tau='delay' must be one of staleness, boxes"):
        build("delay")


def composed(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("method", ["sa", "sa_step", "dana_sa", "adam_sa", "fasgd"])
def test_penalty_tau_reaches_every_sa_variant_from_the_command_line(method: str) -> None:
    # One key, penalty.tau, for the penalties (sa, sa_step, dana_sa) and the optimizers that penalise inside
    # (adam_sa, fasgd read it through their config): the first update of a staleness-1 gradient halves under boxes.
    deltas = {}
    for tau in ("staleness", "boxes"):
        cfg = composed("sync=async", f"method={method}", f"penalty.tau={tau}")
        schema.check(cfg)
        penalty, optimizer = combine(instantiate(cfg.penalty), instantiate(cfg.optimizer))
        params = torch.zeros(3)
        grad, _ = penalty.update(torch.full((3,), 2.0), penalty.init(params), params, ctx(0, 1, workers=2))
        delta, _ = optimizer.update(grad, optimizer.init(params), params, ctx(0, 1, workers=2))
        deltas[tau] = delta
    ratio = (deltas["boxes"] / deltas["staleness"]).tolist()
    # Adam-SA's first step is m_hat / sqrt(u_hat): the penalty on m alone shows as the same factor 1/2.
    assert ratio == pytest.approx([0.5, 0.5, 0.5])


def test_a_bad_penalty_tau_is_one_line_naming_the_key() -> None:
    cfg = composed("method=sa", "penalty.tau=delay")
    with pytest.raises(schema.ConfigError, match=r"^penalty\.tau='delay' must be one of staleness, boxes$"):
        schema.check(cfg)
