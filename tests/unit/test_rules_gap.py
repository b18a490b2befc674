"""Gap-Aware (001_... Alg. 4, eqs. 12-13, C from Alg. 14, weight decay from C.5), worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from collsync.policy import asynchronous
from collsync.rules import gap_aware, sgd
from collsync.server import Server
from collsync.types import Arrival, Context

EPS = 1e-8


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def ctx(read: torch.Tensor, step: int = 0, staleness: int = 1) -> Context:
    return Context(step, 0, staleness, 1, read)


def test_parameter_wise_gap_with_alg_14_coefficient():
    rule = gap_aware(eta_max=1.0, beta=0.5, eps=EPS, momentum=0.5)
    state = rule.init(t(0.0, 0.0))

    # Arrival 1, read == current params: v = g = [2, -4]; m = 0.5 v^2 = [2, 8]; m_hat = m / (1 - 0.5) = [4, 16];
    # C = [2, 4] + eps; the Gap is 0 / C + 1 = 1, so the gradient passes unchanged.
    theta = t(5.0, 5.0)
    out, state = rule.update(t(2.0, -4.0), state, theta, ctx(theta.clone(), staleness=0))
    assert torch.equal(out, t(2.0, -4.0))
    torch.testing.assert_close(state.m, t(2.0, 8.0))
    assert state.k == 1

    # Arrival 2: theta = [1, 1] but the worker read [0, 3]: |gap| = [1, 2].
    # v = 0.5 [2, -4] + [1, 2] = [2, 0]; m = 0.5 [2, 8] + 0.5 [4, 0] = [3, 4]; m_hat = m / (1 - 0.25) = [4, 16/3];
    # C = [sqrt(4), sqrt(16/3)] + eps; G = |gap| / C + 1.
    out, state = rule.update(t(1.0, 2.0), state, t(1.0, 1.0), ctx(t(0.0, 3.0), step=1))
    c = [math.sqrt(4.0) + EPS, math.sqrt(16.0 / 3.0) + EPS]
    gap = [1.0 / c[0] + 1.0, 2.0 / c[1] + 1.0]
    torch.testing.assert_close(out, t(1.0 / gap[0], 2.0 / gap[1]))
    torch.testing.assert_close(state.v, t(2.0, 0.0))
    torch.testing.assert_close(state.m, t(3.0, 4.0))

    # Arrival 3: gap [0, -1] (only the second parameter moved): the first is not penalised at all.
    # v = 0.5 [2, 0] + [4, 4] = [5, 4]; m = 0.5 [3, 4] + 0.5 [25, 16] = [14, 10]; m_hat = m / (1 - 0.125).
    out, state = rule.update(t(4.0, 4.0), state, t(1.0, 1.0), ctx(t(1.0, 2.0), step=2))
    c2 = math.sqrt(10.0 / 0.875) + EPS
    torch.testing.assert_close(out, t(4.0, 4.0 / (1.0 / c2 + 1.0)))


def test_weight_decay_is_inside_the_penalised_gradient():
    # App. C.5: g + lambda theta is divided by the Gap (and is what Alg. 14's v accumulates).
    rule = gap_aware(eta_max=1.0, beta=0.5, eps=EPS, momentum=0.0, weight_decay=0.1)
    theta = t(2.0, -2.0)
    out, state = rule.update(t(1.0, 1.0), rule.init(theta), theta, ctx(t(1.0, -2.0)))
    g = [1.0 + 0.1 * 2.0, 1.0 + 0.1 * -2.0]  # [1.2, 0.8]
    # m = 0.5 g^2, m_hat = g^2, C = |g| + eps; gap = [1, 0].
    gap = [1.0 / (abs(g[0]) + EPS) + 1.0, 1.0]
    torch.testing.assert_close(out, t(g[0] / gap[0], g[1] / gap[1]))
    torch.testing.assert_close(state.v, t(*g))


LAYERS = [(0, 1), (1, 3)]


def layer_sequence(granularity: str, layers=None) -> list[torch.Tensor]:
    rule = gap_aware(eta_max=2.0, beta=0.5, eps=EPS, momentum=0.0, granularity=granularity, layers=layers)
    theta = t(0.0, 0.0, 0.0)
    state = rule.init(theta)
    out1, state = rule.update(t(3.0, 0.0, 4.0), state, theta, ctx(theta.clone(), staleness=0))
    out2, state = rule.update(t(1.0, 2.0, 2.0), state, t(6.0, 3.0, -4.0), ctx(t(0.0, 0.0, 0.0), step=1))
    return [out1, out2]


def test_layer_wise_gap_uses_l2_norms_per_layer():
    out1, out2 = layer_sequence("layer", LAYERS)
    assert torch.equal(out1, t(3.0, 0.0, 4.0))
    # Arrival 1: ||v_p||^2 = [9, 16]; m = 0.5 [9, 16]. Arrival 2: ||v_p||^2 = [1, 8];
    # m = 0.5 [4.5, 8] + 0.5 [1, 8] = [2.75, 8]; m_hat = m / 0.75; C = 2 sqrt(m_hat) + eps;
    # distances ||theta_p - read_p|| = [6, sqrt(9 + 16)] = [6, 5].
    c = [2.0 * math.sqrt(2.75 / 0.75) + EPS, 2.0 * math.sqrt(8.0 / 0.75) + EPS]
    gap = [6.0 / c[0] + 1.0, 5.0 / c[1] + 1.0]
    torch.testing.assert_close(out2, t(1.0 / gap[0], 2.0 / gap[1], 2.0 / gap[1]))


def test_global_gap_uses_one_norm_and_is_layer_wise_without_layers():
    out1, out2 = layer_sequence("global")
    assert torch.equal(out1, t(3.0, 0.0, 4.0))
    # ||v||^2: 25 then 9; m = 12.5 then 0.5 * 12.5 + 0.5 * 9 = 10.75; m_hat = 10.75 / 0.75; distance sqrt(61).
    c = 2.0 * math.sqrt(10.75 / 0.75) + EPS
    gap = math.sqrt(36.0 + 9.0 + 16.0) / c + 1.0
    torch.testing.assert_close(out2, t(1.0 / gap, 2.0 / gap, 2.0 / gap))
    for a, b in zip(layer_sequence("layer"), [out1, out2], strict=True):
        assert torch.equal(a, b)


def test_layers_must_cover_the_parameters():
    rule = gap_aware(granularity="layer", layers=LAYERS)
    with pytest.raises(ValueError, match="layers end at 3 but the parameters have 4 entries"):
        rule.init(t(0.0, 0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"gap_aware: ctx.read is None"):
        gap_aware().update(t(1.0), gap_aware().init(t(0.0)), t(0.0), Context(0, 0, 1))


def test_server_passes_the_parameters_the_worker_read():
    # Two workers read theta_0 = [0, 0]; worker 0's gradient moves theta to -0.5 * [2, 2] = [-1, -1]; worker 1's
    # (computed on theta_0) then has gap [-1, -1] and is penalised with C from the two gradients seen so far.
    server = Server(t(0.0, 0.0), sgd(lr=0.5), asynchronous(), 2, penalty=gap_aware(eta_max=0.5, beta=0.5, momentum=0.0))
    assert server.needs_read
    server.accept(Arrival(0, 0, t(2.0, 2.0)))
    torch.testing.assert_close(server.params, t(-1.0, -1.0))
    server.accept(Arrival(1, 0, t(4.0, 0.0)))
    # m = 0.5 (0.5 [4, 4]) + 0.5 [16, 0] = [9, 1]; m_hat = m / 0.75 = [12, 4/3]; C = 0.5 sqrt(m_hat) + 1e-8.
    c = [0.5 * math.sqrt(12.0) + EPS, 0.5 * math.sqrt(4.0 / 3.0) + EPS]
    g = [4.0 / (1.0 / c[0] + 1.0), 0.0]
    torch.testing.assert_close(server.params, t(-1.0 - 0.5 * g[0], -1.0 - 0.5 * g[1]))
