"""Staleness-Aware (both variants), FASGD, B-FASGD's probability, the learning-rate wrappers, `combine`, and input
validation of every rule. Expected values are worked out by hand in each test, from the papers' equations.

The other rules: test_rules_gap.py (Gap-Aware), test_rules_dana.py (DANA family), test_rules_adam.py (Adam-SA/GA),
test_rules_server.py (equivalences at staleness 0, convergence through the server, Hydra configs).
"""

from __future__ import annotations

import math

import pytest
import torch

from collsync.policy import asynchronous, bfasgd
from collsync.rules import (
    Rule,
    adam_ga,
    adam_sa,
    bfasgd_probability,
    chain,
    combine,
    dana,
    fasgd,
    gap_aware,
    gradual_warmup,
    identity,
    linear_scaling,
    momentum,
    nesterov,
    rmsprop,
    sgd,
    staleness_aware,
    staleness_aware_step,
)
from collsync.rules.base import SIGNAL
from collsync.server import Server
from collsync.trace import Trace
from collsync.types import Arrival, Context


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def ctx(step: int = 0, staleness: int = 0, worker: int = 0, workers: int = 1, read=None, aggregated: int = 1):
    return Context(step, worker, staleness, workers, read, aggregated)


def run(rule: Rule, params: torch.Tensor, arrivals: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """Feed (gradient, staleness) pairs to a rule at fixed params; the deltas it returns."""
    state = rule.init(params)
    deltas = []
    for step, (g, tau) in enumerate(arrivals):
        delta, state = rule.update(g, state, params, ctx(step, tau))
        deltas.append(delta)
    return deltas


ARRIVALS = [(t(1.0, -2.0), 0), (t(4.0, 2.0), 2), (t(3.0, 3.0), 3)]


def test_staleness_aware_gradient_variant_divides_inside_momentum():
    # 001_... Alg. 5: v <- 0.9 v + g / tau; delta = -0.1 v (tau = 0 counts as 1).
    deltas = run(chain(staleness_aware(), momentum(lr=0.1, momentum=0.9)), t(0.0, 0.0), ARRIVALS)
    v1 = [1.0, -2.0]
    v2 = [0.9 * 1.0 + 4.0 / 2, 0.9 * -2.0 + 2.0 / 2]  # [2.9, -0.8]
    v3 = [0.9 * v2[0] + 3.0 / 3, 0.9 * v2[1] + 3.0 / 3]  # [3.61, 0.28]
    for delta, v in zip(deltas, [v1, v2, v3], strict=True):
        torch.testing.assert_close(delta, t(-0.1 * v[0], -0.1 * v[1]))


def test_staleness_aware_step_variant_divides_the_step_not_the_buffer():
    # 001_... Alg. 3: v <- 0.9 v + g; delta = -(0.1 / tau) v.
    deltas = run(staleness_aware_step(momentum(lr=0.1, momentum=0.9)), t(0.0, 0.0), ARRIVALS)
    v1 = [1.0, -2.0]
    v2 = [0.9 * 1.0 + 4.0, 0.9 * -2.0 + 2.0]  # [4.9, 0.2]
    v3 = [0.9 * v2[0] + 3.0, 0.9 * v2[1] + 3.0]  # [7.41, 3.18]
    for delta, v, tau in zip(deltas, [v1, v2, v3], [1, 2, 3], strict=True):
        torch.testing.assert_close(delta, t(-0.1 / tau * v[0], -0.1 / tau * v[1]))


def test_sasgd_of_002_is_both_variants_under_plain_sgd():
    # 002_... eq. 1: theta <- theta - (alpha / tau) g; without momentum the two variants agree.
    grad_variant = run(chain(staleness_aware(), sgd(lr=0.1)), t(0.0, 0.0), ARRIVALS)
    step_variant = run(staleness_aware_step(sgd(lr=0.1)), t(0.0, 0.0), ARRIVALS)
    for a, b, (g, tau) in zip(grad_variant, step_variant, ARRIVALS, strict=True):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, -0.1 / max(tau, 1) * g)


def test_nesterov_is_the_nag_of_001_without_dampening():
    # 001_... C.4: "momentum 0.9 with NAG, dampening 0": v <- 0.9 v + g; delta = -0.1 (g + 0.9 v).
    deltas = run(nesterov(lr=0.1, momentum=0.9), t(0.0), [(t(1.0), 0), (t(2.0), 0)])
    torch.testing.assert_close(deltas[0], t(-0.1 * (1.0 + 0.9 * 1.0)))
    torch.testing.assert_close(deltas[1], t(-0.1 * (2.0 + 0.9 * (0.9 * 1.0 + 2.0))))
    # The same as torch.optim.SGD(nesterov=True), the optimizer the paper's hyperparameters describe.
    p = torch.nn.Parameter(t(0.0))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True)
    for g in (1.0, 2.0):
        p.grad = t(g)
        opt.step()
    torch.testing.assert_close(p.detach(), deltas[0] + deltas[1])


