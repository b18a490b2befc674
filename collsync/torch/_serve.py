"""The server ranks of `collsync.torch`: they wait inside `init()` for the workers' optimizer, serve its shards on
MPI windows until the workers leave, and exit; the user's script never runs past `init()` on them.

Worker 0 sends each server a job (`Job`: the initial flat parameters, the policy, the rule and penalty as config
nodes, the number of workers) when a `DistributedOptimizer` in a server mode is built; the windows are then opened
collectively by every rank of the world (`collsync.runtime.mpi_shards.open_shards`), and shard j is served by
`collsync.loops.run_server` on rank j exactly as `collsync-train runtime=mpi` serves it. At the workers'
`shutdown()`, worker 0 sends `None`: the server ranks leave MPI and exit with status 0.

SpecSync (004_..., Alg. 2): with a policy that speculates, every rank of the world `Dup`s it right after the shards
open (the messages' own communicator, as `collsync-train` has), and server rank 0 runs the scheduler inside its
`run_server` loop (`poll=`), as `collsync-train sync=specsync` does: the workers' notifies come in, re-syncs go out,
abort reports are counted. Once every worker said BYE, each is sent the scheduler's counts
(`SchedulerService.close(tell=True)`). Its clock is wall seconds (`abort_time`, `wait` in seconds: a script has
no straggler model to scale).

Checkpoints: while serving, a server answers worker 0's request (`TAG_STATE`) with its `Server.state_dict()`
between two messages (`DistributedOptimizer.server_state_dict()`), and a job may carry those states back
(`DistributedOptimizer(..., server_state=...)`), so a script saves and resumes the servers' parameters and rule
states as it saves its own model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from collsync.policy import SyncPolicy

TAG_JOB = 7301
TAG_STATE = 7302  # worker 0 -> server j: send me your state
TAG_STATE_REPLY = 7303  # server j -> worker 0: `Server.state_dict()`


@dataclass
class Job:
    """What a server rank needs to serve its shard of a worker-side optimizer."""

    params: torch.Tensor
    policy: SyncPolicy
    rule: dict[str, Any]
    penalty: dict[str, Any] | None
    workers: int
    ema_decay: float | None = None
    state: list[dict[str, Any]] | None = None  # one `Server.state_dict()` per shard, to resume from


def _wait_for(world: Any, source: int, tag: int, while_waiting: Callable[[], None] | None = None) -> Any:
    """A message from `source`, waited for with pauses (a blocking MPI receive would spin on a shared core)."""
    from collsync.runtime.mpi_rma import Backoff

    backoff = Backoff(cap=5e-3)
    while not world.Iprobe(source=source, tag=tag):
        if while_waiting is not None:
            while_waiting()
        backoff.wait()
    return world.recv(source=source, tag=tag)


def serve_forever(st: Any) -> None:
    """Serve every job worker 0 sends, then exit the process (status 0). Errors abort the world naming the rank."""
    from collsync.runtime.mpi_world import abort_on_error

    with abort_on_error(st.world, (ValueError, TimeoutError)):
        while True:
            job = _wait_for(st.world, st.servers, TAG_JOB)
            if job is None:
                break
            serve(st.world, st.servers, job)
    sys.stdout.flush()
    sys.exit(0)


def serve(world: Any, servers: int, job: Job) -> None:
    """Serve this rank's shard of `job` until the workers leave (collective with the workers' `ServerMode`)."""
    from collsync.loops import run_server
    from collsync.rules import combine
    from collsync.runtime.mpi_shards import Shards
    from collsync.server import Server
    from collsync.torch.config import build, server_penalty

    penalty, optimizer = combine(build(server_penalty(job.penalty, job.rule)), build(job.rule))
    shards = Shards(world, job.params.numel(), servers, job.params.dtype)
    block = job.params[shards.block]
    server = Server(block, optimizer, job.policy, job.workers, penalty=penalty, ema_decay=job.ema_decay)
    if job.state is not None:
        if len(job.state) != servers:
            raise ValueError(f"server_state: {len(job.state)} shard state(s) for {servers} server(s)")
        # Gradients the saved run's workers had sent for a round to come belong to that run: these workers send
        # their own.
        server.load_state_dict({**job.state[shards.rank], "pending": {}})
    first_worker = servers  # worker 0's rank in the world
    # SpecSync: the messages' communicator (collective, right after the shards on every rank) and the scheduler.
    speculation = job.policy.speculation
    spec_comm = world.Dup() if speculation is not None else None
    service = None
    if spec_comm is not None and shards.rank == 0:
        from collsync.runtime.mpi_specsync import SchedulerService

        workers = list(range(servers, servers + job.workers))
        service = SchedulerService(spec_comm, speculation, workers, 1.0, None)

    def answer(server: Server) -> None:
        if world.Iprobe(source=first_worker, tag=TAG_STATE):
            world.recv(source=first_worker, tag=TAG_STATE)
            world.send(server.state_dict(), dest=first_worker, tag=TAG_STATE_REPLY)

    run_server(server, shards.own, until_left=True, between=answer, poll=None if service is None else service.poll)
    if service is not None:
        # Every worker says BYE when it leaves; the last leaves after this server stopped under a round policy.
        service.close(job.policy.deadline, tell=True)
    # Training is over once one worker left a round policy; worker 0 may still ask for the state meanwhile.
    shards.close(while_waiting=lambda: answer(server))
    if spec_comm is not None:
        spec_comm.Free()


def server_states(world: Any, servers: int, while_waiting: Callable[[], None]) -> list[dict[str, Any]]:
    """Worker 0: every server's `Server.state_dict()`, in shard order (each taken between two of its messages).
    `while_waiting()` runs between polls: a server whose training ended waits for this worker to say it has seen
    the end before it answers from its shutdown."""
    for j in range(servers):
        world.send(None, dest=j, tag=TAG_STATE)
    return [_wait_for(world, j, TAG_STATE_REPLY, while_waiting) for j in range(servers)]


def send_job(world: Any, servers: int, job: Job) -> None:
    """Worker 0: hand `job` to every server rank."""
    requests = [world.isend(job, dest=j, tag=TAG_JOB) for j in range(servers)]
    for request in requests:
        request.wait()


def release_servers(st: Any) -> None:
    """At the workers' shutdown: worker 0 tells the server ranks to exit."""
    if st.comm.Get_rank() == 0:
        for j in range(st.servers):
            st.world.send(None, dest=j, tag=TAG_JOB)
