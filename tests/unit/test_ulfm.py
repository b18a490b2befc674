"""The logic of a world shrunk in place under ULFM that needs no MPI: whether ULFM is on (`mpi_ulfm.enabled`), the
survivors' agreement on the step (`mpi_ulfm.plan`), the replica regrouped on the workers left (`lost.regroup`), a
sampler's epoch dealt out afresh among them (`DistributedSampler.reshard`), a `Shrank` handed up, and the partial
allreduce's last results kept for the ranks behind (`runs.partial_ulfm.Kept`). The MPI side
runs in tests/integration/test_ulfm.py and tests/integration/test_elastic.py."""

from __future__ import annotations

import pytest
import torch

from collsync.checks import check_trace
from collsync.lost import regroup
from collsync.policy import bsp
from collsync.rules import sgd
from collsync.runs.partial_ulfm import Kept
from collsync.runtime import PartialResult, mpi_ulfm
from collsync.server import Server
from collsync.torch.sampler import DistributedSampler
from collsync.trace import Trace
from collsync.types import Arrival


@pytest.mark.parametrize(
    "env",
    [{}, {"OMPI_MCA_mpi_ft_enable": "0"}, {"OMPI_MCA_mpi_ft_enable": "1", "COLLSYNC_ULFM": "0"}],
    ids=["plain", "ft-off", "turned-off"],
)
def test_ulfm_is_off_unless_the_launch_turned_it_on(env):
    assert not mpi_ulfm.enabled(env)


@pytest.mark.parametrize(
    ("completed", "step", "behind", "root"),
    [
        ([7, 7, 7], 7, [], 0),  # all failed in the same reduction: all redo it
        ([6, 7, 7], 7, [0], 1),  # rank 0 did not complete the one the others did: it takes their mean
        ([7, 6, 7, 6], 7, [1, 3], 0),
        ([0], 0, [], 0),
    ],
)
def test_the_survivors_agree_on_the_step(completed, step, behind, root):
    assert mpi_ulfm.plan(completed) == mpi_ulfm.Plan(step, behind, root)


def test_survivors_two_reductions_apart_are_refused():
    with pytest.raises(ValueError, match="2 reductions apart"):
        mpi_ulfm.plan([5, 7])


def test_the_replica_regroups_on_the_workers_left_and_the_trace_checks_out():
    trace = Trace(lambda: 0.0)
    server = Server(torch.zeros(3, dtype=torch.float64), sgd(lr=1.0), bsp(), 4, trace=trace)
    g = torch.ones(3, dtype=torch.float64)
    for v in range(2):
        server.apply_mean(g, [Arrival(w, v, g, v) for w in range(4)])
    regroup(server, [2], [2], ["node2"])
    assert (server.workers, server.quorum, server.version) == (3, 3, 2)
    assert len(server.received) == len(server.contributed) == 3
    server.apply_mean(g, [Arrival(w, 2, g, 2) for w in range(3)])
    lost, world = trace.of("lost"), trace.of("world")
    assert [(e["worker"], e["host"], e["last_update"]) for e in lost] == [(2, "node2", 2)]
    assert [(e["version"], e["workers"], e["was"]) for e in world] == [(2, 3, 4)]
    assert check_trace(trace, bsp(), 4)["updates"] == 3
    assert torch.equal(server.params, torch.full((3,), -3.0, dtype=torch.float64))


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_shrunk_world_deals_out_the_epochs_samples_no_worker_had(drop_last):
    """4 workers hand out 2 batches of 5 each, then worker 1 dies: the 3 left get the 60 - 40 = 20 samples no
    worker had been handed (padded to 21 or cut to 18 as torch evens shards out), each once."""
    data = list(range(60))
    samplers = [DistributedSampler(data, 4, r, seed=3, batch_size=5, drop_last=drop_last) for r in range(4)]
    iters = [iter(s) for s in samplers]
    before = [[next(it) for _ in range(10)] for it in iters]
    order = samplers[0]._order()
    assert sorted(x for b in before for x in b) == sorted(order[:40])
    left = [samplers[r] for r in (0, 2, 3)]
    for rank, s in enumerate(left):
        s.reshard(3, rank)
    after = [list(iters[r]) for r in (0, 2, 3)]
    dealt = sorted(x for a in after for x in a)
    if drop_last:
        assert len(dealt) == len(set(dealt)) == 18 and set(dealt) <= set(order[40:])
    else:
        assert len(dealt) == 21 and set(dealt) == set(order[40:])
    assert all(len(a) == len(after[0]) for a in after)
    for s in left:  # the next epochs are torch's shards of 3
        assert (s.num_replicas, len(s)) == (3, 20)


