"""One shard engine below both fronts: ranks 0..M-1 each serve one block of the flat parameters on MPI windows
(shard j on rank j), SpecSync's scheduler runs in rank 0's server loop or on a rank of its own (the last), and the
workers are the other ranks.

`ShardEngine` is one rank's part: `open()` (collective), then `serve()` or `schedule()` by role, then `close()`.
`collsync.torch`'s server ranks run it as it is (their workers are the user's `DistributedOptimizer`s, which ask
worker 0's questions about the state through `ShardStates`). `collsync-train runtime=mpi` runs
`runs.shards.ShardRun`, which hands in its extras by overriding the hooks (`_open_more`, `_open_states`, `_start`,
`_between`, `_publish_delay`, `_on_failure`, `_waiting`, `_served`, `_after`): the evaluation, the checkpoints, the
trace, the slow shard and the run folder, as Flower hands `evaluate_fn` to a strategy. Nothing here loads the trainer
(Hydra's config, the data, the run folder): a server rank of a user's script stands on this, the transport and the
algorithm core only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from collsync.loops import run_server
from collsync.policy import SyncPolicy
from collsync.runtime.mpi_checkpoint import ShardStates
from collsync.runtime.mpi_shards import Shards
from collsync.runtime.mpi_specsync import SchedulerService
from collsync.server import Server
from collsync.trace import Trace

if TYPE_CHECKING:
    from mpi4py import MPI

State = dict[str, Any]


@dataclass
class Serving:
    """What the server ranks serve, whichever front launched them. `server(block, trace)`: this rank's `Server`
    of its block of the parameters. `time_scale`: wall seconds per second of SpecSync's clock. `dedicated`:
    SpecSync's scheduler has a rank of its own (the last). `until_left`: serve until every worker left, and tell
    each the scheduler's counts (collsync.torch), rather than until `steps`. `state`: one `Server.state_dict()`
    per shard to go on from (collsync.torch's `server_state`)."""

    numel: int
    dtype: torch.dtype
    servers: int
    workers: int
    policy: SyncPolicy
    server: Callable[[slice, Trace | None], Server]
    time_scale: float = 1.0
    dedicated: bool = False
    until_left: bool = False
    state: list[State] | None = None


class ShardEngine:
    """One rank's part in a sharded run, whichever front launched it: `open()` (collective), then `serve()` or
    `schedule()` by role, then `close()`. The hooks (underscored) are what a front adds; here they are
    `collsync.torch`'s: a saved state to start from, and worker 0's requests for the state answered between
    messages and while the server waits to close."""

    def __init__(self, comm: MPI.Comm, serving: Serving) -> None:
        self.comm, self.serving = comm, serving
        self.trace: Trace | None = None
        self.train_comm: MPI.Comm = comm
        self.spec_comm: MPI.Comm | None = None
        self.shards: Shards | None = None
        self.states: ShardStates | None = None
        self.scheduling = False  # this rank is SpecSync's scheduler (its own rank, the last)
        self.server: Server | None = None
        self.service: SchedulerService | None = None
        self.mine: Any = None  # what this rank gives rank 0 at the end (collsync-train)
        self.answering: Callable[[], None] | None = None  # a server's answer to state requests while it closes

    def open(self) -> None:
        """Collective over the world: the shards' windows, the front's own start (`_open_more`), SpecSync's
        communicator and the state messages (`_open_states`)."""
        sv, comm = self.serving, self.comm
        rank, size = comm.Get_rank(), comm.Get_size()
        # SpecSync's scheduler on a rank of its own (the last) stays out of the shards' windows.
        self.scheduling = sv.dedicated and rank == size - 1
        if sv.dedicated:
            self.train_comm = comm.Split(int(self.scheduling), rank)
        if not self.scheduling:
            self.shards = Shards(self.train_comm, sv.numel, sv.servers, sv.dtype, sv.policy.sent())
        self._open_more()
        self.spec_comm = comm.Dup() if sv.policy.speculation is not None else None
        if not self.scheduling:
            self.states = self._open_states()

    def serve(self) -> None:
        """Serve this rank's shard until training ends (with `until_left`: until every worker left)."""
        sv, shards = self.serving, self.shards
        assert shards is not None and shards.serving, "serve(): this rank serves no shard"
        server = self.server = sv.server(shards.block, self.trace)
        self._start(server)
        speculation = sv.policy.speculation
        if speculation is not None and shards.rank == 0:
            assert self.spec_comm is not None
            ranks = list(range(sv.servers, sv.servers + sv.workers))
            self.service = SchedulerService(
                self.spec_comm, speculation, ranks, sv.time_scale, self.trace, schedules=not sv.dedicated
            )
        between = self._between(server)
        poll = self.service.poll if self.service is not None else None
        with self._on_failure(server):
            run_server(
                server,
                shards.own,
                on_update=self._on_update(),
                until_left=sv.until_left,
                publish_delay=self._publish_delay(),
                between=between,
                poll=poll,
                waiting=self._waiting(server),
            )
            self._served(server)
        if self.service is not None:
            # Every worker says BYE when it leaves; the last leaves after this server stopped under a round policy.
            self.service.close(sv.policy.deadline, tell=sv.until_left)
        self._after(server)

    def schedule(self) -> None:
        """SpecSync's scheduler on a rank of its own (`sync.scheduler=rank`): serve notifies until every worker
        said BYE; what it gives rank 0 at the end: no partial pulls, and its counts and bytes."""
        sv = self.serving
        assert sv.policy.speculation is not None and self.spec_comm is not None
        ranks = list(range(sv.servers, sv.servers + sv.workers))
        service = SchedulerService(self.spec_comm, sv.policy.speculation, ranks, sv.time_scale, None)
        service.serve(sv.policy.deadline)
        self.mine = (0, service.summary())

    def close(self, timeout: float | None = None) -> bool:
        """Collective: free the windows and the communicators. No `finally: close()` around a run: freeing is
        collective, and after a failure the other ranks are not there to join it (cli._fail aborts the world).
        `timeout`: a rank not there by then (a lost worker) leaves everything to the exit. Whether all was freed."""
        if self.shards is not None and not self.shards.close(while_waiting=self.answering, timeout=timeout):
            return False
        if self.spec_comm is not None:
            self.spec_comm.Free()
        if self.states is not None:
            self.states.free()
        if self.train_comm is not self.comm:
            self.train_comm.Free()
        return True

    # -- the hooks: collsync.torch's own; collsync-train's in runs.shards.ShardRun ------------------------------

    def _open_more(self) -> None:
        """Collective, after the shards' windows: nothing more for collsync.torch."""

    def _open_states(self) -> ShardStates | None:
        """Worker 0 (world rank M) asks for the states, when the script saves them."""
        return ShardStates(self.comm, self.serving.servers, asker=self.serving.servers, dup=False)

    def _start(self, server: Server) -> None:
        """Where this shard starts: the saved state it was given (`server_state`), if any."""
        sv, shards = self.serving, self.shards
        assert shards is not None
        if sv.state is not None:
            if len(sv.state) != sv.servers:
                raise ValueError(f"server_state: {len(sv.state)} shard state(s) for {sv.servers} server(s)")
            # Gradients the saved run's workers had sent for a round to come belong to that run: these workers
            # send their own.
            server.load_state_dict({**sv.state[shards.rank], "pending": {}})

    def _on_update(self) -> Callable[[Server], None] | None:
        """Called after each update (collsync-train's evaluation); nothing here."""
        return None

    def _between(self, server: Server) -> Callable[[Server], None] | None:
        """The server loop's hook between two messages: answers to worker 0's requests for the state (also while
        the server waits to close)."""
        states = self.states
        assert states is not None
        self.answering = lambda: states.answer(server.version, server.state_dict)
        return lambda s: states.answer(s.version, s.state_dict)

    def _publish_delay(self) -> float:
        """Seconds this shard stays busy after each update (collsync-train's injected slow server); none here."""
        return 0.0

    def _on_failure(self, server: Server) -> contextlib.AbstractContextManager[Any]:
        """Around the server loop: an error aborts the world (the front's own); collsync-train keeps what was
        trained first."""
        return contextlib.nullcontext()

    def _waiting(self, server: Server) -> Callable[[list[int]], None] | None:
        """Called once training is over while workers are still out (`lost.close_serving`); none here."""
        return None

    def _served(self, server: Server) -> None:
        """Inside the failure guard, once the server loop ended: nothing here."""

    def _after(self, server: Server) -> None:
        """Once the scheduler closed: nothing here."""