def test_fasgd_follows_eqs_4_to_8():
    rule = fasgd(lr=0.1, gamma=0.5, beta=0.5, eps=1.0)
    g1, g2 = t(2.0, 0.0), t(0.0, 4.0)
    d1, d2 = run(rule, t(0.0, 0.0), [(g1, 0), (g2, 2)])
    # Arrival 1: n = 0.5 g^2 = [2, 0]; b = 0.5 g = [1, 0]; n - b^2 = [1, 0];
    # v = 0.5 / sqrt([1 + 1, 0 + 1]); delta = -0.1 / (v * 1) * g.
    v1 = [0.5 / math.sqrt(2.0), 0.5 / math.sqrt(1.0)]
    torch.testing.assert_close(d1, t(-0.1 * 2.0 / v1[0], -0.1 * 0.0 / v1[1]))
    # Arrival 2 (tau = 2): n = 0.5 [2, 0] + 0.5 [0, 16] = [1, 8]; b = 0.5 [1, 0] + 0.5 [0, 4] = [0.5, 2];
    # n - b^2 = [0.75, 4]; v = 0.5 v1 + 0.5 / sqrt([1.75, 5]).
    v2 = [0.5 * v1[0] + 0.5 / math.sqrt(1.75), 0.5 * v1[1] + 0.5 / math.sqrt(5.0)]
    torch.testing.assert_close(d2, t(-0.1 * 0.0 / (v2[0] * 2), -0.1 * 4.0 / (v2[1] * 2)))


def test_bfasgd_probability_is_eq_9():
    # 1 / (1 + c / (v + eps)) with v = 3, c = 1, eps = 1: 1 / (1 + 1/4) = 0.8.
    assert bfasgd_probability(3.0, c=1.0, eps=1.0) == pytest.approx(0.8)
    assert bfasgd_probability(t(1.0, 5.0), c=1.0, eps=1.0) == pytest.approx(0.8)  # v is the mean over parameters
    assert bfasgd_probability(0.5, c=0.0) == 1.0  # c = 0: always transmit
    assert bfasgd_probability(1e-3, c=10.0) < bfasgd_probability(1e3, c=10.0)  # large v: transmit more
    with pytest.raises(ValueError, match="c=-0.5 must be >= 0"):
        bfasgd_probability(1.0, c=-0.5)


def test_bfasgd_v_reads_fasgd_state_through_the_server():
    # FASGD reports v as its signal through the wrapper, and the server publishes it with every version.
    server = Server(t(0.0, 0.0), gradual_warmup(fasgd(lr=0.1), warmup=2, workers=2), asynchronous(), 2)
    server.accept(Arrival(0, 0, t(2.0, 0.0)))
    # Arrival 1 with gamma = beta = 0.9, eps = 1e-8: n = [0.4, 0], b = [0.2, 0], n - b^2 = [0.36, 0];
    # v = 0.1 / sqrt([0.36 + 1e-8, 1e-8]).
    expected = (0.1 / math.sqrt(0.36 + 1e-8) + 0.1 / math.sqrt(1e-8)) / 2
    assert server.stamp().signal == pytest.approx(expected)
    with pytest.raises(ValueError, match="optimizer=fasgd"):
        Server(t(0.0), sgd(), bfasgd(), 1)


def test_gradual_warmup_ramps_from_lr_over_n_with_momentum_correction():
    # 001_... C.4: s_k = 1/N + (1 - 1/N) k / warmup, N = 4, warmup = 4: 0.25, 0.4375, 0.625, 0.8125, then 1.
    g = t(1.0, -1.0)
    deltas = run(gradual_warmup(sgd(lr=1.0), warmup=4, workers=4), t(0.0, 0.0), [(g, 0)] * 6)
    for delta, s in zip(deltas, [0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0], strict=True):
        torch.testing.assert_close(delta, -s * g)

    # RMSProp keeps eta inside its buffer; Goyal et al.'s momentum correction rescales that buffer by
    # eta_k / eta_{k-1}. Reference: mom_k = 0.9 (eta_k / eta_{k-1}) mom_{k-1} + eta_k g / sqrt(ms_k + 1).
    grads = [t(1.0, 2.0), t(-3.0, 0.5), t(2.0, 2.0), t(0.5, -1.0), t(1.0, 1.0)]
    deltas = run(gradual_warmup(rmsprop(lr=0.1), warmup=4, workers=4), t(0.0, 0.0), [(g, 0) for g in grads])
    ms, mom, eta_prev = t(0.0, 0.0), t(0.0, 0.0), None
    for k, (g, delta) in enumerate(zip(grads, deltas, strict=True)):
        eta = 0.1 * (0.25 + 0.75 * min(1.0, k / 4))
        ms = 0.9 * ms + 0.1 * g * g
        mom = (0.0 if eta_prev is None else 0.9 * eta / eta_prev) * mom + eta * g / torch.sqrt(ms + 1.0)
        torch.testing.assert_close(delta, -mom)
        eta_prev = eta


