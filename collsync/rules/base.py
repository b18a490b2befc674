"""The optax-style rule interface: a rule is a pair of pure functions over flat tensors.

A rule turns what arrived at the server into something else: a penalty turns a stale gradient into a penalised
gradient, an optimizer turns an (averaged, penalised) gradient into the parameter delta. Rules never mutate the
parameters; `collsync.server.Server.accept` is the only place parameters change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

import torch

from collsync.types import Context, Flat, State

SIGNAL = "signal"
"""The statistic a rule publishes to the workers: the server sends it with every version (`Stamp.signal`), and a
policy's `Transmit` turns it into the chance to push or fetch (B-FASGD's v, 002_... eq. 9, from `fasgd`)."""

Stats = Callable[[State], dict[str, float]]
"""A rule's statistics of its last update, read from its state: e.g. Gap-Aware's mean Gap ("gap", 001_... Fig. 4)."""


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

    `stats` (optional) reports the rule's own statistics from its state, so that nothing else needs to know how the
    state is laid out: the server records them on its `apply` events and publishes the one under `SIGNAL` to the
    workers. A wrapper passes its inner rule's through; `chain` merges them.
    """

    init: Callable[[Flat], State]
    update: Callable[[Flat, State, Flat, Context], tuple[Flat, State]]
    view: Callable[[Flat, State], Flat] = params_unchanged
    needs_read: bool = False
    update_: Callable[[Flat, State, Flat, Context], tuple[Flat, State]] | None = None
    stats: Stats | None = None


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
    update_ = composed(lambda r: r.update_ or r.update) if all(r.update_ is not None for r in rules) else None

    def view(params: Flat, state: tuple[State, ...]) -> Flat:
        for rule, s in zip(rules, state, strict=True):
            params = rule.view(params, s)
        return params

    def stats(state: tuple[State, ...]) -> dict[str, float]:
        merged: dict[str, float] = {}
        for rule, s in zip(rules, state, strict=True):
            if rule.stats is not None:
                for key, value in rule.stats(s).items():
                    merged.setdefault(key, value)  # a key two rules report: the earlier rule's
        return merged

    reports = any(r.stats is not None for r in rules)
    return Rule(init, update, view, any(r.needs_read for r in rules), update_, stats if reports else None)


def inner_stats(rule: Rule, inner: Callable[[State], State]) -> Stats | None:
    """The `stats` of a wrapper of `rule` whose state holds `rule`'s at `inner(state)`: the wrapped rule's own."""
    if rule.stats is None:
        return None
    stats = rule.stats
    return lambda state: stats(inner(state))


def check_decay(name: str, weight_decay: float) -> None:
    """Reject a negative weight decay lambda, naming the rule and the value."""
    if weight_decay < 0:
        raise ValueError(f"{name}: {weight_decay=} must be >= 0")


def decayed(grad: Flat, params: Flat, weight_decay: float, *, in_place: bool = False) -> Flat:
    """g + lambda theta: weight decay added to the gradient (001_... App. C.5): a new tensor, or `grad` itself
    overwritten when `in_place` (an `update_` that owns it). `grad` untouched when lambda = 0, so that a rule without
    decay computes exactly what it would without the term."""
    if not weight_decay:
        return grad
    return grad.add_(weight_decay * params) if in_place else grad + weight_decay * params


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


# -- rule states as plain lists (checkpoints) --------------------------------------------------------------------


def plain(state: Any) -> Any:
    """A rule state (NamedTuples of tensors and numbers, nested in tuples by `chain`) as nested lists: what
    `torch.load(weights_only=True)` reads back."""
    if isinstance(state, tuple):
        return [plain(s) for s in state]
    return state


def unplain(template: Any, saved: Any, what: str) -> Any:
    """The inverse of `plain`, shaped by `template` (the state a fresh `Rule.init` gives): the saved leaves in the
    template's NamedTuples, after checking that the two have the same structure and tensor shapes. A mismatch (a
    state saved under another rule or other options) is refused naming both shapes (`outline`)."""
    try:
        return _unplain(template, saved)
    except _Misfit:
        raise ValueError(
            f"checkpoint: the saved {what} state ({_clip(outline(saved))}) does not fit this config's {what}, whose "
            f"state is {_clip(outline(template))}: resume with the {what} and options the checkpoint was saved with"
        ) from None


class _Misfit(Exception):
    """Raised inside `_unplain` and reported once, with both whole shapes, by `unplain`."""


def _unplain(template: Any, saved: Any) -> Any:
    if isinstance(template, tuple):
        named = hasattr(template, "_fields")
        if not isinstance(saved, list) or (named and len(saved) != len(template)):
            raise _Misfit
        if not named and len(saved) != len(template):
            # A tuple that grows as training goes (DANA's per-worker momenta): the saved one, as it was.
            return tuple(_tuples(s) for s in saved)
        items = [_unplain(t, s) for t, s in zip(template, saved, strict=True)]
        return type(template)(*items) if named else tuple(items)
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != template.shape:
            raise _Misfit
        return saved.to(template.dtype)
    return saved


def outline(state: Any) -> str:
    """A state's structure in one short line: `LookaheadState(v=tensor[10], horizon, eta)`, or for a saved one
    (plain lists) `[tensor[10]]`."""
    if isinstance(state, torch.Tensor):
        return f"tensor[{', '.join(map(str, state.shape))}]"
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        parts = (
            f"{f}={outline(v)}" if isinstance(v, (torch.Tensor, tuple, list)) else f
            for f, v in zip(state._fields, state, strict=True)
        )
        return f"{type(state).__name__}({', '.join(parts)})"
    if isinstance(state, (tuple, list)):
        inner = ", ".join(outline(s) for s in state)
        return f"({inner})" if isinstance(state, tuple) else f"[{inner}]"
    return type(state).__name__


def _clip(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _tuples(saved: Any) -> Any:
    return tuple(_tuples(s) for s in saved) if isinstance(saved, list) else saved
