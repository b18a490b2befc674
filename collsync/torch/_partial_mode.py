"""`backup` without servers (000_..., Chen et al., Alg. 3-4): each step t is a k-of-n partial allreduce
(`runtime.mpi_partial.PartialAllreduce`). The first n - b gradients of round t to arrive are averaged, and, with
the default `margin="auto"`, every other one that comes within the margin the measured arrivals give
(`margin.Margin`: with nobody straggling, every round takes all n); every replica applies that same mean with the
user's optimizer, and a gradient that came later is dropped and counted (`dropped`). `margin=None` takes exactly
n - b every round (the paper's fixed b). A worker whose round is already complete reads the mean without
contributing, and then catches up (`catch_up`): it reads and applies every further round the others completed
meanwhile (up to its epoch's end), so that it computes only for the current round, as 000_...'s late worker drops
its stale work and joins the current step. Its batches are not lost: `collsync.torch.DistributedSampler` hands out
each round's batches by `ledger.Ledger` (settled with each round's contributors), so the batch of a dropped gradient,
or of a round caught up on, is computed by a worker in time for a later round, and an epoch lasts the rounds its
batches need (where the sampler cannot follow the ledger, it skips the caught-up rounds' batches instead: see
`collsync.torch.sampler`). Every worker still applies every round in order (the replicas stay identical) and ends
each epoch at the same round, but a persistently slow worker no longer sets the pace: rounds go at the fast
workers' pace with the gradients that came. Catch-up needs the sampler (given its DataLoader's `batch_size`) and no
closure; by default
it is off while a learning-rate scheduler is attached to the optimizer, since a worker that skips batches also skips
a per-step schedule's steps (`catch_up=True` where the schedule steps per epoch). A worker silent for the deadline is
lost: the others go on without it while at most b are (`runtime.mpi_partial_lost`), `lost` names it after
`close()`, and the process exits 0 without `MPI_Finalize`.

The rounds themselves are `collsync.rounds.BackupRounds`, the driver `collsync-train runtime=partial` runs too;
this mode adds only how a mean is applied (the user's optimizer) and how work is skipped (the sampler).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from collsync import ending
from collsync.ledger import Ledger
from collsync.loops import check_policy
from collsync.rounds import BackupRounds, tolerated
from collsync.runtime import PartialResult
from collsync.runtime.mpi_buckets import BucketReducer
from collsync.runtime.mpi_coll import shutdown, threads_supported
from collsync.runtime.mpi_partial import PartialAllreduce
from collsync.torch import _mode
from collsync.torch import sampler as samplers
from collsync.torch._mode import Mode, one_dtype
from collsync.torch._server_mode import exit_without_finalize
from collsync.torch._world import World
from collsync.torch.config import SyncConfig
from collsync.torch.sampler import skipper


class PartialMode(Mode):
    """Backup workers without servers: see the module docstring."""

    name = "backup"

    def __init__(
        self,
        st: World,
        params: list[torch.Tensor],
        config: SyncConfig,
        passes: int = 1,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.st = st
        self.passes = passes  # batches (backward passes) a step, so a round skipped is that many batches
        self.optimizer = optimizer  # the wrapped optimizer: whether a learning-rate scheduler is attached
        self.catch_up = config.catch_up
        self._warned = False
        policy = config.policy
        check_policy(policy)
        workers = st.comm.Get_size()
        policy.check(workers)
        self.quorum = policy.quorum_for(workers)
        self.flat = one_dtype(params, policy.name)
        self._lost: list[dict[str, Any]] = []
        self.reducer: BucketReducer | None = None
        self.pa: PartialAllreduce | None = None
        self.rounds: BackupRounds | None = None
        self._reduced = 0  # rounds of b = 0 (bsp's allreduces)
        if self.quorum == workers > 1 and threads_supported():
            # b = 0: nobody is ever dropped, so this is bsp; it takes bsp's path (buckets reduced while backward
            # runs) rather than n window round trips a step.
            self.reducer = BucketReducer(
                st.comm,
                self.flat,
                _mode.BUCKET_BYTES,
                post=1.0 / workers,
                passes=passes,
                deadline=policy.deadline,
                what="DistributedOptimizer: the gradient allreduce",
            )
            return
        self.pa = PartialAllreduce(
            st.comm,
            self.flat.buf.numel(),
            dtype=self.flat.buf.dtype,
            depth=config.depth,
            timeout=policy.deadline,
            margin=config.margin,
            tolerate=tolerated(policy, workers),
        )
        # The ledger hands out the batches round by round (one round is one batch: `passes` 1, with catch-up).
        ledger = Ledger(workers) if config.catch_up is not False and passes == 1 else None
        self.rounds = BackupRounds(self.pa, self.quorum, catch_up=config.catch_up is not False, ledger=ledger)
        if ledger is not None:
            samplers.follow(self.rounds)

    @property
    def round(self) -> int:
        """The rounds this replica applied (the partial allreduce's, or the allreduces of b = 0)."""
        return self.rounds.round if self.rounds is not None else self._reduced

    @property
    def dropped(self) -> int:  # type: ignore[override]
        return self.rounds.dropped if self.rounds is not None else 0

    @property
    def caught_up(self) -> int:  # type: ignore[override]
        return self.rounds.caught_up if self.rounds is not None else 0

    def synchronize(self) -> None:
        if self.reducer is not None:
            self.reducer.wait()
            self._reduced += 1
            return
        assert self.rounds is not None  # one of the two is built in __init__
        self.flat.set_grads(self.rounds.take(self.flat.grads).mean)

    def step(self, base: Callable[[Any], Any], closure: Any, sync: bool) -> Any:
        if sync:
            self.synchronize()
            if closure is None:
                self._catch_up(base)
        if self.rounds is not None:  # every way out of a late round (a script's own `synchronize()` too) completes
            self.rounds.pause()  # its reads before the caller computes; after a catch-up, again: free
        return base(closure)

    def _catch_up(self, base: Callable[[Any], Any]) -> None:
        """This worker came after its round completed: apply every further round already complete (each with the
        user's optimizer, as every replica applies it), at most as many as its sampler can still skip (a round is
        `passes` batches), and skip their batches. The last mean read is left in the gradients for `step()`."""
        rounds = self.rounds
        if rounds is None or not rounds.late or self.catch_up is False:
            return
        sampler = skipper()
        if sampler is None:
            return
        if self.catch_up is None and getattr(getattr(self.optimizer, "step", None), "_wrapped_by_lr_sched", False):
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "DistributedOptimizer(sync='backup'): a learning-rate scheduler is attached, so a late worker "
                    "does not skip to the current round (skipping batches, it would also skip a per-step schedule's "
                    "steps and its replica would differ); pass catch_up=True if the schedule steps once per epoch",
                    stacklevel=4,
                )
            return

        def apply(result: PartialResult) -> None:
            base(None)  # the round read before this one
            self.flat.set_grads(result.mean)

        if sampler.follows and rounds.ledger is not None:  # the ledger hands the rounds' batches to the others
            rounds.catch_up(sys.maxsize, apply, stop=sampler.ends_epoch)
            return
        caught = rounds.catch_up(sampler.skippable() // self.passes, apply)
        if caught:
            sampler.skip(caught * self.passes)

    def join(self) -> int:
        raise NotImplementedError(
            "join() under sync='backup': every worker must take part in every round of the partial allreduce; "
            "give every worker the same number of steps (e.g. drop_last=True)"
        )

    @property
    def lost(self) -> list[dict[str, Any]]:
        """The workers the others went on without (`runtime.mpi_partial_lost`), known once closed."""
        return self._lost

    def close(self) -> None:
        if self.rounds is not None and self.rounds.ledger is not None:
            samplers.follow(None)
        pa = self.pa
        if pa is not None and pa.tolerate and pa.leave_live():
            # Ranks lost (at most the backups): the windows' free and the world's end are collective and would wait
            # for them, so this process ends at exit without either (as the server modes' workers do).
            ranks = sorted(pa.lost)
            world = self.st.comm.Get_group().Translate_ranks(ranks, self.st.world.Get_group())  # local: no message
            self._lost = [
                ending.lost_rank(r, pa.host_of(r), pa.lost[r] - 1, world_rank=w)
                for r, w in zip(ranks, world, strict=True)
            ]
            self.st.lost = self._lost
            exit_without_finalize()
            return
        shutdown(self.st.comm, self.st.deadline)  # a lost rank: RankLost naming it, not a hang
        if self.reducer is not None:
            self.reducer.remove()
        elif self.pa is not None:
            self.pa.free()
