"""`DistributedSampler`: torch's, with the epoch's data shared by speed in the modes that let workers differ.

Torch's sampler gives every worker a fixed shard of each epoch (`indices[rank::num_replicas]`), so an epoch lasts as
long as the slowest worker takes over its shard. Here, in the modes where workers need not take the same number of
steps, the workers instead take chunks of `batch_size` positions of the epoch's permutation from one shared counter
(`runtime.mpi_counter.SharedCounter`: an MPI window on worker 0, `MPI_Fetch_and_op`): chunk k of an epoch holds
positions [k*B, (k+1)*B) of `randperm(len(dataset))` seeded with `seed + epoch` (the same permutation on every worker,
as torch's), ticket t of the counter is chunk t - base of the pass that began at ticket base, and a worker's epoch
ends when its ticket lies beyond the epoch. Every sample is handed out exactly once per epoch, fast workers take
more of it (a worker 3x slower takes about a third of a fast one's share), and which worker gets which chunk is
fixed by the order in which the takes reached the counter. A ticket drawn past the epoch's end is kept for the
worker's next epoch, so no chunk is lost between epochs.

Which mode uses which (`shared=None`, decided from `init`'s world):

* shared counter: a parameter-server world (`init` reserved servers) whose mode, given to `init(sync=...)`, applies
  gradients as a stream rather than in rounds: `async`, `bfasgd`, `specsync` over async. A worker that took fewer
  batches holds nobody up, at an epoch's end either.
* torch's fixed shards, bit for bit: everything else. `bsp` and serverless `backup` apply every round on every
  replica, so every worker must take the same number of steps (and a Horovod script's results stay identical). The
  round modes on servers (`ssp`, `psp`, `backup`, `specsync` over ssp) complete round t only with enough pushes for
  it: a worker whose data ran out first and that waits at the epoch's end (an `allreduce` of metrics, evaluation)
  would leave the others' last round short of pushes, a deadlock; and SSP lets a worker lead by at most `max_lead`
  rounds, so it could take only that many more batches anyway. A mode given to `DistributedOptimizer` only is not
  known when the sampler is built: fixed shards then.

`shared=True` or `False` overrides the choice (True needs `collsync.torch.init()`; the counter then spans its
workers). A DataLoader should take `batch_size` equal to the sampler's, so that one take hands out one batch.

Serverless `backup` (with catch-up, its default) hands out each round's batches by `ledger.Ledger`: a batch whose
gradient came late, or that of a round a late worker caught up on without computing, goes to a worker in time for
a later round, so no batch of torch's shards is lost with a dropped gradient. Each batch is in exactly one applied
mean; an epoch lasts as many rounds as its batches need (every worker ends it at the same round: the ledger, which
every replica settles with each round's contributors, says when), and the few batches (fewer than `num_replicas`)
left when it ends go first in the next epoch. Chunk g of the ledger is batch g // n of torch's shard g % n (n =
`num_replicas`) of the epoch it belongs to, counting only full batches (the short last batch of each shard is left
out). This needs the sampler's `batch_size` (that of its DataLoader) and a DataLoader that fetches a batch only
when asked (`num_workers=0`): one fetching ahead (found at its second batch) gets torch's shards, and a worker late
for a round then skips the batches of the rounds it caught up on (`skip`, `skippable`: whole batches not yet handed
out), as with `backward_passes_per_step` > 1 or `catch_up=False`; their samples are then left out of the epoch.
While it follows the ledger, `state_dict()` keeps the epoch but not the position in it (a resume starts the epoch).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from collsync.ledger import Ledger
from collsync.policy import SyncPolicy
from collsync.rounds import BackupRounds
from collsync.runtime.mpi_counter import SharedCounter
from collsync.torch import _world

# The samplers that can skip batches for serverless backup (weakly held: a sampler dropped by the script goes).
_SKIPPERS: weakref.WeakSet[DistributedSampler] = weakref.WeakSet()
# Serverless backup's rounds whose ledger hands out the batches (`follow`; weakly held, as the mode that owns them).
_FOLLOWED: list[weakref.ref[BackupRounds]] = []


def follow(rounds: BackupRounds | None) -> None:
    """Let a sampler with `batch_size` hand out the batches of `rounds.ledger` (None: no longer)."""
    _FOLLOWED[:] = [] if rounds is None else [weakref.ref(rounds)]


def _followed() -> tuple[BackupRounds, Ledger] | None:
    rounds = _FOLLOWED[0]() if _FOLLOWED else None
    return None if rounds is None or rounds.ledger is None else (rounds, rounds.ledger)


# The fixed-shard samplers whose shards are the world's (num_replicas and rank left out, or equal to the world's):
# they follow a world shrunk in place (`follow_world`).
_WORLD_FOLLOWERS: weakref.WeakSet[DistributedSampler] = weakref.WeakSet()


def follow_world(size: int, rank: int) -> None:
    """The workers' world shrank in place to `size` after a worker died (ULFM): each sampler that follows the world
    deals the samples of its epoch not yet handed out among the `size` workers left, this one taking share `rank`
    (`DistributedSampler.reshard`)."""
    for sampler in list(_WORLD_FOLLOWERS):
        sampler.reshard(size, rank)


def skipper() -> DistributedSampler | None:
    """The one sampler iterating an epoch that can skip batches (serverless backup's catch-up), or None when there is
    none or more than one (which one feeds training would be a guess)."""
    live = [s for s in _SKIPPERS if s._live is not None]
    return live[0] if len(live) == 1 else None


def uses_counter(servers: int, policy: SyncPolicy | None) -> bool:
    """Whether `shared=None` takes the shared counter: servers reserved and a stream mode (see the module)."""
    return servers > 0 and policy is not None and not policy.rounds


class DistributedSampler(TorchDistributedSampler):
    """torch's `DistributedSampler` (same arguments, `set_epoch`, `__len__`), plus `batch_size` (the positions one
    take hands out), `shared` (see the module docstring), `state_dict()` / `load_state_dict()` and `taken`.

    `len()` is torch's fair share (`ceil(N / num_replicas)`); with the shared counter a worker's real count varies
    with its speed: `taken` is the number of samples it got in its current (or last) epoch. With `drop_last` the
    shared counter drops the epoch's last chunk if it is short (every chunk a full batch); without it, the last chunk
    is shorter and nothing is padded (torch's fixed shards drop or repeat samples to even the shards out).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        batch_size: int | None = None,
        shared: bool | None = None,
    ) -> None:
        what = "collsync.torch.DistributedSampler"
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"{what}: batch_size={batch_size!r} must be a whole number >= 1")
        if shared is None:
            st = _world._STATE
            shared = st is not None and uses_counter(st.servers, st.sync.policy if st.sync is not None else None)
        st = _world._STATE
        world_shards = st is not None and (num_replicas, rank) in (
            (None, None),
            (st.comm.Get_size(), st.comm.Get_rank()),
        )
        if shared or num_replicas is None or rank is None:
            comm = _world.state(f"{what} (without num_replicas and rank, or with shared=True)").comm
            if shared and (num_replicas, rank) not in ((None, None), (comm.Get_size(), comm.Get_rank())):
                raise ValueError(
                    f"{what}: shared=True spans collsync's {comm.Get_size()} workers; num_replicas={num_replicas}, "
                    f"rank={rank} must be size()={comm.Get_size()}, rank()={comm.Get_rank()} (or left out)"
                )
            num_replicas = comm.Get_size() if num_replicas is None else num_replicas
            rank = comm.Get_rank() if rank is None else rank
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        # Only a known batch lets the sampler skip whole batches for serverless backup (module docstring).
        self.skips = batch_size is not None and not shared
        self.batch_size = 1 if batch_size is None else batch_size
        self.shared = bool(shared)
        self.taken = 0
        self._resume: tuple[int, int] | None = None  # (epoch, position) from load_state_dict, for that epoch only
        self._pass = (0, 0, 0)  # the current pass: (first ticket, chunks, start position)
        self._base = 0  # the first ticket of the next pass
        self._held: int | None = None  # a ticket drawn past the last pass's end: the next pass's
        self._started = False
        self._position = 0  # fixed shards: samples of this worker's shard handed out this epoch
        self._live: object | None = None  # fixed shards: the iteration under way (its token), None between epochs
        self._first = self._end = 0  # fixed shards: the epoch's first position and its shard's length
        self._skip = 0  # fixed shards: batches to skip at the next batch boundary (`skip`)
        self.skipped = 0  # fixed shards: batches skipped in the current (or last) epoch
        self.follows = batch_size is not None and not shared  # hands out serverless backup's ledger, where one is
        self._epochs: dict[int, list[int]] = {}  # the ledger's epochs (counted from 0) -> their padded permutation
        self._ledger_epoch = -1  # the ledger's epoch under way
        self._per = 1  # the ledger's chunks an epoch
        self.counter: SharedCounter | None = None
        if self.shared:
            st = _world.state(what)
            self.counter = SharedCounter(st.comm)  # collective over the workers
            st.cleanups.append(self.close)
        if self.skips:
            _SKIPPERS.add(self)
        if world_shards and not self.shared:
            _WORLD_FOLLOWERS.add(self)
        self._shard: list[int] = []

    def close(self) -> None:
        """Free the counter's window (collective over the workers; `shutdown()` does it for samplers still open)."""
        if self.counter is None:
            return
        st = _world._STATE
        if st is not None and self.close in st.cleanups:
            st.cleanups.remove(self.close)
        self.counter.free()
        self.counter = None

    def _start(self) -> int:
        """The position this epoch starts at: a resumed one's, else 0."""
        self._started = True
        resume, self._resume = self._resume, None
        return resume[1] if resume is not None and resume[0] == self.epoch else 0

    def __iter__(self) -> Iterator[int]:
        if self.counter is not None:
            return self._shared(self.counter)
        if self.shared:
            raise ValueError("collsync.torch.DistributedSampler: this sampler is closed (its counter freed)")
        followed = _followed() if self.follows else None
        return self._fixed() if followed is None else self._reassigned(*followed)

    def _fixed(self) -> Iterator[int]:
        """torch's shard of this worker, from the resumed position if there is one, less the batches `skip` asks to
        skip (each at a batch boundary)."""
        start = self._start()
        indices = list(super().__iter__())
        token = object()
        self._live, self._first, self._end, self._skip, self.skipped = token, start, len(indices), 0, 0
        self._position, self._shard = start, indices
        try:
            while self._position < len(self._shard):  # `reshard` may replace the shard under way
                if self._skip and (self._position - self._first) % self.batch_size == 0:
                    self._position += self._skip * self.batch_size  # `skippable` bounds it by the shard's end
                    self.skipped, self._skip = self.skipped + self._skip, 0
                    continue
                self._position += 1
                yield self._shard[self._position - 1]
        finally:
            if self._live is token:  # not a later epoch's iteration, begun before this one was dropped
                self._live = None

    def _reassigned(self, rounds: BackupRounds, ledger: Ledger) -> Iterator[int]:
        """Serverless backup: the chunk the ledger hands this worker for each round, until a round belongs to the
        next epoch (its newest chunk does). A DataLoader asking for a batch before the last one's round was taken
        fetches ahead: torch's shard from its second batch on, where nothing was reassigned yet (else an error)."""
        size, n = self.batch_size, self.num_replicas
        per = n * (self.num_samples // size)  # chunks an epoch: the full batches of every shard
        if per == 0:
            raise ValueError(
                f"collsync.torch.DistributedSampler: batch_size={size} is more than a worker's {self.num_samples} "
                "samples an epoch"
            )
        self._ledger_epoch = mine = self._ledger_epoch + 1
        self._epochs = {e: order for e, order in self._epochs.items() if e == mine - 1}
        self._epochs[mine] = self._padded()
        token, last = object(), -1
        self._live, self._per = token, per
        try:
            while max(ledger.assigned) // per <= mine:
                if ledger.round == last:
                    if ledger.round:
                        raise RuntimeError(
                            "collsync.torch.DistributedSampler: the DataLoader fetched a batch before the last "
                            "one's round was taken, while serverless backup hands out batches round by round: use "
                            "num_workers=0 from the first epoch on"
                        )
                    self.follows, self._resume = False, (self.epoch, size)  # torch's shard from its second batch
                    yield from self._fixed()
                    return
                last = ledger.round
                epoch, k = divmod(ledger.assigned[self.rank], per)
                first = (k // n) * size * n + k % n  # batch k // n of shard k % n: every n-th position from there
                yield from self._epochs[epoch][first : first + size * n : n]
        finally:
            if self._live is token:
                self._live = None

    def ends_epoch(self) -> bool:
        """Whether the ledger's next round belongs to the next epoch (a late worker's catch-up stops there)."""
        followed = _followed()
        return followed is None or max(followed[1].assigned) // self._per > self._ledger_epoch

    def _padded(self) -> list[int]:
        """The epoch's permutation padded or cut as torch's sampler does (shard r is [r::num_replicas])."""
        indices = self._order()
        if self.drop_last:
            return indices[: self.total_size]
        pad = self.total_size - len(indices)
        return indices + (indices * math.ceil(pad / len(indices)))[:pad]

    def reshard(self, size: int, rank: int) -> None:
        """Go on in a world of `size` workers as its worker `rank` (the world shrank in place after a worker died):
        torch's shard sizes for the next epochs, and, within an epoch under way, the samples no worker has been
        handed yet dealt out afresh (`rank::size` of the epoch's order after the n x position handed out by the n
        workers, each as far as this one in a full-sync mode; evened out as torch does, padded or cut with
        `drop_last`), from the next sample on."""
        was, self.num_replicas, self.rank = self.num_replicas, size, rank
        n = len(self.dataset)  # type: ignore[arg-type]
        self.num_samples = math.ceil((n - size) / size) if self.drop_last and n % size else math.ceil(n / size)
        self.total_size = self.num_samples * size
        if self._live is None:
            return
        left = self._order()[min(n, self._position * was) :]
        per = len(left) // size if self.drop_last else math.ceil(len(left) / size)
        while left and len(left) < per * size:
            left += left[: per * size - len(left)]
        self._shard = left[rank : per * size : size]
        self._position = self._first = 0
        self._end, self._skip = len(self._shard), 0

    def skippable(self) -> int:
        """Whole batches of this worker's shard not yet handed out (nor promised to `skip`) in the epoch under way:
        0 between epochs, with the shared counter, and without a `batch_size`."""
        if not self.skips or self._live is None:
            return 0
        size = self.batch_size
        boundary = self._first + -(-(self._position - self._first) // size) * size  # the next batch's first position
        return max(0, (self._end - boundary) // size - self._skip)

    def skip(self, batches: int) -> None:
        """Hand out `batches` fewer batches in this epoch, from the next batch boundary on (serverless backup: the
        rounds this worker applied without computing for them). At most `skippable()`."""
        if not 0 <= batches <= self.skippable():
            raise ValueError(
                f"collsync.torch.DistributedSampler.skip: {batches} batches, but {self.skippable()} can be skipped"
            )
        self._skip += batches

    def _order(self) -> list[int]:
        """The epoch's permutation, as torch's sampler makes it (before it pads or cuts the shards)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _shared(self, counter: SharedCounter) -> Iterator[int]:
        """This worker's chunks of the epoch, one take each, taken only once the previous chunk was handed out."""
        start, order, size = self._start(), self._order(), self.batch_size
        left = max(0, len(order) - start)
        chunks = left // size if self.drop_last else math.ceil(left / size)
        base = self._base
        self._pass, self._base, self.taken = (base, chunks, start), base + chunks, 0
        while True:
            ticket = self._held if self._held is not None else counter.take()
            self._held = None
            if ticket >= base + chunks:  # the epoch is all handed out: this ticket is the next epoch's
                self._held = ticket
                return
            lo = start + (ticket - base) * size
            chunk = order[lo : min(lo + size, len(order))]
            self.taken += len(chunk)
            yield from chunk

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the position in it: with the shared counter, the samples of the epoch handed out to all
        workers (one atomic read of the counter); with fixed shards, those of this worker's shard (the same on every
        worker, which all take the same steps). Positions count what the iterator handed out: a DataLoader with
        workers fetches a few batches ahead of training."""
        if self.shared and self.counter is not None and self._started:
            base, chunks, start = self._pass
            handed = min(max(self.counter.load() - base, 0), chunks)
            position = min(start + handed * self.batch_size, len(self.dataset))  # type: ignore[arg-type]
        elif self._resume is not None:
            position = self._resume[1] if self._resume[0] == self.epoch else 0
        else:
            position = self._position if not self.shared else 0
        return {"epoch": self.epoch, "position": position, "shared": self.shared, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from `state_dict()`'s epoch and position: the next epoch iterated with that epoch number (after
        `set_epoch`) starts there; another epoch starts at 0. With the shared counter, call it on every worker
        before the first epoch (the counter of a new run starts at 0)."""
        what = "collsync.torch.DistributedSampler.load_state_dict"
        epoch, position = state.get("epoch"), state.get("position")
        if not isinstance(epoch, int) or not isinstance(position, int) or position < 0:
            raise ValueError(f"{what}: state needs whole numbers epoch and position >= 0, got {state!r}")
        if bool(state.get("shared", self.shared)) != self.shared:
            raise ValueError(
                f"{what}: saved with shared={state.get('shared')}, this sampler has shared={self.shared}: the "
                "positions count different things (the epoch's samples handed out, or this worker's shard)"
            )
        if self.shared and self._started:
            raise ValueError(f"{what}: the shared counter has handed out chunks already; load before the first epoch")
        self.set_epoch(epoch)
        self._resume = (epoch, position)
