"""A resumed worker's sends with several shards (`ShardedMailbox.resume`): block j of its k-th gradient goes to
shard j only if that shard had fewer than k + 1 of its gradients at the checkpoint; no MPI needed (fake shards)."""

from __future__ import annotations

import pytest
import torch

from collsync.runtime.mpi_shards import ShardedMailbox, shard_bounds
from collsync.types import Arrival


class _Shard:
    """What ShardedMailbox.send needs of a shard mailbox: the worker's index, its poll cap and a `send` (recorded)."""

    worker = 0
    poll_cap = 1e-3

    def __init__(self, calls: list[tuple[str, object]] | None = None) -> None:
        self.got: list[torch.Tensor] = []
        self.calls: list[tuple[str, object]] = [] if calls is None else calls

    def post(self, arrival: Arrival) -> None:
        assert arrival.grad is not None
        self.got.append(arrival.grad.clone())
        self.calls.append(("post", self))

    def complete(self, *, read_next: bool = False) -> None:
        self.calls.append(("complete", self))


def test_a_resumed_worker_sends_each_shard_only_the_gradients_it_lacks() -> None:
    shards = [_Shard(), _Shard(), _Shard()]
    mailbox = ShardedMailbox(shards, shard_bounds(6, 3))  # type: ignore[arg-type]
    # At the checkpoint shard 0 had 4 of this worker's gradients, shard 1 had 5, shard 2 had 6.
    assert mailbox.resume([4, 5, 6]) == 4
    for k in (4, 5, 6):
        mailbox.send(Arrival(0, 0, torch.full((6,), float(k)), k))
    assert [g[0].item() for g in shards[0].got] == [4, 5, 6]
    assert [g[0].item() for g in shards[1].got] == [5, 6]
    assert [g[0].item() for g in shards[2].got] == [6]
    assert all(g.numel() == 2 for s in shards for g in s.got)


def test_resume_counts_must_match_the_shards() -> None:
    mailbox = ShardedMailbox([_Shard(), _Shard()], shard_bounds(4, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 shards"):
        mailbox.resume([1])


def test_a_push_is_posted_to_every_shard_before_any_is_completed() -> None:
    """Issue 33, item 3: the round trips of one push to M shards overlap (each shard's Flush comes after every
    shard's Put), rather than one after the other."""
    calls: list[tuple[str, object]] = []
    shards = [_Shard(calls), _Shard(calls), _Shard(calls)]
    mailbox = ShardedMailbox(shards, shard_bounds(6, 3))  # type: ignore[arg-type]
    mailbox.send(Arrival(0, 0, torch.ones(6), 0), read_next=True)
    assert [kind for kind, _ in calls] == ["post"] * 3 + ["complete"] * 3
    assert [shard for _, shard in calls] == shards + shards
