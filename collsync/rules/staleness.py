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

tau is the server's `ctx.staleness` clamped to >= 1: a fresh gradient (tau = 0) is not amplified. (002_...'s FRED
code divides by tau + 1 instead; the catalogue pins the clamp.)
"""

from __future__ import annotations

from typing import NamedTuple

from collsync.rules.base import Rule
from collsync.types import Context, Flat, State


def staleness_tau(ctx: Context) -> int:
    """The delay tau of 001_... §4, clamped to >= 1 (tau = 0 and tau = 1 both leave a gradient unpenalised)."""
    return max(ctx.staleness, 1)


class StalenessAwareState(NamedTuple):
    """The gradient variant keeps no state: tau comes with each arrival (`ctx.staleness`)."""


def staleness_aware() -> Rule:
    """SA, gradient variant (001_... Alg. 5): g' = g / max(tau, 1), chained before any optimizer.

    With `optimizer=dana` this is DANA-SA (001_... Alg. 7: v_i <- gamma v_i + g / tau). Under `sgd` it equals
    SASGD (002_... eq. 1).
    """

    def init(params: Flat) -> StalenessAwareState:
        return StalenessAwareState()

    def update(grad: Flat, state: StalenessAwareState, params: Flat, ctx: Context) -> tuple[Flat, StalenessAwareState]:
        tau = staleness_tau(ctx)
        # tau == 1 returns the gradient itself so that a fresh gradient gives the base optimizer bit for bit.
        return (grad if tau == 1 else grad / tau), state

    return Rule(init, update)


class StalenessAwareStepState(NamedTuple):
    """The wrapped optimizer's state."""

    inner: State


def staleness_aware_step(optimizer: Rule) -> Rule:
    """SA, step-size variant (001_... Alg. 3): delta = optimizer(g) / max(tau, 1).

    With momentum: v <- gamma v + g (the buffer keeps the unpenalised gradient); theta <- theta - (eta / tau) v.
    A wrapper rather than a chained rule, because it must see the optimizer's output; `ctx.staleness` of an
    optimizer update is the largest delay of the gradients it averages (exactly tau under `asynchronous()`).
    The wrapped optimizer's `view` passes through unchanged.
    """
    if not isinstance(optimizer, Rule):
        raise TypeError(f"staleness_aware_step: optimizer must be a Rule, got {type(optimizer).__name__}")

    def init(params: Flat) -> StalenessAwareStepState:
        return StalenessAwareStepState(optimizer.init(params))

    def update(
        grad: Flat, state: StalenessAwareStepState, params: Flat, ctx: Context
    ) -> tuple[Flat, StalenessAwareStepState]:
        delta, inner = optimizer.update(grad, state.inner, params, ctx)
        tau = staleness_tau(ctx)
        return (delta if tau == 1 else delta / tau), StalenessAwareStepState(inner)

    def view(params: Flat, state: StalenessAwareStepState) -> Flat:
        return optimizer.view(params, state.inner)

    return Rule(init, update, view, optimizer.needs_read)
