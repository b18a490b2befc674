"""Adam-SA and Adam-GA: the staleness penalty on Adam's first moment only (001_... App. C.1, Alg. 9-11).

Dividing the gradient before Adam would divide both moments, and m_hat / sqrt(u_hat) would cancel the penalty
("the first and second moments cancel each other out", App. C.1). So the penalty cannot be chained in front of
`adam`; these optimizers apply it inside:

    m <- beta1 m + (1 - beta1) g / P        P = tau (Adam-SA, Alg. 10) or the Gap G (Adam-GA, Alg. 11)
    u <- beta2 u + (1 - beta2) g^2          (unpenalised)
    delta = -eta m_hat / (sqrt(u_hat) + eps)

Use them as `penalty=none optimizer=adam_sa` / `optimizer=adam_ga`. Under them the optimizer's context must carry
one arrival (quorum 1): its staleness and, for Adam-GA, the parameters the worker read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from collsync.rules.base import Rule, check_lr, check_tau
from collsync.rules.gap import GapAwareState, Spans, gap_rule
from collsync.rules.optim import adam_first_moment
from collsync.rules.staleness import TauMode, staleness_aware
from collsync.types import State


class AdamSAState(NamedTuple):
    """Adam's moments (m penalised, u not) and the number of updates taken."""

    m: torch.Tensor
    u: torch.Tensor
    k: int


class AdamGAState(NamedTuple):
    """Adam's moments (m penalised, u not), the number of updates taken, and the Gap's C statistics (Alg. 14)."""

    m: torch.Tensor
    u: torch.Tensor
    k: int
    gap: GapAwareState


def adam_sa(
    lr: float = 0.001,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup: int = 0,
    tau: TauMode = "staleness",
) -> Rule:
    """Adam-Staleness-Aware (001_... Alg. 10): m <- beta1 m + (1 - beta1) g / tau; u, m_hat, u_hat as Adam.

    tau = max(staleness, 1) (default) or staleness + 1 (`tau="boxes"`, Alg. 10 as printed); see
    `collsync.rules.staleness`. At tau = 1 it is `collsync.rules.adam` bit for bit.
    """
    check_tau("adam_sa", tau)
    penalty = staleness_aware(tau)

    def wrap(m: torch.Tensor, u: torch.Tensor, count: int, pen: State) -> AdamSAState:
        return AdamSAState(m, u, count)

    def unwrap(state: AdamSAState) -> State:
        return penalty.init(state.m)  # SA is stateless

    return adam_first_moment("adam_sa", penalty, wrap, unwrap, lr, beta1, beta2, eps, weight_decay, warmup)


def adam_ga(
    lr: float = 0.001,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup: int = 0,
    eta_max: float | None = None,
    beta: float = 0.999,
    gap_eps: float = 1e-8,
    granularity: str = "parameter",
    layers: Spans | None = None,
) -> Rule:
    """Adam-Gap-Aware (001_... Alg. 11): m <- beta1 m + (1 - beta1) g / G; u, m_hat, u_hat as Adam.

    G = |theta_k - theta_i| / C + 1 as in `gap_aware`, with C from Alg. 14: `eta_max` (default: `lr`, "usually
    eta_1"), `beta` (Alg. 14's beta_1), `gap_eps` (its epsilon), `granularity` and `layers`. Alg. 14's update step
    is v <- gamma v + g; Adam has no heavy-ball gamma, so gamma = 0 and v = g: C = eta_max sqrt(E[g^2]) + eps, the
    box as printed. (That C is in gradient units while Adam's steps are about eta per parameter, so G grows as
    gradients shrink; `eta_max` rescales C if that over-penalises.) Weight decay is added to the gradient first
    and so is penalised in m (App. C.5).
    """
    check_lr("adam_ga", lr)  # before eta_max = lr is checked under its own name
    penalty = gap_rule(
        "adam_ga",
        eta_max=lr if eta_max is None else eta_max,
        beta=beta,
        eps=gap_eps,
        momentum=0.0,
        weight_decay=0.0,
        granularity=granularity,
        layers=layers,
        eps_key="gap_eps",
    )

    def wrap(m: torch.Tensor, u: torch.Tensor, count: int, pen: State) -> AdamGAState:
        return AdamGAState(m, u, count, pen)

    def unwrap(state: AdamGAState) -> State:
        return state.gap

    return adam_first_moment("adam_ga", penalty, wrap, unwrap, lr, beta1, beta2, eps, weight_decay, warmup)
