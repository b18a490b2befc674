"""The servers spread over the hosts (`collsync.runtime.placement`), at any world size that leaves a worker beside a
server. The hosts are faked (COLLSYNC_FAKE_HOSTS, read by the placement alone and meant for tests): the first half
of the ranks on one "host", the rest on another, as a launcher's block placement deals them."""

from __future__ import annotations

import pytest
import torch

import collsync.torch as hvd
from collsync.runtime.mpi_world import rank_prefix
from collsync.runtime.placement import FAKE_HOSTS_ENV, launch_order, named_rank, place
from collsync.torch._serve import TAG_JOB, _wait_for, serve
from collsync.torch._world import state

STEPS = 4


def block_hosts(size: int) -> list[str]:
    """Two fake hosts, the first ceil(size / 2) ranks on host0 (one host at a single rank)."""
    return [f"host{r * 2 // size}" if size > 1 else "host0" for r in range(size)]


def servers_for(size: int) -> int:
    return max(1, min(2, size - 1))


@pytest.fixture
def fake_hosts(monkeypatch: pytest.MonkeyPatch):
    def fake(hosts: list[str]) -> list[str]:
        monkeypatch.setenv(FAKE_HOSTS_ENV, ",".join(hosts))
        return hosts

    return fake


def test_placed_world_puts_servers_on_distinct_hosts_and_names_the_launchers_ranks(comm, fake_hosts):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        pytest.skip("a server needs a worker beside it")
    hosts = fake_hosts(block_hosts(size))
    servers = servers_for(size)
    placed = place(comm, comm.allgather("real"), servers)  # the fake names replace the gathered ones
    origin = placed.allgather(rank)  # launcher rank of each placed rank
    assert origin[0] == 0, "rank 0 evaluates and writes the run folder: it never moves"
    assert len({hosts[r] for r in origin[:servers]}) == servers, f"servers on {[hosts[r] for r in origin[:servers]]}"
    assert named_rank(placed, placed.Get_rank()) == rank
    assert rank_prefix(placed).startswith(f"rank {rank} of {size} on ")
    assert launch_order(placed, origin) == list(range(size))
    assert named_rank(comm, rank) == rank  # the launcher's own world is not renamed
    # One host: the launcher's world itself, nothing made.
    fake_hosts(["box"] * size)
    assert place(comm, comm.allgather("real"), servers) is comm


def _train(placement: str) -> dict[str, object]:
    """BSP on the servers through collsync.torch: a double-precision linear model, STEPS steps, each worker's batch
    seeded by its worker rank. Every rank: the final parameters by worker, and each rank's (launcher rank, role)."""
    hvd.init(sync="bsp", servers=servers_for(state_size()), serve=False, placement=placement)
    world = state().world
    if hvd.role() == "server":
        servers = hvd.servers()
        serve(world, servers, _wait_for(world, servers, TAG_JOB))  # until the workers close (their shutdown)
        params = None
    else:
        assert hvd.where().startswith(f"worker {hvd.rank()} (rank {hvd.world_rank()} of ")
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1).double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
            x = torch.randn(8, 4, generator=g, dtype=torch.float64)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    mine = (hvd.world_rank(), hvd.role(), None if params is None else hvd.rank(), params)
    hvd.shutdown()  # the workers close their optimizer here, and the servers' `serve` returns
    who = world.allgather(mine)
    return {
        "servers": sorted(r for r, role, _, _ in who if role == "server"),
        "params": {w: p for _, _, w, p in who if w is not None},
    }


def state_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def test_training_with_spread_servers_runs_and_equals_the_unspread_run(comm, fake_hosts):
    """ "first" and "spread" on one host are the same run; over two fake hosts the servers are on both, and the
    workers' parameters are still bit for bit those of the unspread run (BSP sums in worker order)."""
    size = comm.Get_size()
    if size < 2:
        pytest.skip("a server needs a worker beside it")
    servers = servers_for(size)
    fake_hosts(["box"] * size)
    first = _train("first")
    one_host = _train("spread")
    hosts = fake_hosts(block_hosts(size))
    spread = _train("spread")
    assert first["servers"] == one_host["servers"] == list(range(servers))
    assert len({hosts[r] for r in spread["servers"]}) == servers  # type: ignore[attr-defined]
    assert 0 in spread["servers"]  # type: ignore[operator]
    for other in (one_host, spread):
        theirs, ours = first["params"], other["params"]
        assert isinstance(theirs, dict) and isinstance(ours, dict) and sorted(theirs) == sorted(ours)
        assert len(ours) == size - servers
        for w, p in ours.items():
            assert torch.equal(p, theirs[w]), f"worker {w}: {p} != {theirs[w]}"
