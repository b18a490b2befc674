"""collsync.torch's Horovod collectives beyond allreduce, at any world size: Min/Max/Product, alltoall,
reducescatter, the grouped forms, the gradients Horovod defines for them, process sets, Horovod's exceptions and
what DistributedOptimizer and broadcast_optimizer_state do as Horovod's do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import collsync.torch as hvd


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def test_allreduce_min_max_product_in_every_dtype():
    n, r = hvd.size(), hvd.rank()
    for dtype in (torch.float64, torch.float32, torch.int32, torch.int64, torch.float16, torch.bfloat16):
        t = torch.tensor([r + 1, -(r + 1)]).to(dtype)
        assert hvd.allreduce(t, op=hvd.Min).tolist() == [1, -n]
        assert hvd.allreduce(t, op=hvd.Max).tolist() == [n, -1]
        prod = 1
        for k in range(1, n + 1):
            prod *= k
        assert hvd.allreduce(t, op=hvd.Product).tolist() == [prod, prod * (-1) ** n]
    grouped = hvd.grouped_allreduce([torch.tensor([float(r)]), torch.tensor([r])], op=hvd.Max)
    assert [g.item() for g in grouped] == [n - 1, n - 1]


def test_alltoall_sends_splits_and_returns_the_received_splits():
    n, r = hvd.size(), hvd.rank()
    # worker r sends r + 1 rows to every worker, the rows for worker k holding k
    rows = torch.cat([torch.full((r + 1, 2), float(k)) for k in range(n)])
    out, received = hvd.alltoall(rows, torch.tensor([r + 1] * n, dtype=torch.int32))
    assert received.dtype == torch.int32 and received.tolist() == [k + 1 for k in range(n)]
    assert out.shape == (n * (n + 1) // 2, 2) and bool((out == r).all())
    even = hvd.alltoall(torch.arange(n * 3.0))  # no splits: equal parts, the output alone
    assert even.tolist() == [float(r * 3 + i) for i in range(3)] * n
    handle = hvd.alltoall_async(torch.ones(n, 1), [1] * n)
    got, splits = hvd.synchronize(handle)
    assert got.shape == (n, 1) and splits.tolist() == [1] * n


def test_alltoall_equal_split_output_and_gradient():
    n, r = hvd.size(), hvd.rank()
    x = (torch.arange(n * 2, dtype=torch.float64) + 100 * r).requires_grad_()
    out = hvd.alltoall(x)
    assert out.tolist() == [float(100 * k + 2 * r + i) for k in range(n) for i in range(2)]
    (out * (r + 1)).sum().backward()  # the gradient travels back: rows sent to worker k get k + 1
    assert x.grad is not None and x.grad.tolist() == [float(k + 1) for k in range(n) for _ in range(2)]


def test_alltoall_refuses_bad_splits_with_horovods_value_errors():
    n = hvd.size()
    if n > 1:
        with pytest.raises(ValueError, match="even multiple"):
            hvd.alltoall(torch.zeros(n + 1))
    with pytest.raises(ValueError, match="greater than"):
        hvd.alltoall(torch.zeros(n - 1), torch.ones(n, dtype=torch.int32))
    with pytest.raises(ValueError, match="32-bit"):
        hvd.alltoall(torch.zeros(n), torch.ones(n, dtype=torch.float32))
    with pytest.raises(ValueError, match="number of workers"):
        hvd.alltoall(torch.zeros(n + 1), torch.ones(n + 1, dtype=torch.int32))


def test_reducescatter_sums_averages_and_splits_rows_as_horovod():
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1  # uneven: the first rows % n workers get one row more
    t = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * (r + 1)
    mine = rows // n + (1 if r < rows % n else 0)
    start = sum(rows // n + (1 if k < rows % n else 0) for k in range(r))
    full = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3)[start : start + mine]
    total = n * (n + 1) / 2
    summed = hvd.reducescatter(t, op=hvd.Sum)
    assert summed.shape == (mine, 3) and torch.equal(summed, full * total)
    assert torch.allclose(hvd.reducescatter(t), full * total / n)
    scaled = hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert torch.allclose(scaled, full * total / 2)
    ints = hvd.synchronize(hvd.reducescatter_async(torch.ones(n * 2, dtype=torch.int32), op=hvd.Sum))
    assert ints.tolist() == [n, n]
    a, b = hvd.grouped_reducescatter([t, torch.ones(n, 2)], op=hvd.Sum)
    assert torch.equal(a, summed) and b.tolist() == [[float(n)] * 2]
    a2, b2 = hvd.synchronize(hvd.grouped_reducescatter_async([t, torch.ones(n, 2)]))
    assert torch.allclose(a2, full * total / n) and b2.tolist() == [[1.0, 1.0]]


def test_reducescatter_gradient_is_horovods_and_refusals():
    n = hvd.size()
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        x = torch.ones(n * 4, 2, dtype=torch.float64, requires_grad=True)
        hvd.reducescatter(x, op=op).backward(torch.ones(4, 2, dtype=torch.float64))
        assert x.grad is not None and bool((x.grad == factor).all())
    with pytest.raises((ValueError, RuntimeError)):
        hvd.reducescatter(torch.tensor(1.0))
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.reducescatter(torch.ones(n), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="Average and Sum"):
        hvd.reducescatter(torch.ones(n), op=hvd.Min)


def test_mismatched_tensors_raise_horovods_internal_error_on_every_worker():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two workers")
    r = hvd.rank()
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    with pytest.raises(hvd.HorovodInternalError):
        hvd.reducescatter(torch.ones(4, 2 + r))
    with pytest.raises(hvd.HorovodInternalError):
        hvd.alltoall(torch.ones(hvd.size(), dtype=torch.float32 if r else torch.float64))
    with pytest.raises(hvd.HorovodInternalError):
        hvd.allgather(torch.ones(2, 1 + r))
    with pytest.raises(hvd.HorovodInternalError):
        hvd.broadcast(torch.ones(2), root_rank=r)


def test_mismatched_allreduces_raise_on_every_worker_naming_ranks_and_what_they_sent():
    """Horovod's coordinator refuses an allreduce whose shape, type, op or scale factors differ between ranks;
    here every worker raises HorovodInternalError naming what each rank sent, and the in-place tensor is left as
    it was (no data moved). Afterwards the workers are still in step."""
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two workers")
    n, r = hvd.size(), hvd.rank()
    last = n - 1
    odd = r == last  # the last worker differs from the others
    with pytest.raises(
        hvd.HorovodInternalError, match=rf"allreduce: mismatched tensor shape .*rank {last} sent \[3, 2\]"
    ):
        hvd.allreduce(torch.ones((3, 2) if odd else (2, 3)))
    with pytest.raises(hvd.HorovodInternalError, match=rf"mismatched tensor type .*rank {last} sent 'float64'"):
        hvd.allreduce(torch.ones(4, dtype=torch.float64 if odd else torch.float32))
    with pytest.raises(hvd.HorovodInternalError, match="mismatched tensor type .*'int32'"):
        hvd.allreduce(torch.ones(4, dtype=torch.int32 if odd else torch.float32))
    with pytest.raises(hvd.HorovodInternalError, match="mismatched tensor op .*'Sum'"):
        hvd.allreduce(torch.ones(2), op=hvd.Sum if odd else hvd.Average)
    with pytest.raises(hvd.HorovodInternalError, match="mismatched tensor prescale factor"):
        hvd.allreduce(torch.ones(2), prescale_factor=2.0 if odd else 1.0)
    mine = torch.full((2 + int(odd),), float(r))
    with pytest.raises(hvd.HorovodInternalError, match="allreduce_: mismatched tensor shape"):
        hvd.allreduce_(mine)
    assert mine.tolist() == [float(r)] * (2 + int(odd))  # untouched
    handle = hvd.allreduce_async(torch.ones(5 + int(odd)))  # returns at once; the error comes at synchronize
    with pytest.raises(hvd.HorovodInternalError, match="allreduce_async: mismatched tensor shape"):
        hvd.synchronize(handle)
    with pytest.raises(hvd.HorovodInternalError, match=r"grouped_allreduce: mismatched tensor shapes"):
        hvd.grouped_allreduce([torch.ones(3), torch.ones(2 + int(odd))])
    with pytest.raises(hvd.HorovodInternalError, match="number of tensors"):
        hvd.grouped_allreduce([torch.ones(3)] * (2 + int(odd)))
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [float(n)] * 3  # still in step
    assert hvd.synchronize(hvd.allreduce_async(torch.full((2,), float(r)), op=hvd.Sum)).tolist() == [n * last / 2] * 2


def test_join_without_an_optimizer_contributes_zeros_until_every_worker_joined():
    """Horovod's join: a worker out of data contributes zeros to the others' allreduces (sync, async, grouped, in
    any dtype) until all joined, their allgathers and broadcasts meanwhile raise, and join returns the same rank,
    the last to join, on every worker."""
    n, r = hvd.size(), hvd.rank()
    for first in range(n):
        a, b = torch.full((5,), 10.0), torch.full((3, 2), 4, dtype=torch.int32)
        hvd.synchronize(hvd.allreduce_async(a))  # a cached operation first, as Horovod's test does
        if r == first:
            ret = hvd.join()
        else:
            ha, hb = hvd.allreduce_async(a), hvd.allreduce_async(b)  # both in flight as the joined worker answers
            summed = hvd.allreduce(torch.ones(2), op=hvd.Sum)
            grouped = hvd.grouped_allreduce([torch.ones(1), torch.ones(2, dtype=torch.float64)], op=hvd.Sum)
            assert torch.allclose(hvd.synchronize(ha), torch.full((5,), 10.0 * (n - 1) / n))
            assert hvd.synchronize(hb).tolist() == [[4 * (n - 1) // n] * 2] * 3
            assert summed.tolist() == [n - 1.0] * 2 and [g.sum().item() for g in grouped] == [n - 1, 2 * (n - 1)]
            with pytest.raises(hvd.HorovodInternalError, match="allgather: not supported while a worker has joined"):
                hvd.allgather(torch.ones(2))
            with pytest.raises(hvd.HorovodInternalError, match="broadcast: not supported while a worker has joined"):
                hvd.broadcast(torch.ones(2), root_rank=0)
            ret = hvd.join()
        assert hvd.allgather_object(ret) == [ret] * n
        assert n == 1 or ret != first
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n  # every worker is back


def test_a_second_operation_in_flight_under_one_name_is_refused_as_in_horovod():
    """Horovod refuses an operation named as one of its kind still in flight (ValueError) before it moves anything
    (an allreduce in place or not is one kind: Horovod's tensor name is `allreduce.<name>` for both); the name is
    free again once the first is synchronized."""
    n = hvd.size()
    for start, again in (
        (
            lambda: hvd.allreduce_async(torch.ones(2), name="twice"),
            lambda: hvd.allreduce_async_(torch.ones(3), name="twice"),
        ),
        (
            lambda: hvd.allreduce_async_(torch.ones(2), name="twice"),
            lambda: hvd.allreduce_async(torch.ones(3), name="twice"),
        ),
        (
            lambda: hvd.allgather_async(torch.ones(2), name="twice"),
            lambda: hvd.allgather_async(torch.ones(3), name="twice"),
        ),
        (
            lambda: hvd.broadcast_async(torch.ones(2), 0, name="twice"),
            lambda: hvd.broadcast_async_(torch.ones(3), 0, name="twice"),
        ),
    ):
        first = start()
        with pytest.raises(ValueError, match="same name as another tensor .*name='twice'"):
            again()
        hvd.synchronize(first)
    handle = hvd.allreduce_async(torch.ones(2), name="twice", op=hvd.Sum)  # free again
    assert hvd.synchronize(handle).tolist() == [float(n)] * 2


def test_distributed_optimizer_names_its_parameters_as_horovod():
    """Horovod's `_parameter_names` (read by scripts and Horovod's tests): from named_parameters, else
    `allreduce.noname.{group}.{index}`, the same on every worker."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = opt._parameter_names
    assert sorted(names.values()) == [
        "allreduce.noname.0.0",
        "allreduce.noname.0.1",
        "allreduce.noname.1.0",
        "allreduce.noname.1.1",
    ]
    assert hvd.allgather_object(sorted(names.values())) == [sorted(names.values())] * hvd.size()
    named = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    assert sorted(named._parameter_names.values()) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert named._parameter_names[model[0].weight] == "0.weight"


