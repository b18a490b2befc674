"""Serverless backup workers: every rank holds a `Server` replica and averages through a k-of-n partial allreduce.

Each round t (000_..., Chen et al., Alg. 3-4 with the parameter server replicated on every worker):

    mean, contributors, dropped = pa(grad L(theta_t), quorum=N, round=t)     # the first N of the N + b gradients
    server.apply_mean(mean, contributors)                                      # theta_{t+1}, identical everywhere
    server.accept(late) for each dropped rank                                  # the b late ones: dropped, traced

`quorum` = n (`sync=bsp`) is serverless BSP and gives the same parameters, bit for bit, as `run_allreduce` (the
partial allreduce sums the n gradients in rank order; a full allreduce of the same data is equal wherever its sum
is exact, and on float64 small integers always). A rank whose round is already complete when it gets there reads
the mean without computing a gradient that would be dropped (`PartialAllreduce.try_read`: the serverless form of a
backup worker skipping to the server's round, `policy.next_clock`). A rank up to `depth` rounds behind catches up
by reading the means it missed, in order; further behind, the fast ranks wait for it (see
`collsync.runtime.mpi_partial`).

`runtime=partial` runs it from `collsync.train` (`sync=bsp` or `sync=backup`). A frozen worker stalls the others once
it is `depth` rounds behind; with `sync.deadline` as the partial allreduce's `timeout`, the run then fails naming
what it waited for instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from collsync.loops import GradFn
from collsync.policy import SyncPolicy
from collsync.runtime.mpi_partial import PartialResult
from collsync.server import Server
from collsync.types import Arrival, Flat


class Partial(Protocol):
    """What `run_partial` needs of a k-of-n partial allreduce (`collsync.runtime.mpi_partial.PartialAllreduce`)."""

    rank: int
    size: int

    def __call__(self, tensor: Flat, quorum: int, round: int) -> PartialResult: ...

    def try_read(self, quorum: int, round: int) -> PartialResult | None: ...


def check_policy(policy: SyncPolicy) -> None:
    """A partial allreduce completes rounds in order with a fixed quorum: BSP and backup workers, nothing else."""
    if not policy.rounds or policy.max_lead or policy.timeout is not None:
        raise ValueError(
            f"runtime=partial runs sync=bsp or sync=backup (rounds, no lead, no timeout); got sync={policy.name} "
            f"(rounds={policy.rounds}, max_lead={policy.max_lead}, timeout={policy.timeout})"
        )


def run_partial(
    server: Server,
    pa: Partial,
    grads: GradFn,
    on_update: Callable[[Server], None] | None = None,
) -> Server:
    """Train `server` (this rank's replica) to `server.steps` updates, each the mean of the first `quorum` gradients.

    Every rank calls this with an identical replica; each applies the same means in the same order, so the replicas
    stay identical without a broadcast. Returns `server`.
    """
    check_policy(server.policy)
    if server.workers != pa.size:
        raise ValueError(f"run_partial: the server expects workers={server.workers}, the world has {pa.size} ranks")
    computed = 0
    while not server.done:
        t = server.version
        result = pa.try_read(server.quorum, t)
        if result is None:
            # The gradient function copies the view into the model itself: no copy of our own here.
            result = pa(grads(server.view(), pa.rank, computed), server.quorum, t)
            computed += 1
        apply_result(server, result)
        if on_update is not None:
            on_update(server)
    return server


def apply_result(server: Server, result: PartialResult) -> None:
    """One round on a replica: the contributors' mean is applied, then the other ranks' gradients reach the replica
    late and are dropped by the server's own rule for a round already applied (reason "late", or "finished" after
    the last update), exactly as the parameter-server runtime drops a straggler's gradient."""
    t = result.round
    if t != server.version:
        raise ValueError(f"run_partial: result of round {t} applied to a replica at version {server.version}")
    mean = result.mean
    server.apply_mean(mean, [Arrival(r, t, mean, t) for r in result.contributors])
    for r in result.dropped:
        # The dropped gradient itself never travels (it may not even have been computed): the mean stands in for
        # it, and is never read, because a gradient of round t < version is dropped before anything uses it.
        if server.accept(Arrival(r, t, mean, t)):
            raise RuntimeError(f"run_partial: rank {r}'s late gradient of round {t} was not dropped")
