"""collsync.torch's named operations and sparse gradients, at any world size: an operation in flight does not hold
up `barrier()`, a name is free once its operation completed, named operations called in different orders meet
by name, and a sparse embedding trains without `sparse_as_dense` as it trains with it (Horovod's semantics for each)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import collsync.torch as hvd


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def test_operations_started_before_a_barrier_meet_the_others_started_after_it():
    """Horovod's duplicate-name tests: worker 0 starts named operations, then enters the barrier; the others, in
    the barrier already, start theirs only after it. The barrier does not wait for the operations in flight, and
    they then complete with the right values on every worker."""
    n, r = hvd.size(), hvd.rank()

    def start() -> list[int]:
        return [
            hvd.allreduce_async(torch.full((3,), float(r)), name="early.allreduce", op=hvd.Sum),
            hvd.allgather_async(torch.full((r + 1, 2), float(r)), name="early.allgather"),
            hvd.broadcast_async(torch.full((2,), float(r)), 0, name="early.broadcast"),
            hvd.reducescatter_async(torch.ones(n, 2), name="early.reducescatter", op=hvd.Sum),
            hvd.grouped_reducescatter_async([torch.ones(n)], name="early.grouped", op=hvd.Sum),
        ]

    handles = start() if r == 0 else []
    hvd.barrier()
    if r != 0:
        handles = start()
        # A name worker 0 calls only after the next barrier is in flight here for certain (the names above may
        # already have completed: each later call moves the rounds on).
        late = hvd.allreduce_async(torch.ones(3), name="late.allreduce", op=hvd.Sum)
        with pytest.raises(ValueError, match="same name as another tensor"):
            hvd.allreduce_async(torch.ones(3), name="late.allreduce")
    hvd.barrier()
    if r == 0:
        late = hvd.allreduce_async(torch.ones(3), name="late.allreduce", op=hvd.Sum)
    assert hvd.synchronize(late).tolist() == [float(n)] * 3
    summed, gathered, broadcast, scattered, grouped = (hvd.synchronize(h) for h in handles)
    assert summed.tolist() == [n * (n - 1) / 2] * 3
    assert gathered.shape == (n * (n + 1) // 2, 2) and gathered[-1].tolist() == [n - 1.0] * 2
    assert broadcast.tolist() == [0.0, 0.0]
    assert scattered.tolist() == [[float(n)] * 2] and grouped[0].tolist() == [float(n)]


def test_a_name_is_free_once_its_operation_completed_synchronized_or_not():
    """As in Horovod, the name of a completed operation can be given again before its handle is synchronized."""
    n = hvd.size()
    first = hvd.allreduce_async(torch.ones(2), name="reused", op=hvd.Sum)
    while not hvd.poll(first):
        pass
    second = hvd.allreduce_async(torch.full((2,), 2.0), name="reused", op=hvd.Sum)
    assert hvd.synchronize(second).tolist() == [2.0 * n] * 2
    assert hvd.synchronize(first).tolist() == [float(n)] * 2


def test_named_operations_called_in_different_orders_meet_by_name():
    """Horovod matches named operations by name: here the odd workers call them in another order and synchronize
    them in a third, and each name still sums its own tensors (allreduce, allgather, broadcast, reducescatter)."""
    n, r = hvd.size(), hvd.rank()
    values = {"by.a": 1.0, "by.b": 10.0, "by.c": 100.0}
    order = ["by.c", "by.b", "by.a"] if r % 2 else ["by.a", "by.b", "by.c"]
    handles = {
        name: hvd.allreduce_async(torch.full((2,), values[name] * (r + 1)), name=name, op=hvd.Sum) for name in order
    }
    others = [
        ("by.gather", lambda: hvd.allgather_async(torch.full((r + 1,), float(r)), name="by.gather")),
        ("by.bcast", lambda: hvd.broadcast_async(torch.full((2,), float(r)), 0, name="by.bcast")),
        ("by.scatter", lambda: hvd.reducescatter_async(torch.ones(n, 2), name="by.scatter", op=hvd.Sum)),
    ]
    for name, start in reversed(others) if r % 2 else others:
        handles[name] = start()
    for name in ["by.b", "by.c", "by.a"]:
        assert hvd.synchronize(handles[name]).tolist() == [values[name] * n * (n + 1) / 2] * 2
    assert hvd.synchronize(handles["by.gather"]).tolist() == [float(w) for w in range(n) for _ in range(w + 1)]
    assert hvd.synchronize(handles["by.bcast"]).tolist() == [0.0, 0.0]
    assert hvd.synchronize(handles["by.scatter"]).tolist() == [[float(n)] * 2]


def test_a_blocking_named_operation_meets_another_workers_asynchronous_one_by_name():
    """The blocking forms take the name too: odd workers start an allgather and block in a broadcast, even workers
    start the broadcast and block in the allgather (in calling order these would pair an allgather with a broadcast);
    then a named reducescatter and allreduce, blocking on one side and asynchronous on the other."""
    n, r = hvd.size(), hvd.rank()
    mine = torch.full((r + 1,), float(r))
    if r % 2:
        handle = hvd.allgather_async(mine, name="block.gather")
        cast = hvd.broadcast(torch.full((2,), float(r)), 0, name="block.cast")
        gathered = hvd.synchronize(handle)
        scattered = hvd.synchronize(hvd.reducescatter_async(torch.ones(n, 2), name="block.scatter", op=hvd.Sum))
        summed = hvd.allreduce(torch.ones(2), name="block.sum", op=hvd.Sum)
    else:
        handle = hvd.broadcast_async(torch.full((2,), float(r)), 0, name="block.cast")
        gathered = hvd.allgather(mine, name="block.gather")
        cast = hvd.synchronize(handle)
        handle = hvd.allreduce_async(torch.ones(2), name="block.sum", op=hvd.Sum)
        scattered = hvd.reducescatter(torch.ones(n, 2), name="block.scatter", op=hvd.Sum)
        summed = hvd.synchronize(handle)
    assert gathered.tolist() == [float(w) for w in range(n) for _ in range(w + 1)]
    assert cast.tolist() == [0.0, 0.0]
    assert scattered.tolist() == [[float(n)] * 2] and summed.tolist() == [float(n)] * 2


def test_a_worker_may_complete_one_name_before_it_calls_the_next():
    """Worker 0 starts 'x' then 'y' and waits for 'x'; the others start 'y', wait for it, and only then start 'x'
    (an order that works under Horovod's coordinator: 'y' is ready first). More names than a round holds are in
    flight on worker 0 (`_names._K`), so the full lists are exchanged too. An unnamed operation called
    while names are in flight still meets in calling order."""
    n, r = hvd.size(), hvd.rank()
    if r == 0:
        held = [hvd.allreduce_async(torch.full((1,), float(i)), name=f"many.{i}", op=hvd.Sum) for i in range(20)]
        x = hvd.allreduce_async(torch.ones(1), name="then.x", op=hvd.Sum)
        y = hvd.allreduce_async(torch.ones(1), name="then.y", op=hvd.Sum)
        assert hvd.synchronize(x).tolist() == [float(n)]
        assert hvd.synchronize(y).tolist() == [float(n)]
    else:
        assert hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="then.y", op=hvd.Sum)).tolist() == [float(n)]
        assert hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="then.x", op=hvd.Sum)).tolist() == [float(n)]
        held = [
            hvd.allreduce_async(torch.full((1,), float(i)), name=f"many.{i}", op=hvd.Sum) for i in reversed(range(20))
        ][::-1]
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [float(n)]  # unnamed ones meet in calling order
    assert [hvd.synchronize(h).item() for h in held] == [float(i * n) for i in range(20)]


def test_a_named_mismatch_raises_on_every_worker_naming_what_each_sent():
    """Names met in different orders are still checked: 'mis.shape' has another shape and 'mis.type' another type on
    the last worker; both raise HorovodInternalError on every worker naming the ranks and what each sent, no data
    moves, and 'mis.fine', called between them, completes."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("a mismatch needs two workers")
    last = r == n - 1
    starts = [
        ("mis.shape", lambda: hvd.allreduce_async(torch.ones(3 if last else 2), name="mis.shape")),
        ("mis.fine", lambda: hvd.allreduce_async(torch.ones(2), name="mis.fine", op=hvd.Sum)),
        (
            "mis.type",
            lambda: hvd.allgather_async(torch.ones(2, dtype=torch.float64 if last else torch.float32), name="mis.type"),
        ),
    ]
    handles = {name: start() for name, start in (reversed(starts) if last else starts)}
    others = "rank 0" if n == 2 else "ranks " + ", ".join(map(str, range(n - 1)))
    with pytest.raises(
        hvd.HorovodInternalError, match=rf"shape across the workers: {others} sent \[2\]; rank {n - 1} sent \[3\]"
    ):
        hvd.synchronize(handles["mis.shape"])
    with pytest.raises(
        hvd.HorovodInternalError,
        match=rf"type across the workers: {others} sent 'float32'; rank {n - 1} sent 'float64'",
    ):
        hvd.synchronize(handles["mis.type"])
    assert hvd.synchronize(handles["mis.fine"]).tolist() == [float(n)] * 2


def test_a_joined_worker_answers_named_operations_called_in_different_orders():
    """Horovod's join: the last worker joins at once; the others allreduce two names in different orders, the
    joined worker contributing zeros to each (an Average divides by every worker), then join themselves; join
    returns the same rank on every worker, one that joined after the first."""
    n, r = hvd.size(), hvd.rank()
    if r == n - 1:
        last = hvd.join()
    else:
        names = ["join.b", "join.a"] if r % 2 else ["join.a", "join.b"]
        handles = {name: hvd.allreduce_async(torch.full((2,), float(r + 1)), name=name) for name in names}
        expected = sum(range(1, n)) / n
        assert hvd.synchronize(handles["join.b"]).tolist() == [expected] * 2
        assert hvd.synchronize(handles["join.a"]).tolist() == [expected] * 2
        last = hvd.join()
    assert hvd.allgather(torch.tensor([last])).tolist() == [last] * n
    assert n == 1 or last != n - 1


class _Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 3, sparse=sparse)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(x)).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_sparse_embedding_trains_without_sparse_as_dense_as_with_it(dtype: torch.dtype):
    """Horovod's sparse path: the embedding's sparse gradient is the allgather of the workers' indices and values
    (`sparse_allreduce_async`), `.grad` staying sparse, the dense ones go through the buckets; three steps of SGD
    end where `sparse_as_dense=True` ends (the same gradients, summed in another order)."""
    r = hvd.rank()
    ends = []
    for as_dense in (False, True):
        model = _Bag(sparse=True).to(dtype)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), sparse_as_dense=as_dense
        )
        for step in range(3):
            opt.zero_grad()
            model(torch.tensor([[r % 10, (r + step) % 10, 7]])).backward()
            opt.step()
            assert model.embedding.weight.grad is not None and model.embedding.weight.grad.is_sparse
        ends.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    for sparse_end, dense_end in zip(*ends, strict=True):
        assert torch.allclose(sparse_end, dense_end, atol=1e-6)
    gathered = hvd.allgather(ends[0][0].reshape(1, -1))
    assert all(torch.equal(row, gathered[0]) for row in gathered)  # the replicas agree