def test_grouped_allgather_and_the_gradients_of_allgather_and_broadcast():
    n, r = hvd.size(), hvd.rank()
    a, b = hvd.grouped_allgather([torch.full((r + 1, 2), float(r)), torch.tensor([r])])
    assert a.shape == (n * (n + 1) // 2, 2) and b.tolist() == list(range(n))
    a2, b2 = hvd.synchronize(hvd.grouped_allgather_async([torch.full((r + 1, 2), float(r)), torch.tensor([r])]))
    assert torch.equal(a, a2) and torch.equal(b, b2)
    x = torch.ones(r + 1, dtype=torch.float64, requires_grad=True)
    gathered = hvd.allgather(x)
    weights = torch.arange(gathered.shape[0], dtype=torch.float64)
    (gathered * weights).sum().backward()  # every worker's same weights: the average is the weights themselves
    start = r * (r + 1) // 2
    assert x.grad is not None and x.grad.tolist() == weights[start : start + r + 1].tolist()
    y = torch.full((3,), float(r), requires_grad=True)
    out = hvd.broadcast(y, root_rank=0)
    assert out.tolist() == [0.0] * 3 and out.grad_fn is not None
    (out * 2).sum().backward()  # the root gets the average of the workers' gradients, the others zero
    assert y.grad is not None and y.grad.tolist() == ([2.0] * 3 if r == 0 else [0.0] * 3)
    s = torch.ones(2, requires_grad=True)
    outs = hvd.grouped_allreduce([s * 1, s * 2], op=hvd.Sum)
    assert outs[0].grad_fn is not None
    (outs[0] + outs[1]).sum().backward()
    assert s.grad is not None and s.grad.tolist() == [3.0 * n] * 2


def test_process_sets_run_each_collective_on_their_workers():
    n, r = hvd.size(), hvd.rank()
    assert hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.ranks == list(range(n))
    assert hvd.global_process_set.size() == n and hvd.global_process_set.rank() == r
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(list(range(n)))
    if n == 1:
        return
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    even_set = hvd.add_process_set(evens)
    odd_set = hvd.add_process_set(hvd.ProcessSet(odds))
    assert even_set.process_set_id != odd_set.process_set_id and 0 not in (even_set.process_set_id,)
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(list(reversed(evens)))
    mine, other = (even_set, odd_set) if r % 2 == 0 else (odd_set, even_set)
    ranks = evens if r % 2 == 0 else odds
    assert mine.included() and not other.included() and other.rank() == -1
    assert mine.size() == len(ranks) and mine.rank() == ranks.index(r)
    t = torch.tensor([float(r)])
    assert hvd.allreduce(t, op=hvd.Sum, process_set=mine).item() == sum(ranks)
    assert hvd.allreduce(t, process_set=mine).item() == sum(ranks) / len(ranks)
    assert hvd.allgather(t, process_set=mine).tolist() == [float(k) for k in ranks]
    assert hvd.broadcast(t, root_rank=ranks[-1], process_set=mine).item() == ranks[-1]
    assert hvd.broadcast_object(r, root_rank=ranks[0], process_set=mine) == ranks[0]
    assert hvd.allgather_object(r, process_set=mine) == ranks
    got, received = hvd.alltoall(torch.full((len(ranks),), float(r)), [1] * len(ranks), process_set=mine)
    assert got.tolist() == [float(k) for k in ranks] and received.tolist() == [1] * len(ranks)
    part = hvd.reducescatter(torch.ones(len(ranks), 2), op=hvd.Sum, process_set=mine)
    assert part.tolist() == [[float(len(ranks))] * 2]
    hvd.barrier(process_set=mine)
    with pytest.raises(ValueError, match="not a member"):
        hvd.allreduce(t, process_set=other)
    with pytest.raises(ValueError, match="not in the process set"):
        hvd.broadcast(t, root_rank=other.ranks[0], process_set=mine)  # type: ignore[index]
    assert hvd.remove_process_set(odd_set) and hvd.remove_process_set(even_set)
    assert even_set.process_set_id is None and not hvd.remove_process_set(even_set)
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="registered"):
        hvd.allreduce(t, process_set=even_set)


