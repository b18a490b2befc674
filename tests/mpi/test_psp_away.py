"""PSP's rounds count only the workers still pushing (issue 33), through the window mailbox and the server loop that
`collsync.torch` serves with (`run_server(until_left=True)`), at any world size with one server and >= 3 workers."""

from __future__ import annotations

import pytest
import torch

from collsync.checks import check_trace
from collsync.loops import Worker, pull, push, run_server
from collsync.policy import psp
from collsync.rules import sgd
from collsync.runtime.mpi_shards import ShardedMailbox, open_shards, shard_bounds
from collsync.runtime.mpi_windows import Backoff
from collsync.server import Server
from collsync.trace import Trace

ROUNDS = 3  # each fast worker's rounds, then the slow worker's own


def _wait(request) -> None:
    backoff = Backoff(cap=5e-3)
    while not request.Test():
        backoff.wait()


def test_a_worker_with_pushes_left_is_not_held_by_workers_away_in_a_collective(comm):
    """c = n - 1: the fast workers close ROUNDS rounds without the last one, then say they are away and wait in a
    barrier of the workers (a script's allreduce); the last worker, its round skipped ahead, pushes ROUNDS more
    gradients that only it sends. Each is applied alone at once (before, each waited for c pushes until the
    deadline, 600 s by default, kept here), the barrier completes, and the workers leave."""
    size = comm.Get_size()
    if size < 4:
        pytest.skip("a partial push of c >= 2 of n >= 3 workers beside one server needs 4 ranks")
    workers, numel = size - 1, 8
    policy = psp(pushes=workers - 1)
    rank = comm.Get_rank()
    peers = comm.Split(0 if rank == 0 else 1, rank)  # the workers' own communicator, as a script's collectives have
    shards = open_shards(comm, numel, 1, dtype=torch.float64, sends=policy.sent())
    if rank == 0:
        server = Server(torch.zeros(numel, dtype=torch.float64), sgd(lr=0.1), policy, workers, trace=Trace())
        run_server(server, shards[0], until_left=True)
    else:
        mailbox = ShardedMailbox(shards, shard_bounds(numel, 1))
        worker = Worker(mailbox.worker, policy)
        params = torch.zeros(numel, dtype=torch.float64)
        pull(worker, mailbox, params)
        slow = mailbox.worker == workers - 1
        if slow:
            backoff = Backoff(cap=5e-3)
            while mailbox.peek().version < ROUNDS:  # the others close their rounds without this worker
                backoff.wait()
        # The slow worker's first gradient, of round 0, comes late and is dropped; it then skips to the server's
        # round (`SyncPolicy.next_clock`) and pushes ROUNDS rounds that only it sends.
        for _ in range(ROUNDS + 1 if slow else ROUNDS):
            push(worker, mailbox, torch.ones(numel, dtype=torch.float64), pull_next=True)
            assert not pull(worker, mailbox, params).done
        if not slow:
            mailbox.mark_away(True)  # what `ServerMode` does on its first wait inside another collective
        _wait(peers.Ibarrier())
        if slow:
            # Its rounds ROUNDS..2 x ROUNDS - 1 were each applied, with its gradient alone (below).
            assert worker.version == 2 * ROUNDS
        mailbox.leave()
    comm.Barrier()
    if rank == 0:
        assert server.version == 2 * ROUNDS and server.away == frozenset(range(workers - 1))
        assert [(e["worker"], e["reason"]) for e in server.trace.of("drop")] == [(workers - 1, "late")]
        applies = server.trace.of("apply")
        assert [e["workers"] for e in applies[ROUNDS:]] == [[workers - 1]] * ROUNDS
        assert all(len(e["workers"]) == workers - 1 for e in applies[:ROUNDS])
        check_trace(server.trace, policy, workers)
    for shard in shards:
        shard.free()
    peers.Free()
