"""An MPI run and a simulated run of the same configuration agree: bit for bit where the order of the sums is fixed
(the server sums a round in worker order whatever the arrival order), to float tolerance where an allreduce sums
in its own order. float64 throughout; valid at any world size of 2 or more ranks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from collsync.checks import check_trace
from collsync.ledger import Ledger
from collsync.loops import Worker, run_allreduce, run_server, run_worker
from collsync.policy import SyncPolicy, asynchronous, backup, bsp, ssp
from collsync.rounds import run_partial
from collsync.rules import momentum
from collsync.runtime.mpi_coll import MpiCollective
from collsync.runtime.mpi_partial import PartialAllreduce
from collsync.runtime.mpi_rma import WindowMailbox
from collsync.server import Server
from collsync.sim import Simulator
from collsync.stragglers import OneSlow
from collsync.trace import Trace

NUMEL, STEPS = 33, 25
TARGET = torch.linspace(-1, 1, NUMEL, dtype=torch.float64)


def grads(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
    """A different least-squares pull per worker and batch: a wrong worker, batch or version shows in the bits."""
    return (params - TARGET) * (1.0 + 0.1 * worker) + 0.01 * torch.sin(torch.arange(NUMEL) + index + 7.0 * worker)


def make(policy: SyncPolicy, workers: int, trace: Trace, steps: int = STEPS) -> Server:
    """The one configuration every runtime here runs: momentum SGD with an EMA, from zeros."""
    start = torch.zeros(NUMEL, dtype=torch.float64)
    return Server(start, momentum(lr=0.1), policy, workers, steps=steps, ema_decay=0.9, trace=trace)


def simulated(policy: SyncPolicy, workers: int) -> Server:
    sim = Simulator(workers, None, seed=0)
    return sim.run(make(policy, workers, sim.trace), grads)


@pytest.mark.parametrize("policy", [bsp(), ssp(0), asynchronous()], ids=["bsp", "ssp0", "async"])
def test_window_mailbox_run_equals_the_simulator_bitwise(comm, policy):
    workers = comm.Get_size() - 1
    if workers < 1 or (not policy.rounds and workers > 1):
        pytest.skip("needs a worker; async is order-free only with one worker")
    with WindowMailbox(comm, NUMEL, dtype=torch.float64) as box:
        if box.is_server:
            server = make(policy, workers, Trace())
            run_server(server, box)
            check_trace(server.trace, policy, workers)
            reference = simulated(policy, workers)
            assert torch.equal(server.params, reference.params)
            assert torch.equal(server.ema, reference.ema)
        else:
            run_worker(Worker(box.worker, policy), box, grads, torch.empty(NUMEL, dtype=torch.float64))


def test_serverless_runs_equal_the_simulator_to_float_tolerance(comm):
    n = comm.Get_size()
    reference = simulated(bsp(), n)
    allreduced = run_allreduce(make(bsp(), n, Trace()), MpiCollective(comm), grads)
    with PartialAllreduce(comm, NUMEL, dtype=torch.float64) as pa:
        partial = run_partial(make(bsp(), n, Trace()), pa, grads)
    for server in (allreduced, partial):
        assert server.version == STEPS
        torch.testing.assert_close(server.params, reference.params, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(server.ema, reference.ema, rtol=1e-12, atol=1e-14)
    # Full-quorum rounds are an MPI allreduce (summed in MPI's order, not the simulator's worker order): equal to
    # float tolerance above, and the same bits on every rank, so the replicas never drift apart.
    assert len(set(comm.allgather(partial.params.numpy().tobytes()))) == 1


# (the slow worker's step, the margin) in each front's seconds: within the margin, every round takes every worker;
# past it, none takes the slow one. MPI: the fast ranks sleep 50 ms a batch; the simulator: 1 model second.
REGIMES = {"within": ((0.06, 0.5), (1.2, 5.0)), "past": ((0.5, 0.02), (10.0, 0.5))}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_backup_with_a_margin_and_catch_up_agrees_with_the_simulator(comm, regime):
    """sync=backup (b = 1) with a fixed margin and catch-up, the last rank slow, through the three fronts:
    collsync-train's runtime=partial loop (`rounds.run_partial` on a replica server), a collsync.torch script (the
    user's SGD and `hvd.DistributedSampler`, one epoch) and the simulator (runtime=sim, the same keys). They take the
    same workers into every round, hand out the same batches (`ledger.Ledger`: past the margin, the slow rank's are
    computed by the others) and end with the same parameters (to float tolerance: the partial allreduce sums in its
    own order). The epoch's batches are each in exactly one applied mean, the slow rank's too, however late it is;
    the epoch takes the rounds they need (fewer than n of them, left at its end, would go first in the next)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("a slow worker needs another one")
    (mpi_step, mpi_margin), (sim_step, sim_margin) = REGIMES[regime]
    policy, slow = backup(1), n - 1
    computed: dict[str, list[tuple[int, int]]] = {"mpi": [], "api": []}  # this rank's batches: (shard, index)

    def counted(side: str) -> Any:
        def fn(params: torch.Tensor, shard: int, index: int) -> torch.Tensor:
            time.sleep(mpi_step if rank == slow else 0.05)  # the computing rank's pace, whoever's batch it is
            computed[side].append((shard, index))
            return grads(params, shard, index)

        return fn

    api, api_seen = through_the_api(counted("api"), mpi_margin)
    steps = api_seen["rounds"]  # the epoch's rounds: the other fronts train as many
    mpi_ledger, sim_ledger = Ledger(n, keep=True), Ledger(n, keep=True)
    with PartialAllreduce(comm, NUMEL, dtype=torch.float64, margin=mpi_margin) as pa:
        mpi = run_partial(make(policy, n, Trace(), steps), pa, counted("mpi"), catch_up=True, ledger=mpi_ledger)
    sim = Simulator(n, OneSlow(n, sim_step), seed=0, margin=sim_margin, catch_up=True)
    sim.ledger = sim_ledger
    ref = sim.run(make(policy, n, sim.trace, steps), grads)
    for server in (mpi, ref):
        check_trace(server.trace, policy, n, up_to_all=True)
    torch.testing.assert_close(mpi.params, ref.params, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(api, ref.params, rtol=1e-12, atol=1e-14)  # torch's SGD momentum is the same rule
    torch.testing.assert_close(mpi.ema, ref.ema, rtol=1e-12, atol=1e-14)
    # Who took part in each round: every rank's replica records the same, and the simulator's server agrees.
    members = [sorted(int(w) for w in e["workers"]) for e in mpi.trace.of("apply")]
    assert members == [sorted(int(w) for w in e["workers"]) for e in ref.trace.of("apply")]
    want = list(range(n)) if regime == "within" else list(range(n - 1))
    assert members == [want] * steps, members
    # The batches used, in order, are the same on every front; each of the epoch's is used once (chunk g is batch
    # g // n of shard g % n; the epoch has STEPS x n of them).
    used = mpi_ledger.log
    assert used == sim_ledger.log == api_seen["used"] and used is not None
    assert len(used) == len(set(used)) and max(used) < STEPS * n
    left = set(range(STEPS * n)) - set(used)
    if rank != slow:  # the same batches through both MPI fronts (a late rank's computing is timing's)
        assert computed["mpi"] == computed["api"]
    if regime == "within":
        assert (
            steps == STEPS and used == list(range(STEPS * n)) and computed["mpi"] == [(rank, t) for t in range(STEPS)]
        )
        return
    # Past the margin: the slow rank is in no round, yet its shard's batches are all used (by the others), bar the
    # few left at the epoch's end; the epoch takes about n / (n - 1) x STEPS rounds.
    assert len(left) < n and {g % n for g in used} == set(range(n)), left
    assert steps == -(-(STEPS * n - len(left)) // (n - 1))
    assert api_seen["dropped"] == (api_seen["steps"] if rank == slow else 0), api_seen
    if rank == slow:
        assert len(computed["mpi"]) < steps // 2, computed["mpi"]


def through_the_api(grads_fn: Any, margin: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """The same rounds through `collsync.torch` (`sync="backup"`, the user's torch SGD with momentum applying each
    mean), one epoch of STEPS batches a worker read through `hvd.DistributedSampler` (unshuffled, batch 1: the
    ledger's chunk g is the number g itself, batch g // size of shard g % size), which hands out the batches round by
    round; the final parameters, the epoch's rounds, the rounds taken without this worker's gradient, its steps and
    the chunks used."""
    import collsync.torch as hvd

    hvd.init()
    try:
        size = hvd.size()
        numbers = list(range(STEPS * size))
        sampler = hvd.DistributedSampler(numbers, shuffle=False, batch_size=1)
        loader = torch.utils.data.DataLoader(numbers, batch_size=1, sampler=sampler)
        param = torch.nn.Parameter(torch.zeros(NUMEL, dtype=torch.float64))
        sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)
        opt = hvd.DistributedOptimizer(sgd, [("p", param)], sync="backup", backups=1, margin=margin, catch_up=True)
        ledger = opt._collsync.rounds.ledger
        ledger.log = []  # keep the chunks used
        steps = 0
        for (number,) in loader:
            opt.zero_grad()
            (param * grads_fn(param.detach(), int(number) % size, int(number) // size).detach()).sum().backward()
            opt.step()
            steps += 1
        seen = {"rounds": opt._collsync.round, "dropped": opt.dropped, "steps": steps, "used": ledger.log}
        final = param.detach().clone()
        opt.close()
    finally:
        hvd.shutdown()
    return final, seen