def test_sparse_adam_steps_on_the_reduced_sparse_gradient():
    """Horovod's test_sparse_embeddings: SparseAdam (which takes sparse gradients only) under DistributedOptimizer
    without sparse_as_dense, inputs of different lengths on different workers."""
    r = hvd.rank()
    embedding = nn.Embedding(10, 3, sparse=True)
    hvd.broadcast_parameters(embedding.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1))
    before = embedding.weight.detach().clone()
    opt.zero_grad()
    embedding(torch.tensor([[1, 2, 4, 5]] if r == 0 else [[1, 3, 4]])).sum().backward()
    opt.step()
    moved = (embedding.weight.detach() != before).any(dim=1).nonzero().flatten().tolist()
    assert moved == sorted({1, 2, 4, 5} | ({1, 3, 4} if hvd.size() > 1 else set()))
    gathered = hvd.allgather(embedding.weight.detach().reshape(1, -1))
    assert all(torch.equal(row, gathered[0]) for row in gathered)
    opt.close()


def test_named_alltoalls_meet_by_name_with_each_workers_splits():
    """A named alltoall meets the others' by name, as Horovod's do: odd workers start 'a2a.y' before 'a2a.x' and
    block in one while the others block in the other, each worker sending worker w (w + 1) rows of its rank
    under 'a2a.x' and one row under 'a2a.y'; each gets its rows and the splits it received."""
    n, r = hvd.size(), hvd.rank()
    x_splits = torch.tensor([w + 1 for w in range(n)], dtype=torch.int32)
    x_in = torch.full((int(x_splits.sum()), 2), float(r))
    y_in = torch.arange(n, dtype=torch.float64) + 10 * r
    if r % 2:
        handle = hvd.alltoall_async(y_in, name="a2a.y")
        x_out, x_received = hvd.alltoall(x_in, x_splits, name="a2a.x")
        y_out, y_received = hvd.synchronize(handle)
    else:
        handle = hvd.alltoall_async(x_in, x_splits, name="a2a.x")
        y_out = hvd.alltoall(y_in, name="a2a.y")
        x_out, x_received = hvd.synchronize(handle)
    assert x_received.tolist() == [r + 1] * n
    assert x_out.tolist() == [[float(w)] * 2 for w in range(n) for _ in range(r + 1)]
    assert y_out.tolist() == [float(r + 10 * w) for w in range(n)]


