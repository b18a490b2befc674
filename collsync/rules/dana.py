"""DANA: per-worker momentum and a look-ahead view (001_... App. C.1, Alg. 6; Hakimi et al., "Taming momentum").

    v_i <- gamma v_i + g_i                          (worker i's own momentum)
    theta_{k+1} = theta_k - eta_k v_i
    theta_hat  = theta_{k+1} - eta_k gamma sum_j v_j      (the estimate the workers read: `view`)

DANA-SA (Alg. 7) and DANA-GA (Alg. 8) only change what enters v_i (g / tau, g / G), so they are
`penalty=staleness_aware optimizer=dana` and `penalty=gap_aware optimizer=dana`: the penalty runs on each arrival
before the optimizer, exactly where Alg. 7-8 divide. DANA-GA's Gap is |theta_k - theta_i| with theta_i the estimate
sent to worker i; the server keeps the view each worker read and passes it as `ctx.read`, which is that estimate.

DANA needs one gradient per update (the asynchronous policy, quorum 1): v_i belongs to the worker that sent it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from collsync.rules.base import Rule, check_decay, check_lr, check_milestones, check_unit, decayed, step_lr, zeros_like
from collsync.types import Context, Flat


class DANAState(NamedTuple):
    """Per-worker momentum v_i (allocated for all `ctx.workers` on the first gradient, grown if a larger worker id
    arrives), their running sum, and eta_k of the last update (the estimate uses the step just taken)."""

    v: tuple[torch.Tensor, ...]
    total: torch.Tensor
    eta: float


def dana(
    lr: float = 0.1,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    warmup: int = 0,
    milestones: list[int] | None = None,
    lr_decay: float = 0.1,
) -> Rule:
    """DANA on the server (001_... Alg. 6): v_i <- gamma v_i + g; delta = -eta v_i; view = theta - eta gamma sum_j v_j.

    Weight decay and linear warm-up as in `collsync.rules.optim` (lambda theta added to the gradient; eta_k =
    eta min(1, (k + 1) / warmup)), and the step schedule of 001_... App. C.4 (eta x lr_decay at each of
    `milestones`, `collsync.rules.base.step_lr`). The state is a tuple of per-worker tensors, so an update
    replaces one entry without copying the others.
    """
    check_lr("dana", lr)
    check_unit("dana", "momentum", momentum)
    check_decay("dana", weight_decay)
    steps = check_milestones("dana", milestones, lr_decay)

    def init(params: Flat) -> DANAState:
        return DANAState((), zeros_like(params), step_lr(lr, warmup, 0, steps, lr_decay))

    def update(grad: Flat, state: DANAState, params: Flat, ctx: Context) -> tuple[Flat, DANAState]:
        i = ctx.worker
        if i < 0:
            raise ValueError(
                f"dana: an update averaged {ctx.aggregated} gradients of different workers (worker={i}); DANA keeps "
                "one momentum per worker and needs one gradient per update (sync=async with quorum 1); for averaged "
                "updates choose another optimizer (optimizer=momentum)"
            )
        vs = state.v
        if i >= len(vs):
            vs = vs + tuple(zeros_like(params) for _ in range(len(vs), max(ctx.workers, i + 1)))
        grad = decayed(grad, params, weight_decay)
        old = vs[i]
        new = old * momentum + grad
        # The sum is kept incrementally (O(d) per update instead of O(workers * d)); its rounding drift is of the
        # order of one ulp of |v| per update, far below the look-ahead's own approximation error.
        total = state.total + (new - old)
        eta = step_lr(lr, warmup, ctx.step, steps, lr_decay)
        return new * -eta, DANAState(vs[:i] + (new,) + vs[i + 1 :], total, eta)

    def view(params: Flat, state: DANAState) -> Flat:
        return params - (state.eta * momentum) * state.total

    return Rule(init, update, view)
