"""Adam-SA and Adam-GA (001_... Alg. 10-11): the penalty reaches the first moment only. Worked out by hand."""

from __future__ import annotations

import math

import torch

from collsync.rules import adam, adam_ga, adam_sa, chain, staleness_aware
from collsync.types import Context

EPS = 1e-8


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def ctx(step: int, staleness: int, read: torch.Tensor | None = None) -> Context:
    return Context(step, 0, staleness, 1, read)


def test_adam_sa_penalises_the_first_moment_only():
    rule = adam_sa(lr=0.1, beta1=0.5, beta2=0.5, eps=EPS)
    params = t(0.0, 0.0)
    state = rule.init(params)
    # Arrival 1 (tau 0 -> 1): m = 0.5 [2, -1] = [1, -0.5]; u = 0.5 [4, 1] = [2, 0.5];
    # m_hat = [2, -1]; u_hat = [4, 1]; delta = -0.1 m_hat / (sqrt(u_hat) + eps).
    d1, state = rule.update(t(2.0, -1.0), state, params, ctx(0, 0))
    torch.testing.assert_close(d1, t(-0.1 * 2.0 / (2.0 + EPS), -0.1 * -1.0 / (1.0 + EPS)))
    # Arrival 2 (tau 3), g = [3, 3]: m = 0.5 [1, -0.5] + 0.5 [3/3, 3/3] = [1, 0.25];
    # u = 0.5 [2, 0.5] + 0.5 [9, 9] = [5.5, 4.75] (the unpenalised gradient); bias corrections 1 - 0.25 = 0.75.
    d2, state = rule.update(t(3.0, 3.0), state, params, ctx(1, 3))
    m_hat, u_hat = [1.0 / 0.75, 0.25 / 0.75], [5.5 / 0.75, 4.75 / 0.75]
    expected = [-0.1 * m_hat[i] / (math.sqrt(u_hat[i]) + EPS) for i in range(2)]
    torch.testing.assert_close(d2, t(*expected))
    torch.testing.assert_close(state.u, t(5.5, 4.75))

    # Penalising in front of Adam instead divides both moments; on the first step they cancel (App. C.1).
    pre = chain(staleness_aware(), adam(lr=0.1))
    d_pre, _ = pre.update(t(3.0, 3.0), pre.init(params), params, ctx(0, 3))
    d_adam, _ = adam(lr=0.1).update(t(3.0, 3.0), adam(lr=0.1).init(params), params, ctx(0, 0))
    torch.testing.assert_close(d_pre, d_adam)


def test_adam_ga_penalises_the_first_moment_by_the_gap():
    rule = adam_ga(lr=0.1, beta1=0.5, beta2=0.5, eps=EPS, eta_max=1.0, beta=0.5, gap_eps=EPS)
    assert rule.needs_read
    params = t(1.0, 1.0)
    state = rule.init(params)
    # Arrival 1, read == params: G = 1, plain Adam. Alg. 14 with gamma = 0: m_C = 0.5 [4, 1] = [2, 0.5].
    d1, state = rule.update(t(2.0, -1.0), state, params, ctx(0, 0, params.clone()))
    torch.testing.assert_close(d1, t(-0.1 * 2.0 / (2.0 + EPS), -0.1 * -1.0 / (1.0 + EPS)))
    torch.testing.assert_close(state.gap.m, t(2.0, 0.5))

    # Arrival 2: read [0, 1.5], gap |[1, -0.5]|. m_C = 0.5 [2, 0.5] + 0.5 [9, 9] = [5.5, 4.75]; m_C_hat = m_C / 0.75;
    # C = sqrt(m_C_hat) + eps; G = |gap| / C + 1; m = 0.5 m_1 + 0.5 g / G; u = 0.5 u_1 + 0.5 g^2.
    d2, state = rule.update(t(3.0, 3.0), state, params, ctx(1, 2, t(0.0, 1.5)))
    c = [math.sqrt(5.5 / 0.75) + EPS, math.sqrt(4.75 / 0.75) + EPS]
    gap = [1.0 / c[0] + 1.0, 0.5 / c[1] + 1.0]
    m = [0.5 * 1.0 + 0.5 * 3.0 / gap[0], 0.5 * -0.5 + 0.5 * 3.0 / gap[1]]
    u = [0.5 * 2.0 + 0.5 * 9.0, 0.5 * 0.5 + 0.5 * 9.0]
    expected = [-0.1 * (m[i] / 0.75) / (math.sqrt(u[i] / 0.75) + EPS) for i in range(2)]
    torch.testing.assert_close(state.m, t(*m))
    torch.testing.assert_close(state.u, t(*u))
    torch.testing.assert_close(d2, t(*expected))


def test_adam_ga_eta_max_defaults_to_lr():
    # Same data, eta_max left out with lr = 1: C = 1 * sqrt(m_C_hat) + eps, the same G as eta_max = 1.0 above.
    params = t(1.0, 1.0)
    default, explicit = adam_ga(lr=1.0), adam_ga(lr=1.0, eta_max=1.0)
    s1, s2 = default.init(params), explicit.init(params)
    for step, (g, read) in enumerate([(t(2.0, -1.0), params.clone()), (t(3.0, 3.0), t(0.0, 1.5))]):
        d1, s1 = default.update(g, s1, params, ctx(step, step, read))
        d2, s2 = explicit.update(g, s2, params, ctx(step, step, read))
        assert torch.equal(d1, d2)
