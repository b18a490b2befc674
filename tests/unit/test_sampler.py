"""Which modes `collsync.torch.DistributedSampler` shares an epoch in by default (`uses_counter`), and its fixed
shards without an MPI world (num_replicas and rank given, as torch's)."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from collsync import policy
from collsync.torch.sampler import DistributedSampler, uses_counter


@pytest.mark.parametrize(
    ("servers", "made", "shared"),
    [
        (1, policy.asynchronous(), True),
        (2, policy.bfasgd(c_push=1.0), True),
        (1, policy.specsync(base="async"), True),
        (1, policy.ssp(max_lead=3), False),
        (1, policy.specsync(base="ssp"), False),
        (1, policy.psp(pushes=2), False),
        (1, policy.backup(backups=1), False),
        (1, policy.bsp(), False),
        (0, policy.bsp(), False),
        (0, policy.backup(backups=1), False),
        (0, policy.asynchronous(), False),
        (1, None, False),
    ],
)
def test_only_stream_modes_on_servers_share_the_epoch(servers, made, shared):
    assert uses_counter(servers, made) is shared


def test_without_a_world_it_is_torchs_sampler_given_replicas_and_rank():
    data = list(range(11))
    for rank in range(3):
        ours = DistributedSampler(data, num_replicas=3, rank=rank, seed=2)
        theirs = TorchDistributedSampler(data, num_replicas=3, rank=rank, seed=2)
        ours.set_epoch(1)
        theirs.set_epoch(1)
        assert not ours.shared and list(ours) == list(theirs) and len(ours) == len(theirs)
    with pytest.raises(ValueError, match="not initialised"):
        DistributedSampler(data)
    with pytest.raises(ValueError, match="not initialised"):
        DistributedSampler(data, num_replicas=3, rank=0, shared=True)


def test_fixed_shards_skip_whole_batches_from_the_next_boundary():
    """`skip(k)` (serverless backup's catch-up) drops the next k whole batches of the shard, counted in `skipped` and
    in the resume position; `skippable()` offers only whole batches not yet handed out, and none between epochs."""
    data = list(range(40))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False, batch_size=4)  # 20: 5 batches
    assert sampler.skippable() == 0  # no epoch under way
    batches = iter(DataLoader(data, batch_size=4, sampler=sampler))
    first = next(batches).tolist()
    assert sampler.skippable() == 4
    sampler.skip(2)
    assert sampler.skippable() == 2
    with pytest.raises(ValueError, match="3 batches, but 2 can be skipped"):
        sampler.skip(3)
    rest = [b.tolist() for b in batches]
    shard = list(range(0, 40, 2))
    assert [first, *rest] == [shard[0:4], shard[12:16], shard[16:20]]
    assert sampler.skipped == 2 and sampler.state_dict()["position"] == 20
    assert sampler.skippable() == 0  # the epoch is over
    sampler.set_epoch(1)
    assert len(list(sampler)) == 20 and sampler.skipped == 0  # the next epoch is whole again


def test_a_sampler_without_batch_size_never_skips():
    """Without `batch_size` the sampler cannot know a batch's length, so it offers nothing to skip."""
    sampler = DistributedSampler(list(range(16)), num_replicas=2, rank=1, shuffle=False)
    it = iter(sampler)
    next(it)
    assert sampler.skippable() == 0
    with pytest.raises(ValueError, match="0 can be skipped"):
        sampler.skip(1)
