"""DANA, DANA-SA, DANA-GA (001_... Alg. 6-8) through the server, worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from collsync.policy import asynchronous, bsp
from collsync.rules import dana, gap_aware, staleness_aware
from collsync.server import Server
from collsync.types import Arrival, Context


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_dana_per_worker_momentum_and_look_ahead_view():
    # lr 0.1, gamma 0.5, theta_0 = [1, 1]; the estimate is theta - 0.1 * 0.5 * sum_j v_j.
    server = Server(t(1.0, 1.0), dana(lr=0.1, momentum=0.5), asynchronous(), 2)
    assert torch.equal(server.view(), t(1.0, 1.0))

    server.accept(Arrival(0, 0, t(1.0, 0.0)))  # v_0 = [1, 0]
    torch.testing.assert_close(server.params, t(1.0 - 0.1, 1.0))
    torch.testing.assert_close(server.view(), t(0.9 - 0.05 * 1.0, 1.0))
    assert len(server.opt_state.v) == 2  # allocated for every worker on the first gradient

    server.accept(Arrival(1, 0, t(0.0, 2.0)))  # v_1 = [0, 2]; sum = [1, 2]
    torch.testing.assert_close(server.params, t(0.9, 1.0 - 0.2))
    torch.testing.assert_close(server.view(), t(0.9 - 0.05 * 1.0, 0.8 - 0.05 * 2.0))

    server.accept(Arrival(0, 1, t(2.0, 2.0)))  # v_0 = 0.5 [1, 0] + [2, 2] = [2.5, 2]; sum = [2.5, 4]
    theta = [0.9 - 0.1 * 2.5, 0.8 - 0.1 * 2.0]  # [0.65, 0.6]
    torch.testing.assert_close(server.params, t(*theta))
    torch.testing.assert_close(server.view(), t(theta[0] - 0.05 * 2.5, theta[1] - 0.05 * 4.0))
    torch.testing.assert_close(server.opt_state.v[1], t(0.0, 2.0))


def test_dana_sa_divides_what_enters_v_i():
    # Alg. 7: v_i <- gamma v_i + g / tau. Three workers read theta_0; worker 0 reads again at version 1.
    server = Server(t(0.0, 0.0), dana(lr=0.1, momentum=0.5), asynchronous(), 3, penalty=staleness_aware())
    server.accept(Arrival(0, 0, t(2.0, 0.0)))  # tau 0 -> 1: v_0 = [2, 0]
    server.accept(Arrival(1, 0, t(0.0, 2.0)))  # tau 1: v_1 = [0, 2]
    server.accept(Arrival(2, 0, t(4.0, 4.0)))  # tau 2: v_2 = [2, 2]
    server.accept(Arrival(0, 1, t(6.0, 0.0)))  # tau 2: v_0 = 0.5 [2, 0] + [3, 0] = [4, 0]
    theta = [-0.1 * (2.0 + 2.0 + 4.0), -0.1 * (2.0 + 2.0)]  # [-0.8, -0.4]
    torch.testing.assert_close(server.params, t(*theta))
    total = [4.0 + 0.0 + 2.0, 0.0 + 2.0 + 2.0]
    torch.testing.assert_close(server.view(), t(theta[0] - 0.05 * total[0], theta[1] - 0.05 * total[1]))


def test_dana_ga_measures_the_gap_from_the_estimate_the_worker_read():
    # Alg. 8: G = |theta_k - theta_i|, theta_i the estimate sent to worker i (the view), not theta at its version.
    eps = 1e-8
    pen = gap_aware(eta_max=1.0, beta=0.5, eps=eps, momentum=0.0)
    server = Server(t(1.0, 1.0), dana(lr=0.1, momentum=0.5), asynchronous(), 2, penalty=pen)
    server.accept(Arrival(0, 0, t(1.0, 0.0)))  # read theta_0 = theta: G = 1; v_0 = [1, 0]
    theta1, view1 = [0.9, 1.0], [0.85, 1.0]
    torch.testing.assert_close(server.view(), t(*view1))

    # Worker 1 read view_0 = [1, 1]; gap = theta_1 - [1, 1] = [-0.1, 0].
    # Alg. 14 (gamma 0): m = 0.5 (0.5 [1, 0]) + 0.5 [1, 4] = [0.75, 2]; m_hat = m / 0.75 = [1, 8/3]; C = sqrt + eps.
    server.accept(Arrival(1, 0, t(1.0, 2.0)))
    g1 = [1.0 / (0.1 / (1.0 + eps) + 1.0), 2.0]  # v_1
    theta2 = [theta1[0] - 0.1 * g1[0], theta1[1] - 0.1 * g1[1]]
    torch.testing.assert_close(server.params, t(*theta2))
    total = [1.0 + g1[0], g1[1]]
    torch.testing.assert_close(server.view(), t(theta2[0] - 0.05 * total[0], theta2[1] - 0.05 * total[1]))

    # Worker 0 read view_1 = [0.85, 1]: gap = theta_2 - view_1.
    # m = 0.5 [0.75, 2] + 0.5 [4, 4] = [2.375, 3]; m_hat = m / 0.875.
    server.accept(Arrival(0, 1, t(2.0, 2.0)))
    c = [math.sqrt(2.375 / 0.875) + eps, math.sqrt(3.0 / 0.875) + eps]
    gap = [abs(theta2[0] - view1[0]) / c[0] + 1.0, abs(theta2[1] - view1[1]) / c[1] + 1.0]
    v0 = [0.5 * 1.0 + 2.0 / gap[0], 0.5 * 0.0 + 2.0 / gap[1]]
    torch.testing.assert_close(server.params, t(theta2[0] - 0.1 * v0[0], theta2[1] - 0.1 * v0[1]))
    # Measured from theta_1 (the parameters at the worker's version) instead of the estimate, the gap would differ.
    assert abs(theta2[0] - view1[0]) != pytest.approx(abs(theta2[0] - theta1[0]))


def test_dana_allocates_lazily_and_refuses_averaged_updates():
    rule = dana(lr=0.1)
    params = t(0.0)
    state = rule.init(params)
    assert state.v == ()
    _, state = rule.update(t(1.0), state, params, Context(0, 2, 0, 1))  # worker id beyond ctx.workers: grown
    assert len(state.v) == 3 and torch.equal(state.v[2], t(1.0)) and torch.equal(state.v[0], t(0.0))
    server = Server(t(0.0), dana(), bsp(), 2)
    server.accept(Arrival(0, 0, t(1.0), 0))
    with pytest.raises(ValueError, match="dana: an update averaged 2 gradients"):
        server.accept(Arrival(1, 0, t(1.0), 0))