def test_gradual_warmup_rescales_a_look_ahead_view():
    # DANA's view theta - eta gamma v uses the warmed-up eta of the step just taken (s_0 = 1/2 with N = 2).
    rule = gradual_warmup(dana(lr=0.1, momentum=0.5), warmup=10, workers=2)
    params = t(1.0, 1.0)
    state = rule.init(params)
    delta, state = rule.update(t(2.0, 0.0), state, params, ctx(workers=2))
    torch.testing.assert_close(delta, t(-0.5 * 0.1 * 2.0, 0.0))
    torch.testing.assert_close(rule.view(params, state), t(1.0 - 0.5 * 0.1 * 0.5 * 2.0, 1.0))


def test_linear_scaling_multiplies_the_step_by_d_over_c():
    # 003_... Alg. 1 line 13: eta d / c. Through the server: quorum c = 2, a timeout flushes a single gradient.
    server = Server(t(0.0, 0.0), linear_scaling(sgd(lr=0.1), c=2), asynchronous(quorum=2, timeout=1.0), 3)
    server.accept(Arrival(0, 0, t(1.0, 2.0)))
    server.accept(Arrival(1, 0, t(3.0, 4.0)))
    # d = 2 = c: theta = -0.1 * mean = -0.1 * [2, 3]
    torch.testing.assert_close(server.params, t(-0.2, -0.3))
    server.accept(Arrival(2, 0, t(4.0, 4.0)))
    assert server.flush()
    # d = 1: theta -= 0.1 * (1 / 2) * [4, 4]
    torch.testing.assert_close(server.params, t(-0.2 - 0.2, -0.3 - 0.2))
    deltas = run(linear_scaling(sgd(lr=0.1), c=1), t(0.0), [(t(1.0), 0)])
    assert torch.equal(deltas[0], run(sgd(lr=0.1), t(0.0), [(t(1.0), 0)])[0])


