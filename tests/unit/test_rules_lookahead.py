"""The look-ahead momentum for SSP's stale rounds (collsync.rules.lookahead), through the server, worked by hand."""

from __future__ import annotations

import pytest
import torch

from collsync.policy import bsp, ssp
from collsync.rules import lookahead, momentum
from collsync.rules.base import plain, unplain
from collsync.rules.lookahead import lookahead_distance
from collsync.server import Server
from collsync.types import Arrival


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("d", [0, 1, 2.5, 3])
def test_lookahead_distance_is_the_sum_of_the_momentum_steps_to_come(gamma, d):
    """D(d) = gamma + ... + gamma^d (NAG: gamma^2 + ... + gamma^(d+1)), also at a fractional d (closed form)."""
    if d == int(d):
        want = sum(gamma**k for k in range(1, int(d) + 1))
        assert lookahead_distance(gamma, d) == pytest.approx(want)
        assert lookahead_distance(gamma, d, nesterov=True) == pytest.approx(gamma * want)
    else:
        assert lookahead_distance(gamma, 2) <= lookahead_distance(gamma, d) <= lookahead_distance(gamma, 3)


def test_without_staleness_it_is_momentum_bit_for_bit():
    """BSP's rounds are never stale: the estimate stays at 0 and every update and read equals heavy ball's."""
    torch.manual_seed(0)
    start = torch.randn(50, dtype=torch.float32)
    grads = [torch.randn(2, 50, dtype=torch.float32) for _ in range(6)]
    servers = [
        Server(start.clone(), rule(lr=0.3, momentum=0.9, weight_decay=0.01), bsp(), 2) for rule in (momentum, lookahead)
    ]
    for step, pair in enumerate(grads):
        for server in servers:
            for worker in (0, 1):
                server.accept(Arrival(worker, step, pair[worker].clone(), clock=step))
        assert torch.equal(servers[0].params, servers[1].params)
        assert torch.equal(servers[0].view(), servers[1].view())
    assert servers[1].opt_state.horizon == 0.0


def test_the_view_looks_ahead_by_the_measured_staleness():
    """SSP, bound 2, two workers: round 0 read at version 0 (staleness 0), rounds 1 and 2 also read at version 0
    (staleness 1, 2). d <- 0.5 d + 0.5 tau; step eta / max(1, tau); view = theta - (eta / tau) D(d + 1) v, none
    while d = 0."""
    lr, gamma, rho = 0.1, 0.5, 0.5
    server = Server(t(0.0, 0.0), lookahead(lr=lr, momentum=gamma, smoothing=rho), ssp(max_lead=2), 2)
    g = [t(1.0, 0.0), t(0.0, 2.0), t(2.0, 2.0)]
    theta, v, d = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), 0.0
    for clock, grad in enumerate(g):
        for worker in (0, 1):
            server.accept(Arrival(worker, 0, grad.clone(), clock=clock))
        tau = max(1, clock)  # this round's staleness: version clock - read version 0
        v = gamma * v + grad
        theta = theta - lr / tau * v
        d = rho * d + (1 - rho) * clock
        torch.testing.assert_close(server.params, theta)
        distance = gamma * (1 - gamma ** (d + 1)) / (1 - gamma) if d > 0 else 0.0
        torch.testing.assert_close(server.view(), theta - lr / tau * distance * v)
    assert server.opt_state.horizon == pytest.approx(d)


@pytest.mark.parametrize("d", [1, 2])
def test_a_stale_read_sees_the_parameters_its_round_is_applied_to_and_the_step_it_enters(d):
    """With no gradient in between (g = 0), momentum alone moves theta: a view read d rounds before its round is
    applied equals the parameters after that round's update, d + 1 updates on (DANA's look-ahead, 001_... Alg. 6,
    which moves the reader's own momentum too). One short (to the version it is applied at) fails this."""
    lr, gamma = 0.1, 0.5
    server = Server(t(1.0, -2.0), lookahead(lr=lr, momentum=gamma, horizon=d), ssp(max_lead=d), 1)
    server.accept(Arrival(0, 0, t(3.0, 1.0), clock=0))  # v != 0, at staleness 0: the step is lr itself
    seen = server.view().clone()
    for clock in range(1, d + 2):
        server.accept(Arrival(0, clock, t(0.0, 0.0), clock=clock))  # fresh reads: tau = 1, the step stays lr
    torch.testing.assert_close(server.params, seen)


