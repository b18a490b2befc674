"""The server ranks of `collsync.torch`: they wait inside `init()` for the workers' optimizer, serve its shards on
MPI windows until the workers leave, and exit (without `MPI_Finalize` once a worker was lost); the user's script
never runs past `init()` on them.

Worker 0 sends each server a job (`Job`: the initial flat parameters, the policy, the rule and penalty as
factories with their arguments bound, the number of workers) when a `DistributedOptimizer` in a server mode is
built; the windows are then opened collectively by every rank of the world
(`collsync.runtime.mpi_shards.open_shards`), and shard j is served by `collsync.loops.run_server` on rank j exactly
as `collsync-train runtime=mpi` serves it. `world` here is `init()`'s, whose ranks put the servers first (spread
over the hosts by default: `collsync.runtime.placement`), so `servers + w` is worker w's rank in it; what is named
to the user maps back to the launcher's rank (`placement.named_rank`). At the workers' `shutdown()`, worker 0
sends `None`: the server ranks leave MPI and exit with status 0.

A server rank serves through `collsync.serving.ShardEngine`, the engine `collsync-train runtime=mpi` runs its
server ranks through (that front adds its evaluation, checkpoint files and trace through the engine's hooks); it
loads nothing of the trainer.

SpecSync (004_..., Alg. 2): with a policy that speculates, every rank of the world `Dup`s it right after the shards
open (the messages' own communicator, as `collsync-train` has), and server rank 0 runs the scheduler inside its
`run_server` loop (`poll=`), as `collsync-train sync=specsync` does: the workers' notifies come in, re-syncs go out,
abort reports are counted. Once every worker said BYE, each is sent the scheduler's counts
(`SchedulerService.close(tell=True)`). Its clock is wall seconds (`abort_time`, `wait` in seconds: a script has
no straggler model to scale).

Checkpoints: while serving (and while waiting to close), a server answers worker 0's request for its state now
with its `Server.state_dict()` between two messages (`runtime.mpi_checkpoint.ShardStates`, the protocol
`collsync-train`'s sharded checkpoints use; `DistributedOptimizer.server_state_dict()`), and a job may carry
those states back (`DistributedOptimizer(..., server_state=...)`), so a script saves and resumes the servers'
parameters and rule states as it saves its own model.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from collsync import ending
from collsync.policy import SyncPolicy
from collsync.rules import combine
from collsync.runtime.mpi_windows import Backoff
from collsync.runtime.mpi_world import abort_on_error, open_mpi
from collsync.runtime.placement import named_rank
from collsync.server import Server
from collsync.serving import Serving, ShardEngine
from collsync.trace import Trace

if TYPE_CHECKING:
    from mpi4py import MPI


TAG_JOB = 7301
TAG_LOST = 7302  # server rank 0 -> each live worker at the end: the workers it lost
TAG_BYE = 7303  # each live worker -> server rank 0 at its exit after a loss: its script ended


@dataclass
class Job:
    """What a server rank needs to serve its shard of a worker-side optimizer."""

    params: torch.Tensor
    policy: SyncPolicy
    rule: Callable[[], Any]  # the server's rule factory with its arguments (`config.factory`): no config framework
    penalty: Callable[[], Any] | None
    workers: int
    ema_decay: float | None = None
    state: list[dict[str, Any]] | None = None  # one `Server.state_dict()` per shard, to resume from


def _wait_for(world: MPI.Comm, source: int, tag: int) -> Any:
    """A message from `source`, waited for with pauses (a blocking MPI receive would spin on a shared core)."""
    backoff = Backoff(cap=5e-3)
    while not world.Iprobe(source=source, tag=tag):
        backoff.wait()
    return world.recv(source=source, tag=tag)


def serve_forever(world: MPI.Comm, servers: int) -> None:
    """Serve every job worker 0 sends (on `world`, whose ranks below `servers` serve), then exit the process
    (status 0). Errors abort the world naming the rank."""
    lost: set[int] = set()
    last: Job | None = None
    with abort_on_error(world, (ValueError, TimeoutError)):
        while True:
            job = _wait_for(world, servers, TAG_JOB)
            if job is None:
                break
            lost |= serve(world, servers, job)
            last = job
    sys.stdout.flush()
    if lost:
        assert last is not None
        # MPI_Finalize would wait for the lost worker for ever (MPICH's waits on every rank of the world). Under
        # MPICH server rank 0 ends the job once every live worker's script ended: mpiexec would wait for ever on
        # a lost worker's host it cannot reach (a partition), and the abort is the word it acts on at once.
        if world.Get_rank() == 0 and not open_mpi():
            live = [servers + w for w in range(last.workers) if w not in lost]
            hear_byes(world, live)
            ending.end(0, comm=world)
        ending.end(0)
    sys.exit(0)


def say_bye(world: MPI.Comm, bound: float) -> None:
    """A worker, at its exit after a loss: tell server rank 0 that this script ended (`hear_byes`); waits at most
    `bound` for the word to go (rank 0 itself may be gone)."""
    request = world.isend(None, dest=0, tag=TAG_BYE)
    end = time.monotonic() + bound
    backoff = Backoff(cap=5e-3)
    while not request.Test() and time.monotonic() < end:
        backoff.wait()


def hear_byes(world: MPI.Comm, ranks: list[int]) -> None:
    """Server rank 0 after a loss: wait until each live worker's script ended (`say_bye`). Live workers answered
    at the end (`tell_lost`), so each comes once its script is done; no bound but theirs."""
    for rank in ranks:
        _wait_for(world, rank, TAG_BYE)


def server_parts(job: Job) -> tuple[Any, Any]:
    """The penalty and the rule a server applies, from the factories worker 0 bound (`config.factory`)."""
    return combine(job.penalty() if job.penalty is not None else None, job.rule())


def serve(world: MPI.Comm, servers: int, job: Job) -> set[int]:
    """Serve this rank's shard of `job` until the workers leave (collective with the workers' `ServerMode`); the
    workers this shard lost."""
    penalty, optimizer = server_parts(job)

    def server(block: slice, trace: Trace | None) -> Server:
        return Server(job.params[block], optimizer, job.policy, job.workers, penalty=penalty, ema_decay=job.ema_decay)

    serving = Serving(
        numel=job.params.numel(),
        dtype=job.params.dtype,
        servers=servers,
        workers=job.workers,
        policy=job.policy,
        server=server,
        until_left=True,
        state=job.state,
    )
    run = ShardEngine(world, serving)
    run.open()
    run.serve()
    assert run.server is not None and run.shards is not None
    tell_lost(world, servers, run.server, run.shards.own.locate)
    # Training is over once one worker left a round policy; worker 0 may still ask for the state meanwhile. A lost
    # worker never comes to close: the windows then stay to the process's exit (freeing them is collective).
    run.close(timeout=job.policy.deadline if run.server.lost else None)
    return set(run.server.lost)


def tell_lost(world: MPI.Comm, servers: int, server: Server, locate: Callable[[int], tuple[Any, Any]]) -> None:
    """Server rank 0, once its workers stopped: tell every live worker which workers it lost (`Server.lose`), as
    `DistributedOptimizer.lost` lists them: worker rank, world rank, host, the last update it contributed to."""
    if world.Get_rank() != 0:
        return
    lost = [
        ending.lost_rank(w, locate(w)[1], server.contributed[w], world_rank=named_rank(world, servers + w))
        for w in server.lost
    ]
    # Every worker is told (one lost only as slow may still come to close); only the live ones are waited on.
    requests = [world.isend(lost, dest=servers + w, tag=TAG_LOST) for w in range(server.workers)]
    for w, request in enumerate(requests):
        if w not in server.lost:
            request.wait()


def receive_lost(world: MPI.Comm) -> list[dict[str, Any]]:
    """A worker, once it left: the workers server rank 0 lost (`tell_lost`); it comes once every live worker left."""
    return list(_wait_for(world, 0, TAG_LOST))


def send_job(world: MPI.Comm, servers: int, job: Job) -> None:
    """Worker 0: hand `job` to every server rank."""
    requests = [world.isend(job, dest=j, tag=TAG_JOB) for j in range(servers)]
    for request in requests:
        request.wait()


def release_servers(world: MPI.Comm, servers: int, worker: int) -> None:
    """At the workers' shutdown: worker 0 (`worker`, its rank among the workers) tells the server ranks to exit."""
    if worker == 0:
        for j in range(servers):
            world.send(None, dest=j, tag=TAG_JOB)
