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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

TAG_ASK = 1  # rank 0 -> shard j: your state at this version, please
TAG_STATE = 2  # shard j -> rank 0: my state (the answer)
TAG_LAST = 3  # shard j -> rank 0: my final state; ask me nothing more

State = dict[str, Any]


class ShardStates:
    """Both ends of the state messages. Collective at construction and at `free` over the shards' world."""

    def __init__(self, world: Any, servers: int) -> None:
        self.comm = world.Dup()
        self.rank, self.servers = world.Get_rank(), servers
        self.target: int | None = None  # rank 0: the version of the checkpoint being gathered
        self.got: dict[int, State] = {}  # rank 0: the replies to it so far, by shard
        self.last: dict[int, State] = {}  # rank 0: the final states of shards that finished
        self._sends: list[Any] = []
        self._asked: list[int] = []  # shard j: the versions rank 0 asked for, not answered yet

    # -- rank 0 ------------------------------------------------------------------------------------------------

    def ask(self, version: int) -> None:
        """Start gathering every other shard's state at `version` (rank 0)."""
        self.target, self.got = version, {}
        for j in range(1, self.servers):
            if j in self.last:
                self.got[j] = self.last[j]
            else:
                self._sends.append(self.comm.isend(version, dest=j, tag=TAG_ASK))

    def collect(self) -> list[State] | None:
        """Take the replies that came (rank 0, without waiting). Returns shards 1..M-1's states once all are in
        (and ends that gathering), else None."""
        status = MPI.Status()
        for j in range(1, self.servers):
            while j not in self.last and self.comm.Iprobe(source=j, tag=MPI.ANY_TAG, status=status):
                tag = status.Get_tag()
                state = self.comm.recv(source=j, tag=tag)
                if tag == TAG_LAST:
                    self.last[j] = state
                if self.target is not None:
                    self.got[j] = state
        self._sends = [s for s in self._sends if not s.Test()]
        if self.target is None or len(self.got) < self.servers - 1:
            return None
        self.target = None
        return [self.got[j] for j in range(1, self.servers)]

    def finish(self, timeout: float, while_waiting: Callable[[], None] | None = None) -> None:
        """Rank 0 at its end: take every shard's final state (they send it as they end), waiting at most
        `timeout` seconds for the last of them."""
        end = time.monotonic() + timeout
        while len(self.last) < self.servers - 1:
            self.collect()
            if len(self.last) == self.servers - 1:
                break
            if time.monotonic() > end:
                missing = [j for j in range(1, self.servers) if j not in self.last]
                raise TimeoutError(f"checkpoint: server rank(s) {missing} sent no final state within {timeout:.0f}s")
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.001)

    # -- shard j >= 1 ------------------------------------------------------------------------------------------

    def answer(self, version: int, state: Callable[[], State]) -> None:
        """Between two messages (shard j): read rank 0's asks; once `version` reaches one, send `state()`."""
        while self.comm.Iprobe(source=0, tag=TAG_ASK):
            self._asked.append(self.comm.recv(source=0, tag=TAG_ASK))
        if self._asked and version >= min(self._asked):
            self.comm.send(state(), dest=0, tag=TAG_STATE)
            self._asked = [v for v in self._asked if v > version]

    def send_last(self, state: State) -> None:
        """Shard j at its end: its final state, which also answers any ask still open."""
        self.comm.send(state, dest=0, tag=TAG_LAST)

    def free(self) -> None:
        """Collective: after the shards' final barrier, when no message is in flight."""
        self.comm.Free()
