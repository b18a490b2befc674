"""Serverless backup rounds, one driver below both fronts (000_..., Chen et al., Alg. 3-4, without a server).

Every worker holds a replica; round t is one k-of-n partial allreduce (`runtime.Partial`). A worker that comes to
round t before it completed contributes its gradient; one that comes after reads the round's mean without
contributing (its gradient is dropped). Either way every replica applies the same mean of round t, in order.

A late worker then *catches up*: every further round the others completed meanwhile is read and applied at once,
and the worker skips as many rounds of its own work, so that it computes only for the current round, as 000_...'s
late worker drops its stale work and joins the current step. Without catch-up a late worker reads each missed round
as it comes to it and computes a gradient for each next one, so a persistently slow worker sets a slower pace of
its own rounds than the others and is dropped in every one.

A late rank's batches are not lost with its gradient: with catch-up every round's batches come from a
`ledger.Ledger` settled here with each round's contributors, which hands the batch of a gradient that came late, or
of a round a rank skipped, to a rank in time for a later round; so every batch of an epoch is in exactly one applied
mean, and an epoch takes the rounds its batches need (about n / (n - b) times bsp's with one rank always late).

What a front supplies is only how a mean is applied (`apply`: the user's optimizer in `collsync.torch`, the replica
server in `collsync-train`) and how a batch is found (the sampler's chunk of torch's shards, or `data.Batches`'
shard and index), and where an epoch ends (the sampler's `stop` of catch-up; a trainer's rounds have no epochs).
The margin (how long a round waits after its quorum-th gradient), the ring's `depth` and the lost ranks tolerated
are the transport's (`runtime.mpi_partial.PartialAllreduce`, built by the front with `tolerated` below).

`run_partial` is collsync-train's training loop on it (`runtime=partial`), `apply_result` how a round reaches a
replica server. This module imports no MPI: it drives the `Partial` protocol, which the tests also drive in one
process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from collsync.ledger import Ledger
from collsync.loops import GradFn, check_policy
from collsync.policy import SyncPolicy
from collsync.runtime import Partial, PartialResult
from collsync.server import Server
from collsync.types import Arrival, Flat


def tolerated(policy: SyncPolicy, workers: int) -> int:
    """How many lost ranks the others go on without: what the policy tolerates, while the quorum can still come."""
    quorum = policy.quorum_for(workers)
    return min(workers - quorum, max((k for k in range(workers) if policy.tolerates(k, workers)), default=0))


class BackupRounds:
    """Round t of `pa` for this rank, then the next: `take(grads)` reads round t if it is complete already, else
    contributes `grads()`; after a late round `catch_up(room, apply)` applies the rounds completed meanwhile, and
    ends with `pause()` (which a caller that does not catch up calls itself before it computes).
    Counts: `dropped` (rounds this rank's gradient was not part of), `caught_up` (rounds applied without computing).
    A `ledger` is settled with every round's contributors, taken or caught up."""

    def __init__(
        self, pa: Partial, quorum: int, first: int = 0, catch_up: bool = True, ledger: Ledger | None = None
    ) -> None:
        self.pa, self.quorum, self.catch_up_on, self.ledger = pa, quorum, catch_up, ledger
        self.round = first  # the partial allreduce's own round numbers (a resumed replica maps them to its version)
        self.late = False  # the last round taken was complete before this rank came: its gradient was dropped
        self.dropped = 0
        self.caught_up = 0

    def take(self, grads: Callable[[], Flat]) -> PartialResult:
        """Round `round`: its mean (read if complete, else with this rank's `grads()` in it), then the next round."""
        result = self.pa.try_read(self.quorum, self.round)
        self.late = result is not None
        if result is None:
            result = self.pa(grads(), self.quorum, self.round)
        self.dropped += self.pa.rank not in result.contributors
        self._settle(result)
        return result

    def _settle(self, result: PartialResult) -> None:
        self.round += 1
        if self.ledger is not None:
            self.ledger.settle(result.contributors)

    def catch_up(
        self, room: int, apply: Callable[[PartialResult], None], stop: Callable[[], bool] | None = None
    ) -> int:
        """After a late round: read every further round already complete, at most `room` of them and none once
        `stop()` (an epoch's end), and `apply` each in order; the rounds caught up (the caller skips that much work,
        unless its ledger hands out the batches). Nothing unless the last round was late; either way it ends with
        `pause`, so a stop on `room` or `stop()` leaves no read half done."""
        caught = 0
        if self.late and self.catch_up_on:
            while caught < room and not (stop is not None and stop()):
                result = self.pa.try_read(self.quorum, self.round)
                if result is None:
                    break
                apply(result)
                self._settle(result)
                caught += 1
        self.caught_up += caught
        self.pause()
        return caught

    def pause(self) -> None:
        """This rank reads no further round for now (it computes, or its epoch ended; `catch_up` ends so): after a
        late round, the transport completes what its reads left to the next one (`Partial.stop_reading`). A read
        taken without a round trip (a delivery) leaves its ticket and read counter to the next read, so a catch-up
        that stops on its room or an epoch's end, and then a SIGSTOP, would leave the others' accounting of this
        rank behind. Costs nothing where nothing is left (a round this rank contributed to, or a backlog that ran
        out: its last read completed them)."""
        if self.late:
            self.pa.stop_reading()


def run_partial(
    server: Server,
    pa: Partial,
    grads: GradFn,
    on_update: Callable[[Server], None] | None = None,
    catch_up: bool = True,
    ledger: Ledger | None = None,
) -> Server:
    """Train `server` (this rank's replica) to `server.steps` updates, each the mean of round t's first `quorum`
    gradients (and those within the transport's margin), through `rounds.BackupRounds`, as `collsync.torch` does.

    Every rank calls this with an identical replica; each applies the same means in the same order, so the replicas
    stay identical without a broadcast. A rank that comes to a round already complete reads its mean without
    computing; with `catch_up` it then applies every further round complete meanwhile, and the batches come from a
    `Ledger` (`grads(view, shard, index)` of this rank's chunk): those of the gradients that came late and of the
    rounds a rank skipped are computed by ranks in time, so no batch is lost (`server.steps` rounds use
    `server.steps` x quorum batches or more; the trace's contributors say which). Without `catch_up` a rank
    computes its own next batch (shard = its rank). `ledger`: the one to use (a test's, keeping its log), else a
    new one with catch-up. Returns `server`.
    """
    check_policy(server.policy)
    if server.workers != pa.size:
        raise ValueError(f"run_partial: the server expects workers={server.workers}, the world has {pa.size} ranks")
    # The partial allreduce numbers its rounds from 0; a replica resumed at version `base` maps them onto its own.
    # The batch index goes on from the version (with b = 0, every rank computes every round; else it is a choice).
    base = computed = server.version
    # A resumed replica's ledger starts with the chunks of its version (those returned before the resume are lost).
    if ledger is None and catch_up:
        ledger = Ledger(pa.size, first=base * pa.size)
    rounds = BackupRounds(pa, server.quorum, catch_up=catch_up, ledger=ledger)

    def compute() -> Flat:
        nonlocal computed
        computed += 1
        # The gradient function copies the view into the model itself: no copy of our own here.
        if ledger is not None:
            return grads(server.view(), *ledger.batch(pa.rank))
        return grads(server.view(), pa.rank, computed - 1)

    def apply(result: PartialResult) -> None:
        apply_result(server, result._replace(round=result.round + base))
        if on_update is not None:
            on_update(server)

    while not server.done:
        apply(rounds.take(compute))
        rounds.catch_up(sys.maxsize if server.steps is None else server.steps - server.version, apply)
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
