"""Update rules in the optax style: one factory per rule returning `Rule(init, update, view)`, composed with `chain`.

Penalties (what a stale gradient becomes) and optimizers (what the averaged gradient does to the parameters) share
the interface; the server applies `penalty` per arrival and `optimizer` per aggregated update.
"""

from collsync.rules.base import EmptyState, Rule, chain, identity, params_unchanged
from collsync.rules.optim import adam, momentum, nesterov, rmsprop, sgd

__all__ = [
    "EmptyState",
    "Rule",
    "adam",
    "chain",
    "identity",
    "momentum",
    "nesterov",
    "params_unchanged",
    "rmsprop",
    "sgd",
]