def test_a_named_alltoall_mismatch_names_each_workers_tensor():
    """A named alltoall whose workers disagree on a dimension past the first (or on the type) raises
    HorovodInternalError on every worker, naming the ranks and the shape each sent; no data moves."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("a mismatch needs two workers")
    last = r == n - 1
    handle = hvd.alltoall_async(torch.ones(2 * n, 3 if last else 2), name="a2a.bad")
    others = "rank 0" if n == 2 else "ranks " + ", ".join(map(str, range(n - 1)))
    with pytest.raises(
        hvd.HorovodInternalError,
        match=rf"^alltoall_async: mismatched tensor shape across the workers: {others} sent \[{2 * n}, 2\]; "
        rf"rank {n - 1} sent \[{2 * n}, 3\]",
    ):
        hvd.synchronize(handle)
    assert hvd.alltoall(torch.ones(n), name="a2a.bad").tolist() == [1.0] * n  # the name is free again


def test_one_name_is_one_namespace_per_kind_of_operation():
    """Horovod keys a named operation by its kind and name ('allreduce.same', 'allgather.same', ...): the same
    name on operations of six kinds, in flight together, is six operations, each meeting its own kind (odd workers
    call them in the other order). The same kind twice under one name is refused, in place or not. The last
    worker starts its six before a barrier that the others start theirs after, so they are in flight there."""
    n, r = hvd.size(), hvd.rank()

    def start() -> list[int]:
        starts = [
            lambda: hvd.allreduce_async(torch.full((2,), float(r)), name="same", op=hvd.Sum),
            lambda: hvd.allgather_async(torch.full((1,), float(r)), name="same"),
            lambda: hvd.broadcast_async(torch.full((2,), float(r)), n - 1, name="same"),
            lambda: hvd.alltoall_async(torch.full((n,), float(r)), name="same"),
            lambda: hvd.reducescatter_async(torch.ones(n), name="same", op=hvd.Sum),
            lambda: hvd.grouped_allreduce_async([torch.ones(1)], name="same", op=hvd.Sum),
        ]
        return [s() for s in starts] if r % 2 == 0 else [s() for s in reversed(starts)][::-1]

    handles = start() if r == n - 1 else []
    try:
        if r == n - 1:
            with pytest.raises(ValueError, match=r"^allreduce_async_: requested to allreduce, .*\(name='same'\)"):
                hvd.allreduce_async_(torch.ones(2), name="same")
    finally:
        hvd.barrier()  # reached on every worker, whatever the check found
    if r != n - 1:
        handles = start()
    summed, gathered, cast, swapped, scattered, grouped = (hvd.synchronize(h) for h in handles)
    assert summed.tolist() == [n * (n - 1) / 2] * 2
    assert gathered.tolist() == [float(w) for w in range(n)]
    assert cast.tolist() == [float(n - 1)] * 2
    assert swapped[0].tolist() == [float(w) for w in range(n)] and swapped[1].tolist() == [1] * n
    assert scattered.tolist() == [float(n)] and grouped[0].tolist() == [float(n)]


def test_broadcast_parameters_meets_by_parameter_name_in_any_order():
    """`broadcast_parameters` names each broadcast by its parameter's name, as Horovod does: odd workers list
    the parameters in the reverse order, and every worker still ends with the root's tensor of each name."""
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(r)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    named = list(model.named_parameters())
    hvd.broadcast_parameters(named[::-1] if r % 2 else named, root_rank=n - 1)
    gathered = hvd.allgather(torch.cat([p.detach().reshape(1, -1) for _, p in named], dim=1))
    assert all(torch.equal(row, gathered[-1]) for row in gathered)
    torch.manual_seed(n - 1)
    root = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), root.parameters(), strict=True))


