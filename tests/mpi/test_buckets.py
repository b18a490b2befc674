"""The one bucketed reducer (`runtime.mpi_buckets.BucketReducer`) behind both fronts, and the Ibarrier shutdown, at
any world size: as `collsync-train` builds it (on a `FlatModel`, the mean in place when backward returns) and as
`collsync.torch`'s `DistributedOptimizer(sync="bsp")` builds it (on the user's parameters, Horovod's scaling,
`backward_passes_per_step`, join), and the two fronts against each other.

Exactness: the model below has small-integer weights and inputs, so every gradient and every sum over ranks is an
integer held exactly in float64; a reduction must then equal, bit for bit, a plain Allreduce of the same per-rank
flat gradient, scaled as that front scales it. A power-of-two learning rate keeps the optimizer's steps exact too.
"""

from __future__ import annotations

import time

import pytest
import torch
from mpi4py import MPI
from torch import nn

import collsync.torch as hvd
from collsync.data import Batches, synthetic
from collsync.flat import FlatModel
from collsync.loops import Gradients, run_allreduce
from collsync.models import mlp
from collsync.policy import bsp
from collsync.rules import momentum
from collsync.runtime.mpi_buckets import DEFAULT_BUCKET_BYTES, BucketReducer
from collsync.runtime.mpi_coll import MpiCollective, ShutdownTimeout, shutdown
from collsync.server import Server
from collsync.torch import _mode
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


def _loss(model: nn.Module, rank: int, step: int, use_spare: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(-2, 3, (4, 3), generator=g, dtype=torch.float64)
    return (model(x, use_spare) * torch.tensor([1.0, -2.0], dtype=torch.float64)).sum()


def _local(flat: FlatModel, rank: int, step: int, use_spare: bool = False) -> None:
    flat.zero_grad()
    _loss(flat.module, rank, step, use_spare).backward()


def _summed(comm, rank: int, step: int, use_spare: bool = False) -> torch.Tensor:
    """This rank's gradient without any reducer, summed over the ranks with a plain Allreduce."""
    flat = FlatModel(Net())
    _local(flat, rank, step, use_spare)
    total = flat.grads.clone()
    comm.Allreduce(MPI.IN_PLACE, total.numpy(), op=MPI.SUM)
    return total


def _expected(comm, rank: int, step: int, use_spare: bool = False) -> torch.Tensor:
    """The plain Allreduce divided by the world size."""
    return _summed(comm, rank, step, use_spare).div_(comm.Get_size())


def _train_reducer(comm, flat: FlatModel, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options) -> BucketReducer:
    """The reducer as `collsync-train`'s runtime=allreduce builds it (runs/replicas.py)."""
    return BucketReducer(comm, flat.buffer, bucket_bytes, eager=True, **options)


BUCKET_SIZES = [1, 8 * 6, 8 * 30, 2**30]  # one parameter each, a few small ones, mixed, all in one


# -- collsync-train's front ------------------------------------------------------------------------------------------
def test_buckets_are_contiguous_slices_last_layer_first(comm):
    flat = FlatModel(Net())
    for bucket_bytes in BUCKET_SIZES:
        reducer = _train_reducer(comm, flat, bucket_bytes)
        stops = [z for _, z in reducer.slices]
        assert stops[0] == flat.numel and reducer.slices[-1][0] == 0
        assert all(reducer.slices[b][0] == reducer.slices[b + 1][1] for b in range(len(reducer.slices) - 1))
        reducer.remove()
    assert len(_train_reducer(comm, flat, 1).buckets) == len(flat.layers)
    assert len(_train_reducer(comm, flat, 2**30).buckets) == 1
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        _train_reducer(comm, flat, 0)


@pytest.mark.parametrize("bucket_bytes", BUCKET_SIZES)
def test_bucketed_mean_equals_a_plain_allreduce(comm, bucket_bytes):
    rank = comm.Get_rank()
    flat = FlatModel(Net())
    reducer = _train_reducer(comm, flat, bucket_bytes)
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
    reducer = _train_reducer(comm, flat, 1, poll=poll)
    for step, use_spare in [(0, False), (1, rank % 2 == 0), (2, True)]:
        _local(flat, rank, step, use_spare)
        assert torch.equal(reducer.wait(), _expected(comm, rank, step, use_spare))
    reducer.remove()


def test_a_rank_whose_backward_reaches_no_parameter_joins_through_averaged(comm):
    rank = comm.Get_rank()
    flat = FlatModel(Net())
    reducer = _train_reducer(comm, flat, 8 * 30)

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
    _train_reducer(comm, flat).remove()
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
    reducer = _train_reducer(comm, flat, 64)
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


# -- collsync.torch's front ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(_mode, "BUCKET_BYTES", 1)  # one parameter per bucket: every boundary, flag and start order


def _by_hand(steps: int, passes: int, spare: list[bool], sum_op: bool) -> list[torch.Tensor]:
    """The same training with one fused reduction after backward, by hand: the gradients summed with one Allreduce
    and divided, then the same optimizer."""
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
def test_overlapped_steps_equal_one_reduction_by_hand(api, small_buckets, passes, set_to_none, sum_op):
    """Exact at world sizes that are powers of two; elsewhere the mean itself rounds, and the comparison allows
    that."""
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
    reducer = opt._collsync.reducer
    assert (reducer is not None) == (hvd.size() > 1)
    if reducer is not None:
        assert len(reducer.buckets) == len(list(model.parameters()))
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


def test_synchronize_then_clip_then_step_and_join(api, small_buckets):
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


# -- the two fronts against each other -------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket_bytes", [1, DEFAULT_BUCKET_BYTES])
def test_both_fronts_reduce_the_same_gradients_to_the_same_bits(comm, api, monkeypatch, bucket_bytes):
    """collsync.torch's bsp and collsync-train's allreduce reducer, on the same model and gradients, each with the
    same bucket size: the same sums (a parameter unused on some ranks included), scaled as each front defines its
    mean, so bit-identical wherever 1/n is a power of two. Elsewhere they differ only in the last rounding of the
    scale: collsync-train divides by n (as `MpiCollective` and the simulator do), collsync.torch multiplies by
    1/n (Horovod's postscale factor, which test_torch_launch.py matches bit for bit)."""
    monkeypatch.setattr(_mode, "BUCKET_BYTES", bucket_bytes)
    rank, n = comm.Get_rank(), comm.Get_size()
    flat = FlatModel(Net())
    reducer = _train_reducer(comm, flat, bucket_bytes)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.125), model.named_parameters())
    for step, use_spare in [(0, False), (1, rank % 2 == 0), (2, True)]:
        _local(flat, rank, step, use_spare)
        train = reducer.wait().clone()
        opt.zero_grad()
        _loss(model, rank, step, use_spare).backward()
        opt.synchronize()  # no step: both fronts stay on the same parameters
        torch_api = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        summed = _summed(comm, rank, step, use_spare)
        assert torch.equal(train, summed / n)
        assert torch.equal(torch_api, summed * (1.0 / n))
        if n & (n - 1) == 0:
            assert torch.equal(torch_api, train)
    opt.close()
    reducer.remove()


# -- shutdown --------------------------------------------------------------------------------------------------------
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
