"""Transports. The interfaces here import no MPI; each runtime module imports its transport lazily.

A `Mailbox` connects workers to a parameter server (MPI one-sided windows); a `Collective` averages across all
ranks (MPI collectives, Horovod); a `Partial` averages the first k of n (the partial allreduce on windows).
Runtimes move tensors and nothing else: what a tensor means is decided by `collsync.loops`, `collsync.server` and
`collsync.rules`. (The simulator, `collsync.sim`, is no transport: it drives `Worker` and `Server` itself.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:  # annotations only: `collsync.runtime.startup` and `spec` load before torch (collsync-train)
    from collsync.types import Arrival, Flat, Stamp


class WorkerMailbox(Protocol):
    """A worker's side of a `Mailbox`: `read` and `send` (all that `loops.pull`, `push` and `run_worker` use, and
    all that a sharded worker's `ShardedMailbox` offers). `bytes_fetched` counts the parameter bytes read so far."""

    @property
    def bytes_fetched(self) -> int: ...

    def read(self, out: Flat, ready: Callable[[Stamp], bool], fetch: bool = True) -> Stamp:
        """Block until the published stamp satisfies `ready`, then copy the published parameters into `out`
        (unless `fetch` is False: B-FASGD skipped this fetch, only the stamp is read)."""
        ...

    def send(self, arrival: Arrival, *, read_next: bool = False) -> None:
        """Hand a gradient to the server (returns once the buffer may be reused); `arrival.grad` None sends only
        the header (a skipped B-FASGD push). `read_next`: the caller's next call is a `read` (a mailbox may leave
        the end of the send to that read's first round trip)."""
        ...


class Mailbox(WorkerMailbox, Protocol):
    """Both sides: a worker's `read` and `send`; the server's `recv`, `publish` and `close` (a server loop needs the
    few more of `ServingMailbox`)."""

    def recv(self, timeout: float | None = None) -> Arrival | None:
        """The next gradient, or None if none came within `timeout` seconds."""
        ...

    def publish(self, params: Flat, stamp: Stamp) -> None:
        """Make `params` at `stamp` what the next `read` returns (never a torn mix of two versions)."""
        ...

    def close(self, timeout: float | None = None, lost: Sequence[int] = ()) -> list[Arrival]:
        """After the final (done) publish: wait for every worker but the `lost` ones to stop (at most `timeout`
        seconds, then a `TimeoutError` naming the workers still out); return gradients still in flight."""
        ...


class ServingMailbox(Mailbox, Protocol):
    """The server side of a `Mailbox` as `loops.run_server` drives it."""

    def recycle(self, grad: Flat | None) -> None:
        """A received gradient the server no longer holds (`Server.holds`): its buffer may take a later receive (so
        whoever keeps an arrival past `Server.accept` keeps a copy)."""
        ...

    def describe(self, workers: list[int]) -> str:
        """How errors name these workers (e.g. by rank and host)."""
        ...

    def departed(self) -> list[int]:
        """The workers that left (their script's loop ended) or read the final `done`."""
        ...

    def away(self) -> list[int]:
        """The workers that said they push nothing for now (a script's worker waiting in another collective)."""
        ...

    def locate(self, worker: int) -> tuple[int | None, str | None]:
        """Where this worker runs: its rank and host, where known (a lost worker's trace event records them)."""
        ...

    def lose(self, worker: int) -> None:
        """The server lost this worker (`Server.lose`): send it nothing more but the end (a transport that sends
        versions unasked would otherwise fill its buffers with ones nobody receives)."""
        ...


class Collective(Protocol):
    """All-rank averaging for the serverless full-sync path."""

    rank: int
    size: int

    def allreduce_mean(self, flat: Flat) -> Flat: ...

    def broadcast(self, flat: Flat, root: int = 0) -> Flat: ...


class PartialResult(NamedTuple):
    """The outcome of round `round` of a k-of-n partial allreduce, identical (bit for bit) on every rank."""

    mean: Flat
    round: int
    quorum: int
    contributors: list[int]
    dropped: list[int]


class Partial(Protocol):
    """A k-of-n partial allreduce (`runtime.mpi_partial.PartialAllreduce`), as `rounds.BackupRounds` drives it."""

    rank: int
    size: int

    def __call__(self, tensor: Flat, quorum: int, round: int) -> PartialResult: ...

    def try_read(self, quorum: int, round: int) -> PartialResult | None: ...

    def stop_reading(self) -> None:
        """The caller reads no further round for now (it computes, or its epoch ended): complete what its reads
        left to the next one (`PartialAllreduce.try_read`'s deferred tickets and read counter), so that a rank
        stopped from here on leaves the others' accounting of it whole."""
        ...
