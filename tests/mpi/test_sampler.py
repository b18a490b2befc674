"""collsync.torch.DistributedSampler at any world size (every rank a worker, no servers): torch's fixed shards bit for
bit by default, and the shared counter (`shared=True`): every sample once per epoch, fast workers taking more,
resumable from `state_dict()`."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data import DistributedSampler as TorchDistributedSampler

import collsync.torch as hvd
from collsync.torch.sampler import DistributedSampler


class Indices(Dataset[int]):
    """Item i is i: what a loader hands out shows which samples a worker got."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def gathered(values: list[int]) -> list[list[int]]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(values)


def permutation(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_default_without_servers_is_torchs_sampler(shuffle, drop_last):
    data = Indices(23)
    ours = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=shuffle, drop_last=drop_last)
    theirs = TorchDistributedSampler(data, hvd.size(), hvd.rank(), shuffle=shuffle, seed=0, drop_last=drop_last)
    assert not ours.shared and ours.counter is None
    assert isinstance(ours, TorchDistributedSampler) and len(ours) == len(theirs)
    for epoch in range(3):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)
    assert list(DistributedSampler(data, seed=5)) == list(TorchDistributedSampler(data, hvd.size(), hvd.rank(), seed=5))


def test_fixed_shards_resume_at_their_position():
    data = Indices(40)
    first = DistributedSampler(data, seed=1)
    first.set_epoch(2)
    head = list(itertools.islice(iter(first), 3))
    state = first.state_dict()
    assert state["epoch"] == 2 and state["position"] == 3 and not state["shared"]
    again = DistributedSampler(data, seed=1)
    again.load_state_dict(state)
    again.set_epoch(2)
    whole = TorchDistributedSampler(data, hvd.size(), hvd.rank(), seed=1)
    whole.set_epoch(2)
    assert head + list(again) == list(whole)
    again.set_epoch(3)  # the resumed position was for epoch 2 only
    whole.set_epoch(3)
    assert list(again) == list(whole)


@pytest.mark.parametrize("drop_last", [False, True])
def test_shared_counter_hands_out_every_sample_once_per_epoch(drop_last):
    n, size = 50, 4  # 12 full chunks and one of 2
    sampler = DistributedSampler(Indices(n), seed=3, drop_last=drop_last, batch_size=size, shared=True)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        mine = list(sampler)
        assert sampler.taken == len(mine)
        everyone = gathered(mine)
        order = permutation(n, 3, epoch)
        expected = order[: n // size * size] if drop_last else order
        assert sorted(i for part in everyone for i in part) == sorted(expected)
        for part in everyone:  # each worker's samples are whole chunks of the epoch's permutation
            for k in range(0, len(part), size):
                chunk = part[k : k + size]
                at = order.index(chunk[0])
                assert at % size == 0 and order[at : at + len(chunk)] == chunk
    sampler.close()


def test_loader_batches_are_the_counters_chunks():
    n, size = 30, 4
    sampler = DistributedSampler(Indices(n), batch_size=size, shared=True)
    batches = [b.tolist() for b in DataLoader(Indices(n), batch_size=size, sampler=sampler)]
    order = permutation(n, 0, 0)
    chunks = [order[k : k + size] for k in range(0, n, size)]
    everyone = [b for part in gathered(batches) for b in part]
    assert sorted(everyone) == sorted(chunks)
    sampler.close()


def test_shared_counter_resumes_from_a_checkpoint():
    n, size = 64, 2
    first = DistributedSampler(Indices(n), seed=7, batch_size=size, shared=True)
    first.set_epoch(4)
    head = list(itertools.islice(iter(first), 2 * size))  # two chunks each, then a checkpoint
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    state = MPI.COMM_WORLD.bcast(first.state_dict() if hvd.rank() == 0 else None, root=0)
    assert state == {"epoch": 4, "position": 2 * size * hvd.size(), "shared": True, "batch_size": size}
    first.close()
    again = DistributedSampler(Indices(n), seed=7, batch_size=size, shared=True)
    again.load_state_dict(state)
    again.set_epoch(4)
    tail = list(again)
    assert sorted(i for part in gathered(head + tail) for i in part) == list(range(n))
    with pytest.raises(ValueError, match="load before the first epoch"):
        again.load_state_dict(state)
    again.close()


def test_a_slow_worker_takes_fewer_batches_and_the_epoch_ends_sooner():
    """One worker 3x slower: it takes about a third of a fast worker's chunks, every sample still exactly once, and
    the epoch takes about the total throughput's time, not the slow worker's on a fixed shard."""
    if hvd.size() < 2:
        pytest.skip("needs 2 or more workers (a slow one and a fast one)")
    n, size, pause = 240, 2, 0.01
    slow = hvd.size() - 1  # not worker 0, which hosts the counter (a host asleep in Python delays takes off-node)
    sampler = DistributedSampler(Indices(n), batch_size=size, shared=True)
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    began = time.perf_counter()
    mine = []
    for i in sampler:
        mine.append(i)
        if len(mine) % size == 0:
            time.sleep(pause * (3 if hvd.rank() == slow else 1))  # the batch's "step"
    took = time.perf_counter() - began
    everyone, times = gathered(mine), gathered([took])
    assert sorted(i for part in everyone for i in part) == list(range(n))
    chunks = [len(part) // size for part in everyone]
    fast = min(c for r, c in enumerate(chunks) if r != slow)
    assert chunks[slow] <= 0.6 * fast, chunks
    fixed = math.ceil(n / size / hvd.size()) * 3 * pause  # the slow worker's fixed shard alone
    epoch = max(t[0] for t in times)
    assert epoch < 0.85 * fixed, (epoch, fixed, chunks)
    sampler.close()


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="batch_size=0"):
        DistributedSampler(Indices(4), batch_size=0)
    with pytest.raises(ValueError, match="shared=True spans"):
        DistributedSampler(Indices(4), num_replicas=hvd.size() + 1, rank=0, shared=True)
    fixed = DistributedSampler(Indices(4))
    with pytest.raises(ValueError, match="positions count different things"):
        fixed.load_state_dict({"epoch": 0, "position": 0, "shared": True})
    with pytest.raises(ValueError, match="epoch and position"):
        fixed.load_state_dict({"epoch": "one", "position": 0})
