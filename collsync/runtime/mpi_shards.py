"""Parameter-server shards: the flat parameters split into M contiguous blocks balanced by size, block j served
from an MPI window on rank j (ranks 0..M-1 serve, ranks M.. are the workers).

Each shard is a `WindowMailbox` with its own server loop, `Server` and version counter: the shards never talk to
one another. A worker sees them through one `ShardedMailbox`, the same `Mailbox` a single server offers:

* read: poll every shard; copy in each block whose shard has the round the worker needs. With PSP's partial pull
  (003_... Alg. 1, worker lines 8-15) the worker goes on once `pull_fraction` of the blocks are in, after waiting
  at most `pull_timeout` seconds more for the rest; for those it takes the newest block their shard published
  (older than the round it needs; with RMA there is no response in flight to wait for), tagged with that version.
  The first read waits for every block: before it the worker has nothing to compute on.
* send: block j of the gradient goes to shard j, tagged with the version of block j the worker computed on (so
  each shard measures staleness against its own counter) and with the worker's round.

Training is over for a worker once every shard has published `done`; a shard that is done gets no more pushes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

    from collsync.policy import Sent

import math
import socket
import time
from collections.abc import Callable, Collection
from typing import Any

import torch

from collsync.runtime.mpi_coll import ShutdownTimeout, shutdown
from collsync.runtime.mpi_rma import WindowMailbox
from collsync.runtime.mpi_windows import Backoff, CountingBackoff, RmaCounts
from collsync.types import Arrival, Flat, Stamp

Bounds = list[tuple[int, int]]


def shard_bounds(numel: int, shards: int) -> Bounds:
    """(start, stop) of each of `shards` contiguous blocks of a `numel`-long vector, sizes differing by at most 1."""
    if not 1 <= shards <= numel:
        raise ValueError(f"runtime: servers={shards} must be between 1 and the {numel} parameters of the model")
    size, extra = divmod(numel, shards)
    bounds, start = [], 0
    for j in range(shards):
        stop = start + size + (1 if j < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def open_shards(
    comm: MPI.Comm,
    numel: int,
    servers: int,
    dtype: torch.dtype = torch.float32,
    sends: Sent | None = None,
) -> list[WindowMailbox]:
    """Collective over `comm`: one mailbox per shard, shard j hosted on rank j, workers = ranks servers.. .
    `sends`: server-sent parameters (`WindowMailbox`; the same on every rank)."""
    size = comm.Get_size()
    if servers >= size:
        raise ValueError(
            f"runtime: {size} rank(s) leave no worker beside servers={servers}; launch at least {servers + 1} ranks"
        )
    workers = list(range(servers, size))
    return [
        WindowMailbox(comm, stop - start, server_rank=j, workers=workers, dtype=dtype, sends=sends)
        for j, (start, stop) in enumerate(shard_bounds(numel, servers))
    ]


class ShardedMailbox:
    """The worker side of M shards as one `Mailbox` (read and send; the servers use their own shard's mailbox)."""

    def __init__(
        self, shards: list[WindowMailbox], bounds: Bounds, pull_fraction: float = 1.0, pull_timeout: float | None = None
    ) -> None:
        if len(shards) != len(bounds) or not shards:
            raise ValueError(f"runtime: {len(shards)} shard mailboxes for {len(bounds)} blocks")
        if shards[0].worker < 0:
            raise ValueError("runtime: a ShardedMailbox is the workers' side; this rank is not a worker")
        self.shards, self.bounds = shards, bounds
        self.worker = shards[0].worker
        # At least one block, and the paper's b% rounded up: b = 90% of 4 shards is 4 blocks, not 3.
        self.need = max(1, math.ceil(pull_fraction * len(shards) - 1e-9))
        self.pull_timeout = pull_timeout
        self.versions = [0] * len(shards)
        self.done = [False] * len(shards)
        self.partial_reads = 0  # reads that went on without every block (PSP's partial pull at work)
        self.sent = 0  # gradients this worker has sent (its k-th goes to shard j only if k >= have[j])
        self.have = [0] * len(shards)  # after a resume: how many of this worker's gradients each shard already has
        self._had = [False] * len(shards)  # blocks this worker has received at least once
        self._backoff = Backoff(cap=shards[0].poll_cap)  # the shards' own (they counted the node's ranks)

    def read(self, out: Flat, ready: Callable[[Stamp], bool], fetch: bool = True) -> Stamp:
        got: dict[int, Stamp] = {}
        enough_since: float | None = None
        self._backoff.reset()
        while True:
            for j, shard in enumerate(self.shards):
                if j not in got:
                    start, stop = self.bounds[j]
                    stamp = shard.try_read(out[start:stop], ready, fetch)
                    if stamp is not None:
                        got[j] = stamp
            live = {j: s for j, s in got.items() if not s.done}
            if len(got) == len(self.shards) and not live:
                self.done = [True] * len(self.shards)
                return Stamp(max(s.version for s in got.values()), True)
            # A block never received holds nothing to compute on: until every shard has been read once, wait for all.
            enough = (
                len(got) >= self.need and live and all(self._had[j] for j in range(len(self.shards)) if j not in got)
            )
            if len(got) == len(self.shards) or (enough and self._waited(enough_since)):
                break
            if enough and enough_since is None:
                enough_since = time.monotonic()
            for j, shard in enumerate(self.shards):
                if j not in got:
                    shard.check_alive()
            self._backoff.wait()
        if len(got) < len(self.shards):
            self.partial_reads += 1
            if fetch:
                # The shards not at the round yet: their newest published block, if it can be had without waiting
                # (with RMA nothing is in flight to wait for), rather than the older one this worker holds.
                for j, shard in enumerate(self.shards):
                    if j not in got and not self.done[j]:
                        start, stop = self.bounds[j]
                        stale = shard.try_read(out[start:stop], lambda _: True, True, window=True)
                        if stale is not None and not stale.done:
                            self.versions[j] = stale.version
        for j, s in got.items():
            self.done[j] = s.done
            self._had[j] = self._had[j] or (fetch and not s.done)
            if not s.done and fetch:
                self.versions[j] = s.version
        # The round the worker may compute next follows the oldest block it just received; each shard's server
        # publishes its own optimizer's signal, and the worker acts on their mean (and that oldest block's closer).
        signal = sum(s.signal for s in live.values()) / len(live)
        oldest = min(live.values(), key=lambda s: s.version)
        return Stamp(oldest.version, False, signal, oldest.closer)

    def count(self, counts: RmaCounts) -> RmaCounts:
        """From now on count this worker's one-sided calls to every shard, and its polls, into `counts` (returned;
        `Windows.count`)."""
        for shard in self.shards:
            shard.count(counts)
        self._backoff = CountingBackoff(self._backoff, counts)
        return counts

    def _waited(self, since: float | None) -> bool:
        if self.pull_timeout is None:
            return True
        return since is not None and time.monotonic() - since >= self.pull_timeout

    def resume(self, have: list[int]) -> int:
        """After a resume from a checkpoint: shard j already has this worker's first `have[j]` gradients (its
        `Server.received`). The worker goes on from the fewest; a block some shard has already is not sent again.
        Returns the number of gradients to count as sent."""
        if len(have) != len(self.shards):
            raise ValueError(f"runtime: {len(have)} resume counts for {len(self.shards)} shards")
        self.have, self.sent = list(have), min(have)
        return self.sent

    def send(self, arrival: Arrival, *, read_next: bool = False) -> None:
        """Block j to shard j: posted to every shard first, then completed shard by shard, so that the round trips
        to the shards overlap (`WindowMailbox.post`, `complete`; `read_next` as there)."""
        k, self.sent = self.sent, self.sent + 1
        posted = []
        for j, shard in enumerate(self.shards):
            if self.done[j] or k < self.have[j]:
                continue  # training is over on that shard, or it had this gradient before the run was resumed
            start, stop = self.bounds[j]
            block = None if arrival.grad is None else arrival.grad[start:stop]
            shard.post(Arrival(arrival.worker, self.versions[j], block, arrival.clock))
            posted.append(shard)
        for shard in posted:
            shard.complete(read_next=read_next)

    def mark_away(self, away: bool) -> None:
        """Every shard is told that this worker pushes nothing for now, or again (see `WindowMailbox.mark_away`)."""
        for shard in self.shards:
            shard.mark_away(away)

    def leave(self) -> None:
        """This worker's training is over: every shard is told (see `WindowMailbox.leave`)."""
        for shard in self.shards:
            shard.leave()

    def peek(self) -> Stamp:
        """Training is over once every shard says so (for polling only)."""
        stamps = [shard.peek() for shard in self.shards]
        return Stamp(min(s.version for s in stamps), all(s.done for s in stamps))

    @property
    def bytes_pushed(self) -> int:
        return sum(shard.bytes_pushed for shard in self.shards)

    @property
    def bytes_fetched(self) -> int:
        return sum(shard.bytes_fetched for shard in self.shards)


def snapshot(shards: list[WindowMailbox], bounds: Bounds, out: Flat) -> Flat:
    """Every shard's last published block copied into `out` (e.g. for evaluation on rank 0 while training runs)."""
    for shard, (start, stop) in zip(shards, bounds, strict=True):
        shard.snapshot(out[start:stop])
    return out


class Shards:
    """The M shards of one model over `world`, as every rank holds them (collective open, collective `close`).

    Ranks 0..M-1 serve: `block` is the slice of the flat parameters this rank serves and `own` its mailbox. The
    other ranks are workers: `worker_mailbox(...)` is their `ShardedMailbox`. `close()` waits (without spinning)
    until every rank is done with the windows, then frees them. `collsync-train runtime=mpi` and the server modes
    of `collsync.torch` both open their shards through this class.
    """

    def __init__(
        self,
        world: MPI.Comm,
        numel: int,
        servers: int,
        dtype: torch.dtype = torch.float32,
        sends: Sent | None = None,
    ) -> None:
        self.world, self.servers = world, servers
        self.bounds = shard_bounds(numel, servers)
        self.mailboxes = open_shards(world, numel, servers, dtype, sends)
        self.rank = world.Get_rank()
        hosts = world.allgather(socket.gethostname())  # so that errors name a worker's host, not just its rank
        for mailbox in self.mailboxes:
            mailbox.hosts = hosts

    @property
    def serving(self) -> bool:
        return self.rank < self.servers

    @property
    def block(self) -> slice:
        start, stop = self.bounds[self.rank]
        return slice(start, stop)

    @property
    def own(self) -> WindowMailbox:
        """The mailbox of the shard this rank serves."""
        return self.mailboxes[self.rank]

    def worker_mailbox(
        self, pull_fraction: float = 1.0, pull_timeout: float | None = None, silence: float | None = None
    ) -> ShardedMailbox:
        """The workers' side. `silence`: how long a worker waits on a server that shows no sign of life before it
        fails naming that server's rank and host (None: for ever)."""
        for mailbox in self.mailboxes:
            mailbox.silence = silence
        return ShardedMailbox(self.mailboxes, self.bounds, pull_fraction, pull_timeout)

    def snapshot(self, out: Flat) -> Flat:
        """The other shards' last published blocks into `out` (this rank's own block left as it is)."""
        others = [j for j in range(self.servers) if j != self.rank]
        return snapshot([self.mailboxes[j] for j in others], [self.bounds[j] for j in others], out)

    def close(self, while_waiting: Callable[[], None] | None = None, timeout: float | None = None) -> bool:
        """Collective over the world: once every rank got here (an Ibarrier polled with pauses), free the windows.
        `while_waiting()` runs between two polls (see `mpi_coll.shutdown`). With a `timeout`: a rank that does not
        come by then (a lost worker) leaves the windows as they are (freeing them is collective: it would wait
        for that rank for ever); the process's exit releases them. Returns whether they were freed."""
        try:
            shutdown(self.world, timeout, while_waiting=while_waiting)
        except ShutdownTimeout:
            return False
        for mailbox in self.mailboxes:
            mailbox.free()
        return True


# Every rank -> rank 0: what it gives at the end of a run (`gather_within`).
TAG_END = 77


def gather_within(
    comm: MPI.Comm, obj: Any, timeout: float | None, first: int = 0, skip: Collection[int] = (), tag: int = TAG_END
) -> list[Any] | None:
    """`comm.gather(obj, root=0)` that never waits for ever on a rank that is gone: the others send without
    waiting for rank 0 to be there, and rank 0 takes ranks 1..`first`-1 first (the servers: what they give may say
    which workers were lost), then each other rank as it comes, for at most `timeout` seconds in all (None: for
    ever), and not at all for the ranks in `skip` (known lost). A rank that did not come is None in the list.
    Returns the list on rank 0, None elsewhere. `tag`: one per gather in a row (a late message is not taken for
    the next gather's)."""
    if comm.Get_rank() != 0:
        request = comm.isend(obj, dest=0, tag=tag)
        backoff, end = Backoff(), None if timeout is None else time.monotonic() + timeout
        while not request.Test() and (end is None or time.monotonic() < end):
            backoff.wait()
        return None
    got: list[Any] = [obj] + [None] * (comm.Get_size() - 1)
    end = None if timeout is None else time.monotonic() + timeout
    for group in (range(1, first), range(max(1, first), comm.Get_size())):
        waiting, backoff = set(group) - set(skip), Backoff()
        while waiting and (end is None or time.monotonic() < end):
            for r in sorted(waiting):
                message = comm.improbe(source=r, tag=tag)
                if message is not None:
                    got[r] = message.recv()
                    waiting.discard(r)
                    backoff.reset()
            backoff.wait()
    return got
