"""FASGD (002_... §2.2, eqs. 4-8) and the push/fetch probability of B-FASGD (002_... §2.3, eq. 9).

FASGD is an *optimizer*, not a penalty: its step alpha / (v tau) replaces SGD's alpha, and even a fresh gradient is
rescaled by 1/v, so it cannot be a penalty that leaves a fresh gradient unchanged in front of some base optimizer.
Configure it as `penalty=none optimizer=fasgd`.

B-FASGD's worker-side logic (drawing r, dropping pushes/fetches) is the policy's `collsync.policy.Transmit`, and the
server re-applies a worker's last gradient; this module gives what they need: `fasgd` reports the scalar v of
eq. 9 (the mean of its per-parameter v) as its `SIGNAL` statistic, which the server publishes with every version,
and `bfasgd_probability(v, c, eps)` is eq. 9 itself.

A note on the paper: its prose says FASGD *divides* the learning rate by a moving average of the gradient standard
deviation, and that eq. 9's v is "the mean of the moving averages of their standard deviations"; its equations
(6)-(7) define v as a moving average of 1 / std and divide by v, i.e. they *multiply* the step by (a harmonic mean
of) the std. The design's catalogue pins the equations, so this module follows eqs. 4-9 as printed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from collsync.rules.base import SIGNAL, Rule, check_lr, check_positive, check_unit, zeros_like
from collsync.rules.staleness import TauMode, check_tau, staleness_tau
from collsync.types import Context, Flat


class FASGDState(NamedTuple):
    """Moving square n (eq. 4), moving mean b (eq. 5) and moving mean v of 1 / sqrt(n - b^2 + eps) (eq. 6)."""

    n: torch.Tensor
    b: torch.Tensor
    v: torch.Tensor


def fasgd(
    lr: float = 1.0, gamma: float = 0.9, beta: float = 0.9, eps: float = 1e-8, tau: TauMode = "staleness"
) -> Rule:
    """Faster ASGD (002_... eqs. 4-8), per parameter, on each gradient Delta theta as it arrives:

        n <- gamma n + (1 - gamma) g^2                      (4)
        b <- gamma b + (1 - gamma) g                        (5)
        v <- beta v + (1 - beta) / sqrt(n - b^2 + eps)      (6)
        delta = -alpha / (v * tau) * g                      (7, 8)     alpha = `lr`

    tau = max(staleness, 1) by default; `tau="boxes"` gives staleness + 1, as 002_...'s FRED code and 001_...'s
    algorithm boxes count it (`collsync.rules.staleness`).

    n, b and v start at zero (the paper gives no initial values); there is no bias correction. The paper leaves
    gamma and beta untuned; 0.9 matches the moving averages of its FRED code. n - b^2 >= 0 in exact arithmetic
    (Cauchy-Schwarz on the moving-average weights); it is clamped at 0 so that rounding cannot make the root NaN.
    """
    check_lr("fasgd", lr)
    check_unit("fasgd", "gamma", gamma)
    check_unit("fasgd", "beta", beta)
    check_positive("fasgd", "eps", eps)
    check_tau("fasgd", tau)

    def init(params: Flat) -> FASGDState:
        return FASGDState(zeros_like(params), zeros_like(params), zeros_like(params))

    def update(grad: Flat, state: FASGDState, params: Flat, ctx: Context) -> tuple[Flat, FASGDState]:
        n = state.n * gamma + (1 - gamma) * grad * grad
        b = state.b * gamma + (1 - gamma) * grad
        v = state.v * beta + (1 - beta) / torch.sqrt((n - b * b).clamp_min(0) + eps)
        delta = grad * (-lr / staleness_tau(ctx, tau)) / v
        return delta, FASGDState(n, b, v)

    return Rule(init, update, stats=fasgd_stats)


def fasgd_stats(state: FASGDState) -> dict[str, float]:
    """B-FASGD's v of eq. 9, "the mean of the moving averages" (over every parameter), as the rule's `SIGNAL`."""
    return {SIGNAL: float(state.v.mean())}


def bfasgd_probability(v: float | torch.Tensor, c: float, eps: float = 1e-8) -> float:
    """B-FASGD's chance to push (or fetch) at an opportunity (002_... eq. 9): transmit iff r < 1 / (1 + c / (v + eps)).

    `v` is the mean over all parameters of FASGD's v (a tensor is averaged here); `c` is c_push or c_fetch (c = 0:
    always transmit).
    """
    if not c >= 0:
        raise ValueError(f"bfasgd: {c=} must be >= 0")
    check_positive("bfasgd", "eps", eps)
    v_mean = float(v.mean()) if isinstance(v, torch.Tensor) else float(v)
    if not v_mean >= 0:
        raise ValueError(f"bfasgd: v={v_mean!r} must be >= 0 (a mean of 1 / std)")
    return 1.0 / (1.0 + c / (v_mean + eps))