def test_combine_places_each_penalty():
    opt = momentum()
    pen = staleness_aware()
    assert combine(pen, opt) == (pen, opt)
    p, o = combine(None, opt)
    assert o is opt and p.update(t(1.0), (), t(0.0), ctx(staleness=5))[0].item() == 1.0
    # A function of the optimizer (what `_partial_: true` instantiates) wraps it; the penalty becomes the identity.
    p, o = combine(staleness_aware_step, sgd(lr=1.0))
    assert p.update(t(6.0), p.init(t(0.0)), t(0.0), ctx(staleness=3))[0].item() == 6.0
    assert o.update(t(6.0), o.init(t(0.0)), t(0.0), ctx(staleness=3))[0].item() == -2.0
    with pytest.raises(TypeError, match="not a Rule"):
        combine(lambda optimizer: 3, opt)
    with pytest.raises(TypeError, match="optimizer must be a Rule"):
        combine(pen, "sgd")  # type: ignore[arg-type]
    assert combine(identity(), opt)[1] is opt


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: gap_aware(eps=0.0), r"gap_aware: eps=0.0 must be > 0"),
        (lambda: gap_aware(eta_max=-1.0), r"gap_aware: eta_max=-1.0 must be > 0"),
        (lambda: gap_aware(beta=1.0), r"gap_aware: beta=1.0 must be in \[0, 1\)"),
        (lambda: gap_aware(momentum=-0.1), r"gap_aware: momentum=-0.1 must be in \[0, 1\)"),
        (lambda: gap_aware(weight_decay=-1e-4), r"gap_aware: weight_decay=-0.0001 must be >= 0"),
        (lambda: gap_aware(granularity="row"), r"gap_aware: granularity='row' must be one of"),
        (lambda: gap_aware(granularity="layer", layers=[(0, 2), (3, 4)]), r"gap_aware: layers must tile"),
        (lambda: gap_aware(granularity="layer", layers=[]), r"gap_aware: layers must list"),
        (lambda: fasgd(lr=0.0), r"fasgd: lr=0.0 must be > 0"),
        (lambda: fasgd(gamma=1.0), r"fasgd: gamma=1.0 must be in \[0, 1\)"),
        (lambda: fasgd(beta=-0.5), r"fasgd: beta=-0.5 must be in \[0, 1\)"),
        (lambda: fasgd(eps=-1.0), r"fasgd: eps=-1.0 must be > 0"),
        (lambda: bfasgd_probability(1.0, c=1.0, eps=0.0), r"bfasgd: eps=0.0 must be > 0"),
        (lambda: bfasgd_probability(-2.0, c=1.0), r"bfasgd: v=-2.0 must be >= 0"),
        (lambda: dana(lr=-0.1), r"dana: lr=-0.1 must be > 0"),
        (lambda: dana(momentum=1.0), r"dana: momentum=1.0 must be in \[0, 1\)"),
        (lambda: dana(weight_decay=-1.0), r"dana: weight_decay=-1.0 must be >= 0"),
        (lambda: adam_sa(lr=0.0), r"adam_sa: lr=0.0 must be > 0"),
        (lambda: adam_sa(beta2=1.5), r"adam_sa: beta2=1.5 must be in \[0, 1\)"),
        (lambda: adam_ga(lr=0.0), r"adam_ga: lr=0.0 must be > 0"),
        (lambda: adam_ga(beta1=1.0), r"adam_ga: beta1=1.0 must be in \[0, 1\)"),
        (lambda: adam_ga(gap_eps=0.0), r"adam_ga: gap_eps=0.0 must be > 0"),
        (lambda: adam_ga(eta_max=-3.0), r"adam_ga: eta_max=-3.0 must be > 0"),
        (lambda: adam_ga(beta=1.0), r"adam_ga: beta=1.0 must be in \[0, 1\)"),
        (lambda: gradual_warmup(sgd(), warmup=-1), r"gradual_warmup: warmup=-1 must be"),
        (lambda: gradual_warmup(sgd(), warmup=5, workers=0), r"gradual_warmup: workers=0 must be"),
        (lambda: linear_scaling(sgd(), c=0), r"linear_scaling: c=0 must be"),
    ],
)
def test_rules_reject_bad_values_naming_them(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_wrappers_reject_a_non_rule():
    for wrap in (staleness_aware_step, lambda o: gradual_warmup(o, 1), lambda o: linear_scaling(o, 1)):
        with pytest.raises(TypeError, match="must be a Rule"):
            wrap("momentum")  # type: ignore[arg-type]


def test_rules_report_their_statistics_through_chains_and_wrappers():
    # Gap-Aware's mean Gap and FASGD's v (the signal) come from the rules themselves, however they are composed.
    params, read = t(1.0, 1.0), t(0.0, 1.0)
    ctx = Context(step=0, worker=0, staleness=1, read=read)
    penalty = chain(identity(), gap_aware(eta_max=1.0, beta=0.5, eps=1e-8, momentum=0.0))
    _, state = penalty.update(t(2.0, 2.0), penalty.init(params), params, ctx)
    # v = g; m_hat = g^2, C = |g| = 2; G = |theta - read| / C + 1 = [1.5, 1]: mean 1.25.
    assert penalty.stats(state) == {"gap": pytest.approx(1.25)}
    assert identity().stats is None and chain(identity(), sgd()).stats is None
    optimizer = linear_scaling(staleness_aware_step(fasgd(lr=0.1)), c=1)
    _, state = optimizer.update(t(2.0, 0.0), optimizer.init(params), params, ctx)
    expected = (0.1 / math.sqrt(0.36 + 1e-8) + 0.1 / math.sqrt(1e-8)) / 2
    assert optimizer.stats(state) == {SIGNAL: pytest.approx(expected)}
    both = chain(gap_aware(), fasgd())
    assert set(both.stats(both.init(params))) == {"gap", SIGNAL}


def test_an_optimizer_statistic_is_recorded_per_update_of_one_gradient():
    # Adam-GA measures its Gap inside the optimizer: the apply event of a one-gradient update records it, and the
    # server publishes no signal (Adam-GA reports none).
    server = Server(t(0.0, 0.0), adam_ga(lr=0.1), asynchronous(), 2, trace=Trace())
    server.accept(Arrival(0, 0, t(1.0, 2.0)))
    server.accept(Arrival(1, 0, t(1.0, 2.0)))
    first, second = server.trace.of("apply")
    assert first["gap"] == [1.0] and second["gap"][0] > 1.0
    assert server.stamp().signal == 0.0
