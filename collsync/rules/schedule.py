"""Learning-rate wrappers: gradual warm-up with momentum correction (001_... App. C.4) and the linear scaling rule of
PSP-SGD (003_... Alg. 1, line 13).

Both scale the wrapped optimizer's *step* by a factor s_k, i.e. they run the optimizer at learning rate s_k * eta.
For every optimizer here whose buffer does not contain eta (sgd, momentum, nesterov, adam, dana, fasgd, adam_sa,
adam_ga: theta <- theta - eta_k u with u independent of eta) this is exactly a learning-rate schedule with Goyal
et al.'s momentum correction, which exists to make the eta-inside form behave like this one. For `rmsprop`, whose
buffer holds eta (mom <- gamma mom + eta g / sqrt(ms + eps); delta = -mom), scaling its output by s_k gives
delta_k = -s_k mom_k = -eta_k u_k with u_k = mom_k / eta, which is Goyal's corrected update
mom_k = gamma (eta_k / eta_{k-1}) mom_{k-1} + eta_k g_k. (The optimizers' own `warmup` kwarg ramps eta inside the
rule instead, from eta / warmup; for `rmsprop` that ramp is not momentum-corrected.)
"""

from __future__ import annotations

from typing import NamedTuple

from collsync.rules.base import Rule, inner_stats
from collsync.types import Context, Flat, State


class GradualWarmupState(NamedTuple):
    """The wrapped optimizer's state and the factor s_k of the last update (the look-ahead of `view` uses it)."""

    inner: State
    factor: float


def gradual_warmup(optimizer: Rule, warmup: int, workers: int = 1) -> Rule:
    """Gradual warm-up of 001_... App. C.4 (after Goyal et al.): the learning rate starts at eta / N and grows
    linearly to eta over `warmup` updates, with momentum correction:

        s_k = 1/N + (1 - 1/N) min(1, k / warmup);   delta_k = s_k * optimizer(g)_k          (N = `workers`)

    k is the server's update count (`ctx.step`); the paper ramps over 5 epochs, i.e. warmup = 5 * updates per
    epoch. warmup = 0 or workers = 1 leaves the optimizer unchanged. A look-ahead view (DANA's
    theta - eta gamma sum_j v_j) is rescaled by the same s_k, so it keeps using the step just taken (Alg. 6's eta_k).
    """
    _check_rule("gradual_warmup", optimizer)
    if not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"gradual_warmup: {warmup=} must be an integer >= 0 (updates)")
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"gradual_warmup: {workers=} must be an integer >= 1")

    def factor(step: int) -> float:
        if warmup == 0 or step >= warmup:
            return 1.0
        return 1.0 / workers + (1.0 - 1.0 / workers) * step / warmup

    def init(params: Flat) -> GradualWarmupState:
        return GradualWarmupState(optimizer.init(params), factor(0))

    def update(grad: Flat, state: GradualWarmupState, params: Flat, ctx: Context) -> tuple[Flat, GradualWarmupState]:
        delta, inner = optimizer.update(grad, state.inner, params, ctx)
        s = factor(ctx.step)
        return (delta if s == 1.0 else delta * s), GradualWarmupState(inner, s)

    def view(params: Flat, state: GradualWarmupState) -> Flat:
        base = optimizer.view(params, state.inner)
        if state.factor == 1.0 or base is params:
            return base
        return params + (base - params) * state.factor

    return Rule(init, update, view, optimizer.needs_read, stats=inner_stats(optimizer, lambda s: s.inner))


class LinearScalingState(NamedTuple):
    """The wrapped optimizer's state."""

    inner: State


def linear_scaling(optimizer: Rule, c: int = 1) -> Rule:
    """The linear scaling rule of PSP-SGD (003_... §2.2 and Alg. 1, line 13): an update that averages d gradients
    takes the step eta * d / c, where eta is tuned for the minimum c of partial pushing:

        delta = (d / c) * optimizer(g_bar)          d = `ctx.aggregated`

    With d = c (every update complete) it is the optimizer unchanged. The view passes through.
    """
    _check_rule("linear_scaling", optimizer)
    if not (isinstance(c, int) and c >= 1):
        raise ValueError(f"linear_scaling: {c=} must be an integer >= 1")

    def init(params: Flat) -> LinearScalingState:
        return LinearScalingState(optimizer.init(params))

    def update(grad: Flat, state: LinearScalingState, params: Flat, ctx: Context) -> tuple[Flat, LinearScalingState]:
        delta, inner = optimizer.update(grad, state.inner, params, ctx)
        d = ctx.aggregated
        return (delta if d == c else delta * (d / c)), LinearScalingState(inner)

    def view(params: Flat, state: LinearScalingState) -> Flat:
        return optimizer.view(params, state.inner)

    return Rule(init, update, view, optimizer.needs_read, stats=inner_stats(optimizer, lambda s: s.inner))


def _check_rule(name: str, optimizer: object) -> None:
    if not isinstance(optimizer, Rule):
        raise TypeError(f"{name}: optimizer must be a Rule, got {type(optimizer).__name__}")
