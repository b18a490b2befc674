"""Momentum with a look-ahead read for stale rounds (SSP): DANA's estimate with the horizon the rounds are stale by.

A worker under SSP computes the gradient of round c on parameters read at version c - d (d <= max_lead, 004_...
§II-C), and the server applies it at version c, in the update that takes the parameters to c + 1. The server's
momentum alone carries the parameters through those d updates and the one the gradient enters; with g = 0 in them
(heavy ball, v <- gamma v; theta <- theta - eta v),

    theta_{c+1} = theta_{c-d} - eta (gamma + ... + gamma^(d+1)) v = theta_{c-d} - eta D(d + 1) v.

The server publishes that estimate (`view`), so the gradient is computed where momentum is taking the parameters:
DANA's look-ahead (001_... App. C.1, Alg. 6; Hakimi et al., "Taming momentum in a distributed asynchronous
environment"), theta - eta gamma sum_j v_j, which moves every worker's momentum one step, the reader's own
included: through the update its gradient enters (with one worker, Nesterov's gradient point). Here d is the
rounds' own staleness; it is not known when the server publishes, so it is the running mean of the staleness the
server has seen (`Context.mean_staleness`, a round's gradients' mean of the updates between their read and its
apply), or a fixed `horizon`. The mean, not the oldest gradient's: with one worker of five a round stale in every
round (ssp's worker behind a slow link, `loops.Worker.closes`) the oldest says 1 and the view would look a full
round ahead for the four fresh gradients too; on the quadratic below (one fifth of the gradient a round stale) that
view is stable for eta h < 1.4, the mean's (D(1.2)) for eta h < 2.0 (a scan of fixed views peaks at 2.5, D about
0.6), and on the Fashion-MNIST CNN behind a slow link the mean's view ended 0.5 points above Horovod where the
oldest's ended 1.3 below (benchmarks/README.md, "The worker the rounds wait on").
While no round was stale (d = 0: BSP) the view is theta itself and the rule is `collsync.rules.momentum`, bit for bit.

The step is Staleness-Aware's eta / tau (001_... Alg. 3, Zhang et al.), tau = max(1, the round's staleness): a
gradient stale by tau rounds shrinks the step that keeps heavy ball stable, about as 1 / tau, and the look-ahead
does not give it back (it cannot foresee the gradients still to come).

Why: without the look-ahead an SSP run at the lr of synchronous rounds and momentum 0.9 diverges (the delay adds a
momentum of its own, Mitliagkas et al., 2016); looking ahead only to the version the gradient is applied at (D(d),
one momentum step short of DANA's) left the digits CNN (4 workers, bound 1, 20 epochs, simulator, seeds 0-4) 1.3
points below BSP at the median and 4 at worst; through the update it enters, 0.5 and 2 (benchmarks/README.md).

What it cannot do: make a round that is stale every time as stable as a fresh one. On a quadratic of curvature h
(the linear analysis of the recurrence above, every round stale by d = 1, gamma = 0.9) heavy ball is stable for
eta h < 2 (1 + gamma) = 3.8 with fresh rounds, for eta h < 0.105 with rounds one stale, and with this view at D(2) for
eta h < 0.30, the best of any fixed view distance (a scan of D from 0 to 9 peaks there); dividing by tau does not
reach it at d = 1. A run whose sharpness sits where its fresh rounds keep it diverges once every round goes stale:
the Fashion-MNIST CNN did, at Horovod's lr x n, behind a 5 ms link. So SSP's workers wait for a lag every round has
(`policy.ssp`'s `usual`) and go stale only on an unusual one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from collsync.rules.base import Rule, check_decay, check_lr, check_milestones, check_unit, pure, step_lr
from collsync.rules.optim import MomentumState
from collsync.rules.optim import momentum as heavy_ball
from collsync.rules.staleness import staleness_tau
from collsync.types import Context, Flat


class LookaheadState(NamedTuple):
    """The momentum buffer v, the staleness estimate d (running mean, or the fixed horizon) and the step of the last
    update, eta_k / tau (the estimate extrapolates at the step just taken)."""

    v: torch.Tensor
    horizon: float
    eta: float


def lookahead_distance(momentum: float, horizon: float, nesterov: bool = False) -> float:
    """sum_{k=1..d} gamma^k (heavy ball) or sum_{k=2..d+1} gamma^k (Nesterov, whose step is gamma v): how many v's
    of momentum the next d updates move the parameters by when no gradient arrives. d may be fractional (a mean).
    The view of a read stale by d covers d + 1 updates (`view_distance`)."""
    total = momentum * (1 - float(momentum**horizon)) / (1 - momentum)  # 0 at d = 0 or gamma = 0; gamma < 1 is checked
    return total * momentum if nesterov else total


def view_distance(momentum: float, horizon: float, nesterov: bool = False) -> float:
    """The look-ahead of a read stale by d rounds: D(d + 1), through the update its gradient enters (DANA's
    convention, module docstring); 0 while no read was stale (d = 0), so that BSP's rounds stay heavy ball's."""
    return lookahead_distance(momentum, horizon + 1, nesterov) if horizon > 0 else 0.0


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

        v <- gamma v + g;   delta = -(eta_k / tau) v  (NAG: -(eta_k / tau) (gamma v + g)),  tau = max(1, staleness);
        view = theta - (eta_k / tau) D(d + 1) v  (0 while d = 0),  D(d) = gamma (1 - gamma^d) / (1 - gamma)
            (NAG: gamma D(d + 1));
        d <- rho d + (1 - rho) s   per update, s its gradients' mean staleness (`horizon` fixes d instead),
            rho = `smoothing`.

    The update is `collsync.rules.momentum`'s own (in place) with the step divided by tau; this rule adds the
    estimate d and the view. Weight decay, warm-up and the step schedule are momentum's.
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
        tau = staleness_tau(ctx)
        if tau > 1:  # x / 1 is x: BSP's rounds stay heavy ball's bit for bit
            delta.div_(tau)
        # d: the mean of a round's gradients, not its oldest: one worker a round stale (behind a slow link, ssp's
        # `Worker.closes`) reads best a short way ahead, the fresh ones' view (module docstring).
        stale = ctx.staleness if ctx.mean_staleness is None else ctx.mean_staleness
        d = state.horizon if horizon is not None else smoothing * state.horizon + (1 - smoothing) * stale
        return delta, LookaheadState(stepped.v, d, step_lr(lr, warmup, ctx.step, steps, lr_decay) / tau)

    def view(params: Flat, state: LookaheadState) -> Flat:
        distance = view_distance(momentum, state.horizon, nesterov)
        if distance == 0:
            return params
        return params - (state.eta * distance) * state.v

    return Rule(init, pure(update_), view, update_=update_)
