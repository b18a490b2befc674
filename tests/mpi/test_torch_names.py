"""collsync.torch's named operations and sparse gradients, at any world size: an operation in flight does not hold
up `barrier()`, a name is free once its operation completed, named operations called in different orders are told
apart, and a sparse embedding trains without `sparse_as_dense` as it trains with it (Horovod's semantics for each)."""

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
        with pytest.raises(ValueError, match="same name as another tensor"):
            hvd.allreduce_async(torch.ones(3), name="early.allreduce")  # still in flight here
    hvd.barrier()
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


def test_named_operations_called_in_different_orders_are_refused_not_swapped():
    """Headers are matched in calling order: two named allreduces of the same shape called in the other order on
    one worker raise HorovodInternalError naming both names on every worker, rather than summing one worker's 'a'
    with another's 'b'. The workers are still in step afterwards."""
    if hvd.size() == 1:
        pytest.skip("an order needs two workers to differ")
    n, r = hvd.size(), hvd.rank()
    names = ["order.b", "order.a"] if r == n - 1 else ["order.a", "order.b"]
    handles = [hvd.allreduce_async(torch.ones(2), name=name) for name in names]
    for handle in handles:
        with pytest.raises(
            hvd.HorovodInternalError,
            match="mismatched tensor name across the workers: .*sent 'order.[ab]'; .*sent 'order.[ab]'",
        ):
            hvd.synchronize(handle)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(n)] * 2


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