class _Survivors:
    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return 3


def test_a_reduction_that_shrank_and_left_is_handed_up_not_recovered_again():
    """`Shrank` (the reducer shrank its communicator and, inside hvd.elastic, left the reduction under way) reports a
    recovery made: `recovering` raises it at once, without calling `recover` or the attempt again, and it names the
    ranks lost."""
    calls: list[str] = []

    def attempt() -> None:
        calls.append("attempt")
        raise mpi_ulfm.Shrank(mpi_ulfm.Shrunk(_Survivors(), [2], 4), "the gradient allreduce")

    with pytest.raises(mpi_ulfm.Shrank, match=r"the gradient allreduce: rank\(s\) 2 of 4 died; the 3 left"):
        mpi_ulfm.recovering(attempt, lambda error: calls.append("recover"))
    assert calls == ["attempt"]


class _Rounds:
    """A partial allreduce of 2 ranks whose round t's mean is t (rank 0 contributes, rank 1 is dropped)."""

    rank, size, depth = 0, 2, 2

    def __call__(self, tensor, quorum, round):
        return PartialResult(torch.full((2,), float(round)), round, 1, [0], [1])

    def try_read(self, quorum, round):
        return None if round % 2 else self(None, quorum, round)


def test_the_partial_allreduce_keeps_its_last_results_by_the_replicas_version():
    """After a shrink a rank ahead hands one behind the results it missed (`runs.partial_ulfm`): `Kept` keeps the
    last `keep` results, numbered by the replica's version (its base + the transport's round), their means copied."""
    kept = Kept(3)
    kept.use(_Rounds(), base=10)
    results = [kept(torch.zeros(2), 1, 0), kept.try_read(1, 1), kept.try_read(1, 2), kept(torch.zeros(2), 1, 3)]
    assert results[1] is None
    assert [r.round for r in kept.results] == [10, 12, 13]
    assert [r.mean[0].item() for r in kept.results] == [0.0, 2.0, 3.0]
    results[3].mean.add_(1.0)  # the caller's mean is its own: the kept copy does not change
    assert kept.results[-1].mean[0].item() == 3.0
    kept.use(_Rounds(), base=20)
    kept(torch.zeros(2), 1, 0)
    assert [r.round for r in kept.results] == [12, 13, 20] and (kept.rank, kept.size) == (0, 2)


class _Comm:
    """What `mpi_ulfm.failure` asks of a communicator: whether it is revoked, which of its processes failed."""

    def __init__(self, revoked: bool, failed: int) -> None:
        self.revoked, self.failed = revoked, failed

    def Is_revoked(self) -> bool:  # noqa: N802 - mpi4py's name
        return self.revoked

    def Get_failed(self):  # noqa: N802 - mpi4py's name
        return _Group(self.failed)


class _Group:
    def __init__(self, size: int) -> None:
        self.size = size

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return self.size

    def Free(self) -> None:  # noqa: N802 - mpi4py's name
        pass


def test_an_nbc_error_counts_as_a_failure_only_on_a_communicator_a_failure_broke():
    """Open MPI's nonblocking collectives report a revoked communicator as `MPI_ERR_OTHER` ("NBC_Progress: an error
    77 was found"): a failure where the communicator the reduction ran on is revoked or knows a dead process, not
    otherwise; the failure classes themselves count wherever they come from, and a non-MPI error never does."""
    MPI = pytest.importorskip("mpi4py.MPI")
    other = MPI.Exception(MPI.ERR_OTHER)
    assert not mpi_ulfm.failure(other)
    assert not mpi_ulfm.failure(other, _Comm(False, 0), None)
    assert mpi_ulfm.failure(other, _Comm(True, 0))
    assert mpi_ulfm.failure(other, None, _Comm(False, 1))
    assert mpi_ulfm.failure(MPI.Exception(MPI.ERR_REVOKED))
    assert not mpi_ulfm.failure(ValueError("no"), _Comm(True, 1))
    wrapped = RuntimeError("the reduction thread failed")
    wrapped.__cause__ = other
    assert mpi_ulfm.failure(wrapped, _Comm(True, 0))
