"""collsync.torch's bsp reduction overlapped with backward (`optimizer._Overlap`), at any world size.

Buckets of one parameter each (`BUCKET_BYTES = 1`), so that every bucket boundary, the join flag in the first bucket
and the order of starts are exercised; each case is compared with the same training done by one fused reduction
after backward, by hand (the gradients
summed with one Allreduce and divided, then the same optimizer). Small-integer data and a power-of-two learning rate
keep the sums exact, so the comparison is bit for bit whatever the grouping (at world sizes that are powers of
two; elsewhere the mean itself rounds, and the comparison allows that).
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import collsync.torch as hvd
from collsync.torch.optimizer import _Overlap


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    monkeypatch.setattr(_Overlap, "BUCKET_BYTES", 1)


class Net(nn.Module):
    """Integer weights; `spare` is used only when asked (a parameter with no gradient on some ranks)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = nn.Linear(3, 4, dtype=torch.float64)
        self.spare = nn.Linear(4, 4, dtype=torch.float64)
        self.b = nn.Linear(4, 2, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor, use_spare: bool) -> torch.Tensor:
        h = self.a(x)
        return self.b(self.spare(h) if use_spare else h)


def _loss(model: Net, rank: int, step: int, use_spare: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(-2, 3, (2, 3), generator=g, dtype=torch.float64)
    return (model(x, use_spare) * torch.tensor([1.0, -1.0], dtype=torch.float64)).sum()


def _by_hand(steps: int, passes: int, spare: list[bool], sum_op: bool) -> list[torch.Tensor]:
    comm, rank = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.5)
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            _loss(model, rank, step * passes + k, spare[step]).backward()
        flat = torch.cat(
            [torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1) for p in model.parameters()]
        )
        comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
        if not sum_op:
            flat.div_(comm.Get_size())
        offset = 0
        for p in model.parameters():
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("passes", "set_to_none", "sum_op"), [(1, True, False), (2, True, False), (1, False, False), (1, True, True)]
)
def test_overlapped_steps_equal_one_reduction_by_hand(passes, set_to_none, sum_op):
    rank = hvd.rank()
    # Step 0 uses `spare` nowhere, step 1 on even ranks only (ranks finish parameters in different orders), step 2
    # everywhere.
    spare = [False, rank % 2 == 0, True]
    model = Net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.5),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        op=hvd.Sum if sum_op else hvd.Average,
    )
    overlap = opt._collsync.overlap
    assert (overlap is not None) == (hvd.size() > 1)
    if overlap is not None:
        assert len(overlap.buckets) == len(list(model.parameters()))
    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        for k in range(passes):
            _loss(model, rank, step * passes + k, spare[step]).backward()
        opt.step()
    ours = [p.detach().clone() for p in model.parameters()]
    opt.close()
    expected = _by_hand(3, passes, spare, sum_op)
    exact = hvd.size() & (hvd.size() - 1) == 0
    for a, b in zip(ours, expected, strict=True):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    gathered = hvd.allgather_object(ours)
    assert all(torch.equal(a, b) for other in gathered for a, b in zip(other, ours, strict=True))


def test_synchronize_then_clip_then_step_and_join():
    """Horovod's pattern: synchronize(), look at the mean (clip), step under skip_synchronize(); then join with
    ranks that took different numbers of steps."""
    rank = hvd.rank()
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.125), model.named_parameters())
    for step in range(rank + 1):  # rank r takes r + 1 steps
        opt.zero_grad()
        _loss(model, rank, step, True).backward()
        opt.synchronize()
        if step == 0:  # every rank takes step 0: the means are the same everywhere
            grads = [p.grad.clone() for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(hvd.allgather_object(grads)[0], grads, strict=True))
        with opt.skip_synchronize():
            opt.step()
    assert opt.join() == hvd.size() - 1
    opt.close()
