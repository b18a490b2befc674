"""The small value types shared by rules, the server, the policies and every runtime.

Everything that crosses a module boundary is a NamedTuple of plain tensors and ints, so that the simulator and the
MPI runtimes can move it without knowing what it means.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

Flat = torch.Tensor
"""A 1-D tensor holding every parameter (or gradient) of a model back to back (see `collsync.flat.FlatModel`)."""

State = Any
"""A rule's state: a NamedTuple of tensors (and ints), or a tuple of such states for `chain`."""


class Arrival(NamedTuple):
    """A gradient as it reaches the server.

    `version` is the server version of the parameters the gradient was computed on; `clock` is the round the worker
    computed it for (equal to `version` under BSP and backup workers, ahead of it by at most `max_lead` under SSP).
    `grad` is None when a B-FASGD worker skipped its push: the server re-applies that worker's last gradient.
    """

    worker: int
    version: int
    grad: Flat | None
    clock: int = 0


class Context(NamedTuple):
    """What a rule may know about the gradient it is updating with, beyond the gradient itself.

    `staleness` is the delay tau of 001_... (server updates since the worker read its parameters); `read` holds the
    parameters the worker read (only filled when a rule asks for them, see `Rule.needs_read`); `aggregated` is the
    number of gradients averaged into this update (PSP's d, linear learning-rate scaling of 003_...). For an update
    of several gradients `staleness` is the oldest one's and `mean_staleness` their mean (None: one gradient, the
    same as `staleness`).
    """

    step: int
    worker: int
    staleness: int
    workers: int = 1
    read: Flat | None = None
    aggregated: int = 1
    mean_staleness: float | None = None


class Stamp(NamedTuple):
    """What a worker learns when it reads: the server version it got, whether training is over, and `signal`, a
    scalar the server's optimizer publishes to its workers (its `SIGNAL` statistic, `collsync.rules.base`; 0.0 when
    it reports none). A policy's `Transmit` reads it: B-FASGD's chance to push or fetch follows FASGD's v.
    `closer`: the worker whose push completed the round that made this version (-1: none, e.g. a timeout closed
    it, or the runtime does not say); ssp's hold reads it (`loops.Worker`: the worker the rounds wait on)."""

    version: int
    done: bool = False
    signal: float = 0.0
    closer: int = -1
