"""Staleness-Aware (SA): penalise a stale gradient linearly in its delay tau (Zhang et al., as described in
001_... §4.1 and 002_... eq. 1).

Two variants, which differ as soon as the optimizer has momentum (001_... §4.1, "Under-Penalizing"):

* gradient (001_... Alg. 5): v <- gamma v + g / tau; theta <- theta - eta v. The penalty sits *before* the
  optimizer, so it is a plain per-arrival penalty: `penalty=staleness_aware()`.
* step size (001_... Alg. 3): v <- gamma v + g; theta <- theta - (eta / tau) v. The momentum buffer holds the raw
  gradient and only the step is divided, so the penalty has to sit *after* the optimizer. In the optax style that is
  a wrapper of the optimizer rule, `staleness_aware_step(optimizer)`; `collsync.rules.combine` applies it for the CLI.

002_... (SASGD, eq. 1: g_i = alpha(tau) Delta theta, theta <- theta - g_i) states SA as the step-size variant: a
staleness-dependent *learning rate* alpha(tau) = alpha / tau on plain ASGD without momentum, where the two variants
coincide (tests check that they agree under `sgd`, to rounding: g / tau * eta versus g * eta / tau).

Which tau (`tau=`, `penalty.tau=` on the command line). `ctx.staleness` counts the server updates between a worker's
read and its gradient's arrival (0 = fresh). Two readings of 001_... divide by different numbers:

* `tau="staleness"` (the default): tau = max(staleness, 1). 001_... §4's prose ("the gradient ... is delayed by tau
  steps", SA "divides the gradient by tau") counts the updates in between, and a fresh gradient is not amplified;
  a gradient with one update in between is left as it is.
* `tau="boxes"`: tau = staleness + 1, as 001_... Alg. 3, 5, 7 and 10 compute it: iter[i] <- k when the parameters
  are sent, tau <- k - iter[i] on arrival, after the k-th update, so a fresh gradient has tau = 1 and one with one
  update in between is halved. 002_...'s FRED code divides by tau + 1 as well.
"""

from __future__ import annotations

from typing import NamedTuple

from collsync.rules.base import TAU_MODES, Rule, TauMode, check_decay, check_tau, decayed, inner_stats
from collsync.types import Context, Flat, State

__all__ = ["TAU_MODES", "TauMode", "check_tau", "staleness_aware", "staleness_aware_step", "staleness_tau"]


def staleness_tau(ctx: Context, tau: TauMode = "staleness") -> int:
    """The delay tau of 001_...: max(staleness, 1) for `tau="staleness"` (§4's prose: tau = 0 and tau = 1 both leave
    a gradient unpenalised), staleness + 1 for `tau="boxes"` (Alg. 3/5/7/10: tau = k - iter[i])."""
    if tau == "boxes":
        return ctx.staleness + 1
    return max(ctx.staleness, 1)


class StalenessAwareState(NamedTuple):
    """The gradient variant keeps no state: tau comes with each arrival (`ctx.staleness`)."""


def staleness_aware(tau: TauMode = "staleness", weight_decay: float = 0.0) -> Rule:
    """SA, gradient variant (001_... Alg. 5): g' = (g + lambda theta) / tau, chained before any optimizer;
    tau = max(staleness, 1) (`tau="staleness"`) or staleness + 1 (`tau="boxes"`, the algorithm boxes).

    `weight_decay` (lambda) here puts the decay inside the penalised gradient, as 001_... App. C.5 does for GA
    (`gap_aware(weight_decay=...)`); on the optimizer instead it is added after the penalty, undivided.

    With `optimizer=dana` this is DANA-SA (001_... Alg. 7: v_i <- gamma v_i + g / tau). Under `sgd` it equals
    SASGD (002_... eq. 1).
    """
    check_tau("staleness_aware", tau)
    check_decay("staleness_aware", weight_decay)
    mode = tau

    def init(params: Flat) -> StalenessAwareState:
        return StalenessAwareState()

    def update(grad: Flat, state: StalenessAwareState, params: Flat, ctx: Context) -> tuple[Flat, StalenessAwareState]:
        tau = staleness_tau(ctx, mode)
        grad = decayed(grad, params, weight_decay)
        # tau == 1 returns the gradient itself so that a fresh gradient gives the base optimizer bit for bit.
        return (grad if tau == 1 else grad / tau), state

    return Rule(init, update)


class StalenessAwareStepState(NamedTuple):
    """The wrapped optimizer's state."""

    inner: State


def staleness_aware_step(optimizer: Rule, tau: TauMode = "staleness") -> Rule:
    """SA, step-size variant (001_... Alg. 3): delta = optimizer(g) / tau, tau as in `staleness_aware`.

    With momentum: v <- gamma v + g (the buffer keeps the unpenalised gradient); theta <- theta - (eta / tau) v.
    A wrapper rather than a chained rule, because it must see the optimizer's output; `ctx.staleness` of an
    optimizer update is the largest delay of the gradients it averages (exactly tau under `asynchronous()`).
    The wrapped optimizer's `view` passes through unchanged.
    """
    if not isinstance(optimizer, Rule):
        raise TypeError(f"staleness_aware_step: optimizer must be a Rule, got {type(optimizer).__name__}")
    check_tau("staleness_aware_step", tau)
    mode = tau

    def init(params: Flat) -> StalenessAwareStepState:
        return StalenessAwareStepState(optimizer.init(params))

    def update(
        grad: Flat, state: StalenessAwareStepState, params: Flat, ctx: Context
    ) -> tuple[Flat, StalenessAwareStepState]:
        delta, inner = optimizer.update(grad, state.inner, params, ctx)
        tau = staleness_tau(ctx, mode)
        return (delta if tau == 1 else delta / tau), StalenessAwareStepState(inner)

    def view(params: Flat, state: StalenessAwareStepState) -> Flat:
        return optimizer.view(params, state.inner)

    return Rule(init, update, view, optimizer.needs_read, stats=inner_stats(optimizer, lambda s: s.inner))
