"""`ElasticSampler`: Horovod's sampler for elastic runs, which shares out the samples of an epoch not yet processed
among the ranks of the current world.

As Horovod's: the epoch's order is `range(len(dataset))` shuffled by `random.Random(seed + epoch)` (the same order as
Horovod's, so a script gets the same batches under both), the first `processed_num` samples of it are skipped, the
rest is padded to a multiple of `size()` with its own first samples and dealt out `rank::size`. `record_batch` counts
a batch of every rank as processed; `set_epoch` starts an epoch afresh. Kept in a `TorchState`, its count is part of
each commit, so after a rank died the state restored from the last commit (in place under ULFM, or in the job
`collsync-run` relaunches on the ranks left) deals out only what that commit had not processed, among fewer ranks:
nothing committed is computed twice and nothing is skipped.

`record_indices` is the older Horovod interface (0.20-0.21): the indices themselves, joined across ranks at each
commit, are skipped as well.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch.utils.data

from collsync.torch import _world


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Deals out the samples of an epoch not yet processed among the current ranks (Horovod's `ElasticSampler`).

    Use it as Horovod says: put it in the `TorchState`, call `record_batch` after each batch, and call `set_epoch`
    at the end of an epoch (not the start), so that a resumed epoch keeps what it had processed."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.by_indices = False  # record_indices was used: the indices are joined across ranks at a commit
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: its own order, nothing processed yet. Call it at the end of an epoch (Horovod's
        advice), or the samples an interrupted epoch processed would be dealt out again."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of `batch_size` samples on every rank as processed (Horovod's `record_batch`)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """Count these dataset indices as processed (older Horovod's `record_indices`); every rank's are joined
        at the next commit."""
        self.by_indices = True
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and what of it was processed: Horovod's keys (`epoch`, `processed_num`), plus the recorded
        indices where `record_indices` was used."""
        state: dict[str, Any] = {"epoch": self.epoch, "processed_num": self.processed_num}
        if self.by_indices:
            state["processed_indices"] = sorted(self.processed_indices)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Go on from `state_dict()` in the current world (the ranks are re-read: it may have shrunk)."""
        epoch, processed = state_dict.get("epoch"), state_dict.get("processed_num")
        if not isinstance(epoch, int) or not isinstance(processed, int) or processed < 0:
            raise ValueError(
                "collsync.torch.elastic.ElasticSampler.load_state_dict: need whole numbers epoch and "
                f"processed_num >= 0, got {state_dict!r}"
            )
        self.epoch, self.processed_num = epoch, processed
        indices = state_dict.get("processed_indices")
        self.by_indices = self.by_indices or indices is not None
        self.processed_indices = set(indices or ())
        self.reset()

    def reset(self) -> None:
        """Re-read the world (`size()`, `rank()`) and deal out the epoch's samples not yet processed."""
        self.num_replicas = _world.size()
        self.rank = _world.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        left = order[self.processed_num :]
        if self.processed_indices:
            left = [i for i in left if i not in self.processed_indices]
        self.remaining_indices = left
        self.num_samples = math.ceil(len(left) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        while indices and len(indices) < self.total_size:  # pad with the epoch's own first samples, as Horovod
            indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
