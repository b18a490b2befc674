"""Update rules in the optax style: one factory per rule returning `Rule(init, update, view)`, composed with `chain`.

Penalties (what a stale gradient becomes) and optimizers (what the averaged gradient does to the parameters) share
the interface; the server applies `penalty` per arrival and `optimizer` per aggregated update.

| paper algorithm                      | penalty                  | optimizer                         |
|--------------------------------------|--------------------------|-----------------------------------|
| ASGD (001 Alg. 2, gamma = 0)         | identity                 | sgd                               |
| NAG-ASGD (001 §6)                    | identity                 | nesterov                          |
| SA, step size (001 Alg. 3)           | staleness_aware_step(*)  | momentum / nesterov               |
| SA, gradient (001 Alg. 5)            | staleness_aware          | momentum / nesterov               |
| SASGD (002 eq. 1)                    | staleness_aware          | sgd  (= staleness_aware_step)     |
| GA (001 Alg. 4, 14)                  | gap_aware                | nesterov (the paper's) / momentum |
| DANA / DANA-SA / DANA-GA (001 6-8)   | identity / SA / GA       | dana                              |
| Adam / Adam-SA / Adam-GA (001 9-11)  | identity                 | adam / adam_sa / adam_ga          |
| FASGD (002 eqs. 4-8)                 | identity                 | fasgd                             |
| PSP-SGD lr scaling (003 Alg. 1)      | any                      | linear_scaling(optimizer, c)      |
| SSP rounds, DANA's look-ahead        | identity                 | lookahead                         |
| warm-up + momentum correction (C.4)  | any                      | gradual_warmup(optimizer, ...)    |

(*) wraps the optimizer: see `combine`.
"""

from __future__ import annotations

from collections.abc import Callable

from collsync.rules.adam_variants import AdamGAState, AdamSAState, adam_ga, adam_sa
from collsync.rules.base import SIGNAL, EmptyState, Rule, chain, identity, params_unchanged
from collsync.rules.dana import DANAState, dana
from collsync.rules.fasgd import FASGDState, bfasgd_probability, fasgd
from collsync.rules.gap import GapAwareState, gap_aware
from collsync.rules.lookahead import LookaheadState, lookahead
from collsync.rules.optim import adam, momentum, nesterov, rmsprop, sgd
from collsync.rules.schedule import GradualWarmupState, LinearScalingState, gradual_warmup, linear_scaling
from collsync.rules.staleness import (
    StalenessAwareState,
    StalenessAwareStepState,
    staleness_aware,
    staleness_aware_step,
)

__all__ = [
    "SIGNAL",
    "AdamGAState",
    "AdamSAState",
    "DANAState",
    "EmptyState",
    "FASGDState",
    "GapAwareState",
    "GradualWarmupState",
    "LinearScalingState",
    "LookaheadState",
    "Rule",
    "StalenessAwareState",
    "StalenessAwareStepState",
    "adam",
    "adam_ga",
    "adam_sa",
    "bfasgd_probability",
    "chain",
    "combine",
    "dana",
    "fasgd",
    "gap_aware",
    "gradual_warmup",
    "identity",
    "linear_scaling",
    "lookahead",
    "momentum",
    "nesterov",
    "params_unchanged",
    "rmsprop",
    "sgd",
    "staleness_aware",
    "staleness_aware_step",
]


def combine(penalty: Rule | Callable[[Rule], Rule] | None, optimizer: Rule) -> tuple[Rule, Rule]:
    """The (penalty, optimizer) pair to give `Server(..., optimizer, ..., penalty=penalty)`.

    A penalty is either a `Rule`, applied to each arriving gradient before the optimizer (`staleness_aware`,
    `gap_aware`, `identity`), or a function of the optimizer that wraps its step (`staleness_aware_step`, which a
    config instantiates with `_partial_: true`); the latter becomes part of the optimizer and the penalty is the
    identity. Adam-SA / Adam-GA are optimizers (`adam_sa`, `adam_ga`) because they penalise Adam's first moment
    only; `staleness_aware` or `gap_aware` in front of `adam` would divide both moments, which cancels out.
    """
    if not isinstance(optimizer, Rule):
        raise TypeError(f"combine: optimizer must be a Rule, got {type(optimizer).__name__}")
    if penalty is None:
        return identity(), optimizer
    if isinstance(penalty, Rule):
        return penalty, optimizer
    if callable(penalty):
        wrapped = penalty(optimizer)
        if not isinstance(wrapped, Rule):
            raise TypeError(f"combine: penalty {penalty!r} returned {type(wrapped).__name__}, not a Rule")
        return identity(), wrapped
    raise TypeError(f"combine: penalty must be a Rule or a function of the optimizer, got {type(penalty).__name__}")
