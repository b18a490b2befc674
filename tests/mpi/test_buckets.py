"""Bucketed, overlapped gradient averaging (`BucketReducer`) and the Ibarrier shutdown, at any world size.

Exactness: the models below have small-integer weights and inputs, so every gradient and every sum over ranks is
an integer held exactly in float64; the reducer's mean must then equal, bit for bit, a plain Allreduce of the same
per-rank flat gradient divided by the world size.
"""

from __future__ import annotations

import time

import pytest
import torch
from mpi4py import MPI
from torch import nn

from collsync.data import Batches, synthetic
from collsync.flat import FlatModel
from collsync.loops import Gradients, run_allreduce
from collsync.models import mlp
from collsync.policy import bsp
from collsync.rules import momentum
from collsync.runtime.mpi_coll import BucketReducer, MpiCollective, ShutdownTimeout, shutdown
from collsync.server import Server
from collsync.trace import Trace


class Net(nn.Module):
    """Three linear layers (with a ReLU) and a layer `spare` that only some forward passes use."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.a = nn.Linear(3, 5, dtype=torch.float64)
        self.spare = nn.Linear(5, 5, dtype=torch.float64)
        self.b = nn.Linear(5, 4, dtype=torch.float64)
        self.c = nn.Linear(4, 2, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-3, 4, p.shape, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = self.a(x)
        if use_spare:
            h = self.spare(h)
        return self.c(torch.relu(self.b(h)))


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-2, 3, (4, 3), generator=g, dtype=torch.float64)


def _local(flat: FlatModel, rank: int, step: int, use_spare: bool = False) -> None:
    flat.zero_grad()
    (flat.module(_batch(rank, step), use_spare) * torch.tensor([1.0, -2.0], dtype=torch.float64)).sum().backward()


def _expected(comm, rank: int, step: int, use_spare: bool = False) -> torch.Tensor:
    """This rank's gradient without any reducer, summed with a plain Allreduce and divided by the world size."""
    flat = FlatModel(Net())
    _local(flat, rank, step, use_spare)
    total = flat.grads.clone()
    comm.Allreduce(MPI.IN_PLACE, total.numpy(), op=MPI.SUM)
    return total.div_(comm.Get_size())


BUCKET_SIZES = [1, 8 * 6, 8 * 30, 2**30]  # one parameter each, a few small ones, mixed, all in one


def test_buckets_are_contiguous_slices_last_layer_first(comm):
    flat = FlatModel(Net())
    for bucket_bytes in BUCKET_SIZES:
        reducer = BucketReducer(comm, flat, bucket_bytes)
        stops = [z for _, z in reducer.slices]
        assert stops[0] == flat.numel and reducer.slices[-1][0] == 0
        assert all(reducer.slices[b][0] == reducer.slices[b + 1][1] for b in range(len(reducer.slices) - 1))
        reducer.remove()
    assert len(BucketReducer(comm, flat, 1).buckets) == len(flat.layers)
    assert len(BucketReducer(comm, flat, 2**30).buckets) == 1
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        BucketReducer(comm, flat, 0)


@pytest.mark.parametrize("bucket_bytes", BUCKET_SIZES)
def test_bucketed_mean_equals_a_plain_allreduce(comm, bucket_bytes):
    rank = comm.Get_rank()
    flat = FlatModel(Net())
    reducer = BucketReducer(comm, flat, bucket_bytes)
    for step in range(3):  # consecutive steps: the hooks re-arm after each
        _local(flat, rank, step)
        # The mean is in place as soon as backward returns; wait() hands it over.
        assert torch.equal(flat.grads, _expected(comm, rank, step))
        assert reducer.wait() is flat.grads
    reducer.remove()


@pytest.mark.parametrize("poll", [False, True])
def test_unused_parameters_do_not_hang_the_step(comm, poll):
    """`spare` is unused on every rank at step 0 and on odd ranks only at step 1 (ranks then finish parameters in
    different orders and start different buckets from hooks): both steps still complete and are exact."""
    rank = comm.Get_rank()
    flat = FlatModel(Net())
    reducer = BucketReducer(comm, flat, 1, poll=poll)
    for step, use_spare in [(0, False), (1, rank % 2 == 0), (2, True)]:
        _local(flat, rank, step, use_spare)
        assert torch.equal(reducer.wait(), _expected(comm, rank, step, use_spare))
    reducer.remove()


def test_a_rank_whose_backward_reaches_no_parameter_joins_through_averaged(comm):
    rank = comm.Get_rank()
    flat = FlatModel(Net())
    reducer = BucketReducer(comm, flat, 8 * 30)

    def grads(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
        if worker == 0:
            flat.zero_grad()  # rank 0 contributes nothing this step and runs no backward at all
        else:
            _local(flat, worker, index)
        return flat.grads.clone()

    mean = reducer.averaged(grads)
    for step in range(2):
        got = mean(flat.params, rank, step)
        local = FlatModel(Net())
        _local(local, rank, step)
        if rank == 0:
            local.grads.zero_()
        comm.Allreduce(MPI.IN_PLACE, local.grads.numpy(), op=MPI.SUM)
        assert torch.equal(got, local.grads.div_(comm.Get_size()))
    reducer.remove()


def test_removed_hooks_leave_gradients_local(comm):
    rank = comm.Get_rank()
    flat = FlatModel(Net())
    BucketReducer(comm, flat).remove()
    _local(flat, rank, 0)
    plain = FlatModel(Net())
    _local(plain, rank, 0)
    assert torch.equal(flat.grads, plain.grads)


def _train(comm, reduced: bool, steps: int = 4) -> tuple[Server, Trace]:
    data = synthetic(samples=400, features=12, classes=3, seed=1)
    flat = FlatModel(mlp(data.input_shape, data.classes, hidden=(16, 8), seed=3))
    coll = MpiCollective(comm)
    trace = Trace(clock=lambda: 0.0)
    server = Server(flat.params, momentum(lr=0.1), bsp(), coll.size, steps=steps, trace=trace)
    grads = Gradients(flat, Batches(data, coll.size, 8, 0))
    if not reduced:
        return run_allreduce(server, coll, grads), trace
    reducer = BucketReducer(comm, flat, 64)
    run_allreduce(server, coll, reducer.averaged(grads), averaged=True)
    reducer.shutdown()
    return server, trace


def test_run_allreduce_on_buckets_matches_the_plain_allreduce_path(comm):
    plain, plain_trace = _train(comm, reduced=False)
    ours, trace = _train(comm, reduced=True)
    assert ours.version == plain.version == 4
    assert trace.events == plain_trace.events
    # Same sums in a different grouping: equal to rounding; and every replica holds the very same bits.
    assert torch.allclose(ours.params, plain.params, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p, ours.params) for p in comm.allgather(ours.params))


def test_shutdown_waits_for_the_last_rank(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    start = time.monotonic()
    time.sleep(0.05 * rank)  # ranks finish unevenly
    shutdown(comm, timeout=30.0)
    assert time.monotonic() - start >= 0.05 * (size - 1) - 0.01


def test_shutdown_timeout_names_the_rank(comm):
    if comm.Get_size() < 2:
        pytest.skip("a timeout needs another rank that is late")
    if comm.Get_rank() == 0:
        with pytest.raises(ShutdownTimeout, match=f"rank 0 of {comm.Get_size()} on .*within 0.05s") as err:
            shutdown(comm, timeout=0.05)
        err.value.request.Wait()  # the barrier stayed posted; the late ranks complete it
    else:
        time.sleep(0.5)
        shutdown(comm)
