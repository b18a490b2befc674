"""The optax-style rule interface: a rule is a pair of pure functions over flat tensors.

A rule turns what arrived at the server into something else: a penalty turns a stale gradient into a penalised
gradient, an optimizer turns an (averaged, penalised) gradient into the parameter delta. Rules never mutate the
parameters; `collsync.server.Server.accept` is the only place parameters change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

import torch

from collsync.types import Context, Flat, State


def params_unchanged(params: Flat, state: State) -> Flat:
    """The default `view`: workers read the server's parameters as they are."""
    return params


class Rule(NamedTuple):
    """`init(params) -> state`; `update(grad, state, params, ctx) -> (out, state)`; `view(params, state) -> params`.

    `needs_read` asks the server to keep the parameters each worker read, so that `ctx.read` is filled (Gap-Aware
    measures the gap theta_k - theta_{k-tau}; 001_... App. D.1 keeps one copy per worker on the master).

    `update_` (optional) is `update` in place: the same result bit for bit, but it may write its output into `grad`
    and overwrite the tensors of `state`. The server calls it on a gradient buffer it owns and keeps no earlier
    state, so a step allocates nothing (a fresh 20 MB tensor per update costs more than the arithmetic: the kernel
    zero-fills its pages); everyone else calls the pure `update`. `pure(update_)` makes the one from the other,
    so the two cannot drift apart.
    """

    init: Callable[[Flat], State]
    update: Callable[[Flat, State, Flat, Context], tuple[Flat, State]]
    view: Callable[[Flat, State], Flat] = params_unchanged
    needs_read: bool = False
    update_: Callable[[Flat, State, Flat, Context], tuple[Flat, State]] | None = None


def pure(update_: Callable[[Flat, State, Flat, Context], tuple[Flat, State]]) -> Callable[..., tuple[Flat, State]]:
    """The pure `update` of an in-place `update_`: the same arithmetic on copies of the gradient and the state."""

    def update(grad: Flat, state: State, params: Flat, ctx: Context) -> tuple[Flat, State]:
        return update_(grad.clone(), _copy(state), params, ctx)

    return update


def _copy(state: State) -> State:
    """A copy of a rule state whose tensors `update_` may overwrite (NamedTuples and tuples of tensors/numbers)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, tuple):
        items = [_copy(x) for x in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    return state


class EmptyState(NamedTuple):
    """The state of a stateless rule."""


TauMode = Literal["staleness", "boxes"]
"""How a staleness penalty counts the delay tau from `ctx.staleness`: max(staleness, 1) (001_... §4's prose) or
staleness + 1 (001_... Alg. 3/5/7/10); see `collsync.rules.staleness`."""

TAU_MODES: tuple[str, ...] = get_args(TauMode)


def check_tau(name: str, tau: str) -> None:
    """Reject an unknown tau convention, naming the rule and the value."""
    if tau not in TAU_MODES:
        raise ValueError(f"{name}: tau={tau!r} must be one of {', '.join(TAU_MODES)}")


def identity(tau: TauMode = "staleness") -> Rule:
    """The rule that passes its input through: `penalty=none`.

    `tau` does nothing here; it is `penalty.tau` of `conf/penalty/none.yaml`, which the optimizers that penalise
    inside themselves (`adam_sa`, `fasgd`) read through their config, so that `penalty.tau=boxes` reaches every SA
    variant under one key.
    """
    check_tau("penalty", tau)

    def init(params: Flat) -> EmptyState:
        return EmptyState()

    def update(grad: Flat, state: EmptyState, params: Flat, ctx: Context) -> tuple[Flat, EmptyState]:
        return grad, state

    return Rule(init, update)


def chain(*rules: Rule) -> Rule:
    """Compose rules left to right: the output of one is the input of the next; views compose in the same order."""

    def init(params: Flat) -> tuple[State, ...]:
        return tuple(r.init(params) for r in rules)

    def composed(step: Callable[[Rule], Callable[..., tuple[Flat, State]]]) -> Callable[..., tuple[Flat, State]]:
        def update(grad: Flat, state: tuple[State, ...], params: Flat, ctx: Context) -> tuple[Flat, tuple[State, ...]]:
            new_states = []
            for rule, s in zip(rules, state, strict=True):
                grad, s = step(rule)(grad, s, params, ctx)
                new_states.append(s)
            return grad, tuple(new_states)

        return update

    update = composed(lambda r: r.update)
    # In place only if every rule can be: the first one's output is the next one's input, owned all along.
    update_ = composed(lambda r: r.update_) if all(r.update_ is not None for r in rules) else None

    def view(params: Flat, state: tuple[State, ...]) -> Flat:
        for rule, s in zip(rules, state, strict=True):
            params = rule.view(params, s)
        return params

    return Rule(init, update, view, any(r.needs_read for r in rules), update_)


def check_lr(name: str, lr: float) -> None:
    """Reject a learning rate that cannot train, naming the rule and the value."""
    if not lr > 0:
        raise ValueError(f"{name}: {lr=} must be > 0")


def check_unit(name: str, key: str, value: float, *, closed: bool = False) -> None:
    """Reject a decay/momentum coefficient outside [0, 1) (or [0, 1] when `closed`)."""
    ok = 0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0
    if not ok:
        bound = "[0, 1]" if closed else "[0, 1)"
        raise ValueError(f"{name}: {key}={value!r} must be in {bound}")


def check_positive(name: str, key: str, value: float) -> None:
    """Reject an epsilon or scale that must be strictly positive."""
    if not value > 0:
        raise ValueError(f"{name}: {key}={value!r} must be > 0")


def warmup_lr(lr: float, warmup: int, step: int) -> float:
    """Linear warm-up: lr * min(1, (step + 1) / warmup) (warmup = 0 switches it off)."""
    if warmup <= 0:
        return lr
    return lr * min(1.0, (step + 1) / warmup)


def check_milestones(name: str, milestones: list[int] | None, lr_decay: float) -> tuple[int, ...]:
    """Check a step schedule (increasing update counts >= 1, a decay in (0, 1]) and return its milestones."""
    steps = tuple(milestones or ())
    if any(not isinstance(m, int) or m < 1 for m in steps) or list(steps) != sorted(set(steps)):
        raise ValueError(f"{name}: milestones={list(steps)} must be increasing update counts >= 1")
    if not 0.0 < lr_decay <= 1.0:
        raise ValueError(f"{name}: {lr_decay=} must be in (0, 1]")
    return steps


def step_lr(lr: float, warmup: int, step: int, milestones: tuple[int, ...] = (), lr_decay: float = 1.0) -> float:
    """Linear warm-up and a step schedule (001_... App. C.4: "Learning Rate Decay 0.1, Schedule: Epochs 80 and 120"):
    eta_k = lr min(1, (k + 1) / warmup) lr_decay^(number of milestones <= k)."""
    eta = warmup_lr(lr, warmup, step)
    passed = sum(1 for m in milestones if step >= m)
    return eta * lr_decay**passed if passed else eta


def zeros_like(params: Flat) -> torch.Tensor:
    """A fresh zero buffer the shape of the parameters (rules own their buffers)."""
    return torch.zeros_like(params)
