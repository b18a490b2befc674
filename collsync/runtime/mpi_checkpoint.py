"""Checkpoints of several parameter-server shards (`runtime=mpi`, `runtime.servers >= 2`): rank 0 writes one file
holding every shard's state, each taken at one version, while the shards go on serving.

    rank 0, at version v:   ask(v + 1)  -- a few bytes (`isend`) to each shard j >= 1 -->
    shard j:                between two of its messages, once its version is >= v + 1: its state (pickled) --> 0
    rank 0:                 its own state at v + 1; the replies as they come, between its own messages; then write

Why the shards agree at v + 1 under a round policy (bsp, backup): a shard at version u + 1 has every worker's
gradient of round u, computed on version u of every block, so no shard is more than one round ahead of another;
asked at v + 1 none has gone past it, and each takes its state on reaching it. The workers' next gradients are for
round v + 1 on version v + 1 of every block, so a resumed run recomputes exactly what the uninterrupted one did and
ends bit for bit equal to it. Under a stream policy (async, ssp, psp) the states are of nearby versions, which is
as good as any other moment of an asynchronous run. Either way each shard's `received` counts say which gradients
it has: a resumed worker sends block j of its k-th gradient only if shard j had fewer than k + 1 from it
(`ShardedMailbox.resume`), so no gradient is lost or applied twice.

A shard that finished training sends its final state once (`TAG_LAST`, a blocking send that rank 0 takes between
its messages or at its own end) and is asked nothing more. The messages go on a `Dup` of the shards' world, so
they can never match anything else.

The same class answers `collsync.torch`'s `DistributedOptimizer.server_state_dict()`: there the one who asks is
worker 0 (`asker`, not a shard), who asks every shard for its state *now* (`now()`: `TAG_NOW`), and each shard
answers between two of its messages or while it waits to close (`answer`). Worker 0 builds its end when it asks,
so that end is not collective: the messages then go on the API's world itself (`dup=False`), where the only other
point-to-point messages are the servers' jobs (`collsync.torch._serve.TAG_JOB`, a tag of its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpi4py import MPI

TAG_ASK = 1  # asker -> shard j: your state at this version, please
TAG_STATE = 2  # shard j -> asker: my state (the answer)
TAG_LAST = 3  # shard j -> asker: my final state; ask me nothing more
TAG_NOW = 4  # asker -> shard j: your state now, please (collsync.torch's server_state_dict)
TAG_NOW_STATE = 5  # shard j -> asker: my state now

State = dict[str, Any]


class ShardStates:
    """Both ends of the state messages over the shards' world (shards are ranks 0..servers-1). `asker`: the rank
    that gathers the states (rank 0, shard 0 itself, under collsync-train; worker 0 under collsync.torch).
    Collective at construction and at `free` with `dup` (the default); with `dup=False` neither is."""

    def __init__(self, world: MPI.Comm, servers: int, asker: int = 0, *, dup: bool = True) -> None:
        self.comm = world.Dup() if dup else world
        self.dup = dup
        self.rank, self.servers, self.asker = world.Get_rank(), servers, asker
        self.others = [j for j in range(servers) if j != asker]  # the shards that send their states to the asker
        self.target: int | None = None  # asker: the version of the checkpoint being gathered
        self.got: dict[int, State] = {}  # asker: the replies to it so far, by shard
        self.last: dict[int, State] = {}  # asker: the final states of shards that finished
        self._sends: list[Any] = []
        self._asked: list[int] = []  # shard j: the versions the asker asked for, not answered yet

    # -- the asker ---------------------------------------------------------------------------------------------

    def ask(self, version: int) -> None:
        """Start gathering every other shard's state at `version`."""
        self.target, self.got = version, {}
        for j in self.others:
            if j in self.last:
                self.got[j] = self.last[j]
            else:
                self._sends.append(self.comm.isend(version, dest=j, tag=TAG_ASK))

    def collect(self) -> list[State] | None:
        """Take the replies that came (without waiting). Returns the other shards' states once all are in (and
        ends that gathering), else None."""
        from mpi4py import MPI  # lazily: collsync's modules import without an MPI library

        status = MPI.Status()
        for j in self.others:
            while j not in self.last and self._probe(j, status):
                tag = status.Get_tag()
                state = self.comm.recv(source=j, tag=tag)
                if tag == TAG_LAST:
                    self.last[j] = state
                if self.target is not None:
                    self.got[j] = state
        self._sends = [s for s in self._sends if not s.Test()]
        if self.target is None or len(self.got) < len(self.others):
            return None
        self.target = None
        return [self.got[j] for j in self.others]

    def _probe(self, j: int, status: MPI.Status) -> bool:
        """A reply to an ask, or a final state, from shard j is waiting."""
        return any(self.comm.Iprobe(source=j, tag=tag, status=status) for tag in (TAG_STATE, TAG_LAST))

    def finish(self, timeout: float, while_waiting: Callable[[], None] | None = None) -> None:
        """The asker at its end: take every shard's final state (they send it as they end), waiting at most
        `timeout` seconds for the last of them."""
        end = time.monotonic() + timeout
        while len(self.last) < len(self.others):
            self.collect()
            if len(self.last) == len(self.others):
                break
            if time.monotonic() > end:
                missing = [j for j in self.others if j not in self.last]
                raise TimeoutError(f"checkpoint: server rank(s) {missing} sent no final state within {timeout:.0f}s")
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.001)

    def now(self, while_waiting: Callable[[], None] | None = None) -> list[State]:
        """Every other shard's state as it is now, in shard order (each taken between two of its messages).
        `while_waiting()` runs between polls (a shard whose training ended may wait for the asker to leave before
        it answers from its shutdown)."""
        for j in self.others:
            self.comm.send(None, dest=j, tag=TAG_NOW)
        states = []
        for j in self.others:
            while not self.comm.Iprobe(source=j, tag=TAG_NOW_STATE):
                if while_waiting is not None:
                    while_waiting()
                time.sleep(0.001)  # a blocking receive would spin on a shared core
            states.append(self.comm.recv(source=j, tag=TAG_NOW_STATE))
        return states

    # -- shard j -----------------------------------------------------------------------------------------------

    def answer(self, version: int, state: Callable[[], State]) -> None:
        """Between two messages (shard j): answer a request for the state now; read the asker's asks and once
        `version` reaches one, send `state()`."""
        while self.comm.Iprobe(source=self.asker, tag=TAG_NOW):
            self.comm.recv(source=self.asker, tag=TAG_NOW)
            self.comm.send(state(), dest=self.asker, tag=TAG_NOW_STATE)
        while self.comm.Iprobe(source=self.asker, tag=TAG_ASK):
            self._asked.append(self.comm.recv(source=self.asker, tag=TAG_ASK))
        if self._asked and version >= min(self._asked):
            self.comm.send(state(), dest=self.asker, tag=TAG_STATE)
            self._asked = [v for v in self._asked if v > version]

    def send_last(self, state: State) -> None:
        """Shard j at its end: its final state, which also answers any ask still open."""
        self.comm.send(state, dest=self.asker, tag=TAG_LAST)

    def free(self) -> None:
        """Collective (with `dup`): after the shards' final barrier, when no message is in flight."""
        if self.dup:
            self.comm.Free()
