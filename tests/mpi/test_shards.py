"""Parameter-server shards on MPI windows (ranks 0..M-1 serve one block each, the rest are workers), with PSP's
partial pull, at any world size that leaves a worker beside two servers."""

from __future__ import annotations

import random
import time

import pytest
import torch

from collsync.checks import check_trace
from collsync.loops import Worker, run_server, run_worker
from collsync.policy import asynchronous, bsp, psp
from collsync.rules import sgd
from collsync.runtime.mpi_shards import ShardedMailbox, open_shards, shard_bounds, snapshot
from collsync.runtime.mpi_windows import RmaCounts
from collsync.server import Server
from collsync.trace import Trace

SERVERS = 2


def _least_squares(numel: int):
    target = torch.linspace(-1, 1, numel, dtype=torch.float64)

    def grads(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
        time.sleep(random.Random(worker * 7919 + index).random() * 1e-3)
        return params - target

    return grads


def _train(comm, policy, numel: int, steps: int, slow_shard: int | None = None, counts: RmaCounts | None = None):
    """Every shard's server to `steps` updates; returns (this rank's server or None, this worker's mailbox or None)."""
    workers = comm.Get_size() - SERVERS
    bounds = shard_bounds(numel, SERVERS)
    shards = open_shards(comm, numel, SERVERS, dtype=torch.float64, sends=policy.sent())  # as both fronts open them
    rank = comm.Get_rank()
    server = mailbox = None
    if rank < SERVERS:
        start, stop = bounds[rank]
        server = Server(
            torch.zeros(stop - start, dtype=torch.float64), sgd(lr=0.2), policy, workers, steps=steps, trace=Trace()
        )
        box = shards[rank]
        if rank == slow_shard:
            publish = box.publish

            def slow(params, stamp):
                time.sleep(3e-3)  # a slow server shard: its versions lag the other's
                publish(params, stamp)

            box.publish = slow  # type: ignore[method-assign]
        run_server(server, box)
    else:
        mailbox = ShardedMailbox(shards, bounds, policy.pull_fraction, policy.pull_timeout)
        if counts is not None:
            mailbox.count(counts)
        # NaN until read: a block the worker never received would poison every gradient it computes.
        params = torch.full((numel,), float("nan"), dtype=torch.float64)
        run_worker(Worker(mailbox.worker, policy, seed=1), mailbox, _least_squares(numel), params)
    comm.Barrier()
    final = snapshot(shards, bounds, torch.empty(numel, dtype=torch.float64))
    for shard in shards:
        shard.free()
    return server, mailbox, final


@pytest.mark.parametrize(
    "policy", [asynchronous(), bsp(), psp(pushes=1), psp(pushes=1, timeout=0.01)], ids=["async", "bsp", "psp", "tau1"]
)
def test_every_shard_trains_its_block_and_passes_the_trace_checks(comm, policy):
    if comm.Get_size() < SERVERS + 1:
        pytest.skip("two shards and at least one worker need 3 ranks")
    numel, steps = 101, 30
    server, _, final = _train(comm, policy, numel, steps)
    if server is not None:
        assert server.version == steps
        counts = check_trace(server.trace, policy, comm.Get_size() - SERVERS)
        assert counts["pushed"] == counts["applied"] + counts["dropped"] and counts["updates"] == steps
    # Every rank sees the same final parameters, each block from its own shard, all moved towards the target.
    assert len({final.numpy().tobytes() for final in comm.allgather(final)}) == 1
    target = torch.linspace(-1, 1, numel, dtype=torch.float64)
    assert torch.linalg.norm(final - target) < 0.5 * torch.linalg.norm(target)


def test_partial_pull_goes_on_without_a_slow_shard(comm):
    if comm.Get_size() < SERVERS + 1:
        pytest.skip("two shards and at least one worker need 3 ranks")
    policy = psp(pushes=1, pull_fraction=0.5)  # one block of two is enough to start the next round
    server, mailbox, final = _train(comm, policy, 64, 30, slow_shard=1)
    partial = comm.allgather(None if mailbox is None else mailbox.partial_reads)
    if server is not None:
        assert server.version == 30
        check_trace(server.trace, policy, comm.Get_size() - SERVERS)
        assert torch.isfinite(server.params).all()
    assert sum(p for p in partial if p is not None) > 0, "no worker ever went on with a partial pull"
    assert torch.isfinite(final).all()  # no block was computed on before it was first received


def test_a_full_pull_waits_for_every_shard(comm):
    if comm.Get_size() < SERVERS + 1:
        pytest.skip("two shards and at least one worker need 3 ranks")
    _, mailbox, _ = _train(comm, psp(pushes=1, pull_fraction=1.0), 64, 20, slow_shard=1)
    partial = comm.allgather(None if mailbox is None else mailbox.partial_reads)
    assert all(p == 0 for p in partial if p is not None)


def test_a_world_without_workers_is_refused(comm):
    with pytest.raises(ValueError, match="launch at least"):
        open_shards(comm, 10, comm.Get_size())


def test_a_round_through_the_shards_takes_no_round_trip(comm):
    """Issue 33, items 1 and 3: with M shards a worker's round of a round policy makes no round trip (the push one
    message a shard, the pull a local test of each shard's delivery, `runtime.mpi_sent`); before the push was a
    message it was 1 round trip a shard (its Flush), before server-sent parameters 4 a shard (the pull 3: a poll,
    the Get, the seqlock's re-read), and before that 7-9 a shard and two a poll."""
    if comm.Get_size() < SERVERS + 1:
        pytest.skip("two shards and at least one worker need 3 ranks")
    counts = RmaCounts()
    _, mailbox, _ = _train(comm, bsp(), 64, 15, counts=counts)
    if mailbox is not None:
        rounds = mailbox.sent
        own = counts.round_trips - counts.poll_trips
        # Not the rounds: the `finished` word a shard at the end, and `_train`'s snapshot of every shard (3 each).
        assert rounds > 0 and own <= SERVERS * 4, (own, rounds)
        assert counts.ops["Isend"] >= rounds * SERVERS and counts.ops["Put"] == 0, counts.ops
        assert counts.poll_trips <= counts.waits * SERVERS + rounds, (counts.poll_trips, counts.waits)
