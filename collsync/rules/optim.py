"""Base optimizers applied on the server: SGD, momentum, Nesterov (NAG), RMSProp with momentum, Adam.

Each returns the parameter *delta*; `Server.accept` adds it. Momentum follows 001_... §3 without dampening:
v_{k+1} = gamma * v_k + g, theta_{k+1} = theta_k - eta * v_{k+1}. Weight decay is added to the gradient before the
update (001_... C.5 puts it inside the penalised gradient, which a penalty upstream in `chain` achieves).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from collsync.rules.base import (
    EmptyState,
    Rule,
    check_decay,
    check_lr,
    check_milestones,
    check_positive,
    check_unit,
    decayed,
    identity,
    inner_stats,
    pure,
    step_lr,
    warmup_lr,
    zeros_like,
)
from collsync.types import Context, Flat, State


def sgd(
    lr: float = 0.1,
    weight_decay: float = 0.0,
    warmup: int = 0,
    milestones: list[int] | None = None,
    lr_decay: float = 0.1,
) -> Rule:
    """Plain SGD: delta = -eta_k * (g + lambda * theta), eta_k as `collsync.rules.base.step_lr` (warm-up, and lr x
    lr_decay at each of `milestones`, 001_... App. C.4)."""
    check_lr("sgd", lr)
    check_decay("sgd", weight_decay)
    steps = check_milestones("sgd", milestones, lr_decay)

    def init(params: Flat) -> EmptyState:
        return EmptyState()

    def update_(grad: Flat, state: EmptyState, params: Flat, ctx: Context) -> tuple[Flat, EmptyState]:
        grad = decayed(grad, params, weight_decay, in_place=True)
        return grad.mul_(-step_lr(lr, warmup, ctx.step, steps, lr_decay)), state

    return Rule(init, pure(update_), update_=update_)


class MomentumState(NamedTuple):
    """The update vector v of 001_... §3."""

    v: torch.Tensor


def momentum(
    lr: float = 0.1,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    warmup: int = 0,
    nesterov: bool = False,
    milestones: list[int] | None = None,
    lr_decay: float = 0.1,
) -> Rule:
    """Heavy-ball momentum (001_... Alg. 2): v <- gamma v + g; delta = -eta_k v.

    With `nesterov=True`, NAG in its usual deep-learning form: v <- gamma v + g; delta = -eta_k (gamma v + g).
    eta_k: warm-up and the step schedule of `collsync.rules.base.step_lr` (lr x lr_decay at each of `milestones`,
    001_... App. C.4); v holds no eta, so a change of eta_k is momentum-corrected by construction.
    """
    name = "nesterov" if nesterov else "momentum"
    check_lr(name, lr)
    check_unit(name, "momentum", momentum)
    check_decay(name, weight_decay)
    steps = check_milestones(name, milestones, lr_decay)

    def init(params: Flat) -> MomentumState:
        return MomentumState(zeros_like(params))

    def update_(grad: Flat, state: MomentumState, params: Flat, ctx: Context) -> tuple[Flat, MomentumState]:
        # The same operations, in the same order, as v * gamma + g and (g + gamma v) * -eta: no fused
        # multiply-add, so the in-place step equals the pure one bit for bit.
        grad = decayed(grad, params, weight_decay, in_place=True)
        v = state.v.mul_(momentum).add_(grad)
        eta = step_lr(lr, warmup, ctx.step, steps, lr_decay)
        if nesterov:
            return grad.add_(momentum * v).mul_(-eta), state
        return torch.mul(v, -eta, out=grad), state

    return Rule(init, pure(update_), update_=update_)


_heavy_ball = momentum


def nesterov(
    lr: float = 0.1,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    warmup: int = 0,
    milestones: list[int] | None = None,
    lr_decay: float = 0.1,
) -> Rule:
    """Nesterov's accelerated gradient (NAG-ASGD on the server, 001_...; App. C.4 runs every method with it)."""
    return _heavy_ball(lr, momentum, weight_decay, warmup, nesterov=True, milestones=milestones, lr_decay=lr_decay)


class RMSPropState(NamedTuple):
    """Running mean square of gradients `ms` and momentum buffer `mom`."""

    ms: torch.Tensor
    mom: torch.Tensor


