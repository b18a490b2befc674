"""Momentum with a look-ahead read for stale rounds (SSP): DANA's estimate with the horizon the rounds are stale by.

A worker under SSP computes the gradient of round c on parameters read at version c - d (d <= max_lead, 004_...
§II-C), and the server applies it at version c. In between, the server's momentum alone carries the parameters d
steps further; with g = 0 in those steps (heavy ball, v <- gamma v; theta <- theta - eta v),

    theta_c = theta_{c-d} - eta (gamma + ... + gamma^d) v = theta_{c-d} - eta gamma (1 - gamma^d) / (1 - gamma) v.

The server publishes that estimate (`view`), so the gradient is computed where momentum is taking the parameters:
DANA's look-ahead (001_... App. C.1, Alg. 6; Hakimi et al., "Taming momentum in a distributed asynchronous
environment"), whose d is one update of each other worker, here the rounds' own staleness. d is not known when the
server publishes, so it is the running mean of the staleness the server has seen (`Context.staleness`, updates
between a round's read and its apply), or a fixed `horizon`. At d = 0 (BSP) the view is theta itself and the rule is
`collsync.rules.momentum`, bit for bit.

Why: without it an SSP run at the lr of synchronous rounds and momentum 0.9 diverges (the delay adds a momentum of
its own, Mitliagkas et al., 2016); at lr / (1 + max_lead) it is safe but slow (digits, 4 workers, 8 epochs: 0.81
where BSP reaches 0.95).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from collsync.rules.base import Rule, check_decay, check_lr, check_milestones, check_unit, pure, step_lr
from collsync.rules.optim import MomentumState
from collsync.rules.optim import momentum as heavy_ball
from collsync.types import Context, Flat


class LookaheadState(NamedTuple):
    """The momentum buffer v, the staleness estimate d (running mean, or the fixed horizon) and eta_k of the last
    update (the estimate extrapolates at the step just taken)."""

    v: torch.Tensor
    horizon: float
    eta: float


def lookahead_distance(momentum: float, horizon: float, nesterov: bool = False) -> float:
    """sum_{k=1..d} gamma^k (heavy ball) or sum_{k=2..d+1} gamma^k (Nesterov, whose step is gamma v): how many v's
    of momentum the next d updates move the parameters by when no gradient arrives. d may be fractional (a mean)."""
    total = momentum * (1 - float(momentum**horizon)) / (1 - momentum)  # 0 at d = 0 or gamma = 0; gamma < 1 is checked
    return total * momentum if nesterov else total


def lookahead(
    lr: float = 0.1,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    horizon: float | None = None,
    smoothing: float = 0.9,
    warmup: int = 0,
    milestones: list[int] | None = None,
    lr_decay: float = 0.1,
) -> Rule:
    """Momentum (or NAG) whose published parameters look ahead by the rounds' staleness:

        v <- gamma v + g;   delta = -eta_k v  (NAG: -eta_k (gamma v + g));
        view = theta - eta_k D(d) v,   D(d) = gamma (1 - gamma^d) / (1 - gamma)   (NAG: gamma D(d)),
        d <- rho d + (1 - rho) tau   per update (tau: its staleness; `horizon` fixes d instead), rho = `smoothing`.

    The update is `collsync.rules.momentum`'s own (in place); this rule adds the estimate d and the view. Weight
    decay, warm-up and the step schedule are momentum's.
    """
    name = "lookahead"  # checked here so that a bad value is refused under this rule's name
    check_lr(name, lr)
    check_unit(name, "momentum", momentum)
    check_decay(name, weight_decay)
    steps = check_milestones(name, milestones, lr_decay)
    if horizon is not None and not horizon >= 0:
        raise ValueError(f"{name}: horizon={horizon!r} must be >= 0 (rounds of staleness), or null to measure it")
    if not 0 <= smoothing < 1:
        raise ValueError(f"{name}: smoothing={smoothing!r} must be in [0, 1)")
    inner = heavy_ball(lr, momentum, weight_decay, warmup, nesterov, milestones, lr_decay)
    momentum_step = inner.update_
    assert momentum_step is not None  # momentum steps in place

    def init(params: Flat) -> LookaheadState:
        return LookaheadState(inner.init(params).v, float(horizon or 0.0), step_lr(lr, warmup, 0, steps, lr_decay))

    def update_(grad: Flat, state: LookaheadState, params: Flat, ctx: Context) -> tuple[Flat, LookaheadState]:
        delta, stepped = momentum_step(grad, MomentumState(state.v), params, ctx)
        d = state.horizon if horizon is not None else smoothing * state.horizon + (1 - smoothing) * ctx.staleness
        return delta, LookaheadState(stepped.v, d, step_lr(lr, warmup, ctx.step, steps, lr_decay))

    def view(params: Flat, state: LookaheadState) -> Flat:
        distance = lookahead_distance(momentum, state.horizon, nesterov)
        if distance == 0:
            return params
        return params - (state.eta * distance) * state.v

    return Rule(init, pure(update_), view, update_=update_)
