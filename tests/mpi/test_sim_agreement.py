"""An MPI run and a simulated run of the same configuration agree: bit for bit where the order of the sums is fixed
(the server sums a round in worker order whatever the arrival order), to float tolerance where an allreduce sums
in its own order. float64 throughout; valid at any world size of 2 or more ranks."""

from __future__ import annotations

import pytest
import torch

from collsync.checks import check_trace
from collsync.loops import Worker, run_allreduce, run_server, run_worker
from collsync.policy import SyncPolicy, asynchronous, bsp, ssp
from collsync.rounds import run_partial
from collsync.rules import momentum
from collsync.runtime.mpi_coll import MpiCollective
from collsync.runtime.mpi_partial import PartialAllreduce
from collsync.runtime.mpi_rma import WindowMailbox
from collsync.server import Server
from collsync.sim import Simulator
from collsync.trace import Trace

NUMEL, STEPS = 33, 25
TARGET = torch.linspace(-1, 1, NUMEL, dtype=torch.float64)


def grads(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
    """A different least-squares pull per worker and batch: a wrong worker, batch or version shows in the bits."""
    return (params - TARGET) * (1.0 + 0.1 * worker) + 0.01 * torch.sin(torch.arange(NUMEL) + index + 7.0 * worker)


def make(policy: SyncPolicy, workers: int, trace: Trace) -> Server:
    """The one configuration every runtime here runs: momentum SGD with an EMA, from zeros."""
    start = torch.zeros(NUMEL, dtype=torch.float64)
    return Server(start, momentum(lr=0.1), policy, workers, steps=STEPS, ema_decay=0.9, trace=trace)


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