def rmsprop(
    lr: float = 0.01,
    decay: float = 0.9,
    momentum: float = 0.9,
    eps: float = 1.0,
    weight_decay: float = 0.0,
    warmup: int = 0,
    milestones: list[int] | None = None,
    lr_decay: float = 0.1,
) -> Rule:
    """RMSProp with momentum as used by 000_... App. A (decay 0.9, momentum 0.9), in TensorFlow's form:

    ms <- decay ms + (1 - decay) g^2;  mom <- momentum mom + eta_k g / sqrt(ms + eps);  delta = -mom.
    TensorFlow's Inception recipe uses eps = 1.0, which is the default here. eta_k as `step_lr` (the buffer holds
    eta, so a drop at a milestone reaches the step gradually, as in TensorFlow).
    """
    check_lr("rmsprop", lr)
    check_unit("rmsprop", "decay", decay)
    check_unit("rmsprop", "momentum", momentum)
    check_positive("rmsprop", "eps", eps)
    check_decay("rmsprop", weight_decay)
    steps = check_milestones("rmsprop", milestones, lr_decay)

    def init(params: Flat) -> RMSPropState:
        return RMSPropState(zeros_like(params), zeros_like(params))

    def update(grad: Flat, state: RMSPropState, params: Flat, ctx: Context) -> tuple[Flat, RMSPropState]:
        grad = decayed(grad, params, weight_decay)
        ms = state.ms * decay + (1 - decay) * grad * grad
        mom = state.mom * momentum + step_lr(lr, warmup, ctx.step, steps, lr_decay) * grad / torch.sqrt(ms + eps)
        return -mom, RMSPropState(ms, mom)

    return Rule(init, update)


class AdamState(NamedTuple):
    """First and second moments and the number of updates taken (the k of the bias corrections 1 - beta^k)."""

    m: torch.Tensor
    u: torch.Tensor
    k: int


def adam(
    lr: float = 0.001,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup: int = 0,
) -> Rule:
    """Adam (Kingma & Ba): m <- b1 m + (1-b1) g; u <- b2 u + (1-b2) g^2; delta = -eta m_hat / (sqrt(u_hat) + eps).

    The block `adam_first_moment` with no penalty: Adam-SA and Adam-GA (`collsync.rules.adam_variants`) are the
    same block with theirs, so the three cannot drift apart."""

    def wrap(m: torch.Tensor, u: torch.Tensor, count: int, pen: State) -> AdamState:
        return AdamState(m, u, count)

    def unwrap(state: AdamState) -> State:
        return EmptyState()  # the identity's state

    return adam_first_moment("adam", identity(), wrap, unwrap, lr, beta1, beta2, eps, weight_decay, warmup)


def adam_first_moment(
    name: str,
    penalty: Rule,
    wrap: Callable[[torch.Tensor, torch.Tensor, int, State], State],
    unwrap: Callable[[State], State],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    warmup: int,
) -> Rule:
    """Adam with `penalty` applied to the gradient entering the first moment only (001_... App. C.1):

        g <- g + lambda theta;  m <- beta1 m + (1 - beta1) penalty(g);  u <- beta2 u + (1 - beta2) g^2
        delta = -eta_k m_hat / (sqrt(u_hat) + eps),   m_hat = m / (1 - beta1^k),  u_hat = u / (1 - beta2^k)

    `wrap` builds the rule's state from (m, u, count, penalty state); `unwrap` gets the penalty state back. The
    penalty's statistics are the rule's (Adam-GA's Gap). Errors name `name`."""
    check_lr(name, lr)
    check_unit(name, "beta1", beta1)
    check_unit(name, "beta2", beta2)
    check_positive(name, "eps", eps)
    check_decay(name, weight_decay)

    def init(params: Flat) -> State:
        return wrap(zeros_like(params), zeros_like(params), 0, penalty.init(params))

    def update(grad: Flat, state: State, params: Flat, ctx: Context) -> tuple[Flat, State]:
        grad = decayed(grad, params, weight_decay)
        penalised, pen_state = penalty.update(grad, unwrap(state), params, ctx)
        count = state.k + 1
        m = state.m * beta1 + (1 - beta1) * penalised
        u = state.u * beta2 + (1 - beta2) * grad * grad
        m_hat = m / (1 - beta1**count)
        u_hat = u / (1 - beta2**count)
        delta = m_hat / (torch.sqrt(u_hat) + eps) * -warmup_lr(lr, warmup, ctx.step)
        return delta, wrap(m, u, count, pen_state)

    return Rule(init, update, needs_read=penalty.needs_read, stats=inner_stats(penalty, unwrap))
