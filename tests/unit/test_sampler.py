"""Which modes `collsync.torch.DistributedSampler` shares an epoch in by default (`uses_counter`), and its fixed
shards without an MPI world (num_replicas and rank given, as torch's)."""

from __future__ import annotations

import pytest
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