def test_the_view_follows_the_mean_staleness_of_a_round_and_the_step_its_oldest_gradient():
    """Five workers, one of them (behind a slow link) a round stale in every round: d measures the rounds' mean
    staleness, 1/5, not their oldest gradient's 1 (a view a full round ahead for the four fresh gradients was less
    stable, and cost the Fashion-MNIST CNN 1.3 points: benchmarks/README.md); tau stays the oldest's."""
    lr, gamma, rho, n = 0.1, 0.5, 0.5, 5
    server = Server(t(0.0), lookahead(lr=lr, momentum=gamma, smoothing=rho), ssp(max_lead=1), n)
    for w in range(n):
        server.accept(Arrival(w, 0, t(1.0), clock=0))
    d = 0.0
    for clock in range(1, 4):
        for w in range(n):
            server.accept(Arrival(w, clock - 1 if w == n - 1 else clock, t(1.0), clock=clock))
        d = rho * d + (1 - rho) * (1 / n)
        assert server.opt_state.horizon == pytest.approx(d)
        assert server.opt_state.eta == pytest.approx(lr)  # tau = max(1, 1): the step is lr


def test_a_stale_round_steps_lr_over_its_staleness():
    """Staleness-Aware's step (001_... Alg. 3): a round applied 3 updates after its read moves theta by
    -(eta / 3) v, and a fresh one by -eta v."""
    lr, gamma = 0.3, 0.5
    server = Server(t(0.0), lookahead(lr=lr, momentum=gamma, horizon=0), ssp(max_lead=3), 1)
    server.accept(Arrival(0, 0, t(1.0), clock=0))  # fresh: v = 1, theta = -0.3
    torch.testing.assert_close(server.params, t(-0.3))
    for clock in (1, 2, 3):
        server.accept(Arrival(0, 0, t(0.0), clock=clock))  # read at version 0: staleness 1, 2, 3
    v3 = gamma**3
    want = -0.3 - lr * gamma - lr / 2 * gamma**2 - lr / 3 * v3
    torch.testing.assert_close(server.params, t(want))


def test_a_fixed_horizon_and_nesterov():
    """horizon=1 looks ahead through two updates from the first on; NAG steps -eta (g + gamma v) and looks ahead by
    gamma (gamma + gamma^2) v."""
    lr, gamma = 0.1, 0.5
    server = Server(t(1.0), lookahead(lr=lr, momentum=gamma, horizon=1, nesterov=True), ssp(max_lead=1), 1)
    server.accept(Arrival(0, 0, t(2.0), clock=0))  # v = 2; theta = 1 - 0.1 (2 + 0.5 * 2) = 0.7
    torch.testing.assert_close(server.params, t(0.7))
    torch.testing.assert_close(server.view(), t(0.7 - lr * gamma * (gamma + gamma**2) * 2.0))


@pytest.mark.parametrize(
    ("options", "match"),
    [({"horizon": -1}, "horizon=-1 must be >= 0"), ({"smoothing": 1.0}, "smoothing=1.0 must be in"), ({"lr": 0}, "lr")],
)
def test_bad_options_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        lookahead(**options)


def test_a_state_saved_under_single_momentum_is_refused_naming_both_shapes():
    """A server state saved before SSP's momentum became the look-ahead (one buffer) does not resume under it: the
    refusal shows what was saved and what this rule keeps, and says what to resume with."""
    params = torch.zeros(3)
    saved = plain(momentum(lr=0.1, momentum=0.9).init(params))
    expected = (
        r"the saved optimizer state \(\[tensor\[3\]\]\) does not fit this config's optimizer, whose state is "
        r"LookaheadState\(v=tensor\[3\], horizon, eta\): resume with the optimizer and options the checkpoint was"
    )
    with pytest.raises(ValueError, match=expected):
        unplain(lookahead(lr=0.1, momentum=0.9).init(params), saved, "optimizer")
    state = lookahead(lr=0.1, momentum=0.9).init(params)
    assert unplain(state, plain(state), "optimizer") == state  # and a state saved under it resumes
