"""The server ranks of `collsync.torch`: they wait inside `init()` for the workers' optimizer, serve its shards on
MPI windows until the workers leave, and exit; the user's script never runs past `init()` on them.

Worker 0 sends each server a job (`Job`: the initial flat parameters, the policy, the rule and penalty as config
nodes, the number of workers) when a `DistributedOptimizer` in a server mode is built; the windows are then opened
collectively by every rank of the world (`collsync.runtime.mpi_shards.open_shards`), and shard j is served by
`collsync.loops.run_server` on rank j exactly as `collsync-train runtime=mpi` serves it. At the workers'
`shutdown()`, worker 0 sends `None`: the server ranks leave MPI and exit with status 0.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from collsync.policy import SyncPolicy

TAG_JOB = 7301


@dataclass
class Job:
    """What a server rank needs to serve its shard of a worker-side optimizer."""

    params: torch.Tensor
    policy: SyncPolicy
    rule: dict[str, Any]
    penalty: dict[str, Any] | None
    workers: int
    ema_decay: float | None = None


def _recv(world: Any, source: int) -> Any:
    """A message from `source`, waited for with pauses (a blocking MPI receive would spin on a shared core)."""
    from collsync.runtime.mpi_rma import Backoff

    backoff = Backoff(cap=5e-3)
    while not world.Iprobe(source=source, tag=TAG_JOB):
        backoff.wait()
    return world.recv(source=source, tag=TAG_JOB)


def serve_forever(st: Any) -> None:
    """Serve every job worker 0 sends, then exit the process (status 0). Errors abort the world naming the rank."""
    from collsync.runtime.mpi_world import abort_on_error

    with abort_on_error(st.world, (ValueError, TimeoutError)):
        while True:
            job = _recv(st.world, st.servers)
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
    run_server(server, shards.own, until_left=True)
    shards.close()


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