def test_broadcast_optimizer_state_moves_the_roots_state_tensors_and_options_by_name():
    """Horovod's `broadcast_optimizer_state`: the root's Adam state (its moments, under 'exp_avg.1', ...) and
    options (lr, betas) replace a fresh optimizer's on every other worker, in place."""
    r = hvd.rank()
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([w], lr=0.1 * (r + 1), betas=(0.8, 0.9) if r == 0 else (0.9, 0.999))
    if r == 0:
        w.grad = torch.tensor([1.0, 2.0, 3.0])
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1) and opt.param_groups[0]["betas"] == (0.8, 0.9)
    moments = torch.cat([opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"], opt.state[w]["step"].reshape(1)])
    gathered = hvd.allgather(moments.reshape(1, -1))
    assert all(torch.equal(row, gathered[0]) for row in gathered)
    assert opt.state[w]["exp_avg"].tolist() == pytest.approx([0.2, 0.4, 0.6])


@pytest.mark.serial
def test_the_stall_line_names_the_operation_the_user_called(capfd, monkeypatch):
    """A stalled allgather is named `allgather` (not the grouped operation it runs as), named or not: the last
    worker calls a named one, then an unnamed one, while the others wait 2 s before each (the stall check warns
    after 1 s here)."""
    from collsync.torch import _stall

    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("a stall needs two workers")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "1")
    end_s = _stall.STALL.end_s
    _stall.STALL.configure(None)
    _stall.STALL.end_s = end_s
    try:
        hvd.barrier()
        for name in ("stall.x", None):
            if r != n - 1:
                time.sleep(2.0)
            assert hvd.allgather(torch.ones(1), name=name).tolist() == [1.0] * n
        hvd.barrier()
    finally:
        monkeypatch.delenv("HOROVOD_STALL_CHECK_TIME_SECONDS")
        _stall.STALL.configure(None)
        _stall.STALL.end_s = end_s
    err = capfd.readouterr().err
    if r == n - 1:
        assert f"worker {r} has waited 1 s in allgather 'stall.x': " in err, err
        assert f"worker {r} has waited 1 s in allgather (collective #" in err, err
        assert "grouped" not in err, err