def test_process_set_from_a_communicator_is_refused_by_add_as_in_horovod():
    from mpi4py import MPI

    ps = hvd.ProcessSet(MPI.COMM_WORLD)
    assert ps.mpi_comm is MPI.COMM_WORLD and ps.ranks is None and ps.size() is None
    with pytest.raises(NotImplementedError, match="communicator"):
        hvd.add_process_set(ps)
    with pytest.raises(ValueError, match="list of process ranks"):
        hvd.ProcessSet(["a"])  # type: ignore[list-item]


def test_distributed_optimizer_on_a_process_set_reduces_over_its_members_only():
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("a process set beside the global one needs two workers")
    evens = list(range(0, n, 2))
    even_set = hvd.add_process_set(evens)
    try:
        torch.manual_seed(0)
        model = nn.Linear(3, 1, bias=False)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters(), process_set=even_set
        )
        model(torch.full((1, 3), float(r + 1))).sum().backward()
        opt.step()
        grad = model.weight.grad
        assert grad is not None
        expected = sum(k + 1 for k in evens) / len(evens) if r in evens else r + 1
        assert grad.tolist() == [[float(expected)] * 3]
        opt.close()
    finally:
        hvd.remove_process_set(even_set)


def test_distributed_optimizer_refuses_duplicate_names_and_min_as_horovod():
    model = nn.Linear(2, 2)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="must be unique. Found duplicates: weight"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[named[0], ("weight", named[1][1])]
        )
    with pytest.raises(NotImplementedError, match="Min"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Min)


def test_broadcast_optimizer_state_gives_a_fresh_optimizer_zero_gradients_and_state():
    r = hvd.rank()
    torch.manual_seed(r)
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    trained = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([frozen, trained], lr=0.1 * (r + 1), momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert frozen.grad is None and trained.grad is not None and trained.grad.tolist() == [0.0, 0.0]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert "momentum_buffer" in opt.state[trained]
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS([trained]), root_rank=0)


def test_horovods_exception_classes():
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    interrupt = hvd.HostsUpdatedInterrupt(True)
    assert isinstance(interrupt, RuntimeError) and interrupt.skip_sync is True


def test_sparse_allreduce_async_gathers_indices_and_values_as_horovod():
    r = hvd.rank()
    dense = torch.zeros(4, 3)
    dense[r % 4, 1] = float(r + 1)
    wait = hvd.sparse_allreduce_async(dense.to_sparse(), name="s", op=hvd.Sum)
    assert torch.equal(wait().to_dense(), hvd.allreduce(dense, op=hvd.Sum))
    average = hvd.sparse_allreduce_async(dense.to_sparse(), name="a", op=hvd.Average)()
    assert torch.allclose(average.to_dense(), hvd.allreduce(dense))
