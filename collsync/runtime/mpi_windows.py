"""What the protocols on MPI one-sided windows share: windows held in one `Lock_all` epoch, atomic control words,
and polling with backoff.

Every access to a window, the host's to its own memory included, is an RMA call inside a `Lock_all` epoch opened
once and completed with `Flush`: on MPICH a per-operation `Lock` waits until the target enters MPI, a `Lock_all`
epoch with `Flush` does not, so no rank ever waits for another to call MPI. Control words are int64 and touched
only by atomics (`Fetch_and_op`, `Get_accumulate` / `Accumulate` with NO_OP / REPLACE), so a word is never read
half-written. mpi4py is imported lazily, inside the constructors, so that collsync imports without an MPI library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from collsync.runtime.mpi_world import own_cores

# The longest pause between two polls. Off shared memory (between nodes, or MPICH with MPIR_CVAR_NOLOCAL=1) a
# one-sided operation completes only once its target enters MPI, so every round trip to a rank that is asleep waits
# out its pause: a 4 MiB push ran at 0.27-0.31 of a raw Put with 1 ms pauses on the server, 0.61 with 250 us, 0.74
# with 100 us and 0.86 with 50 us (benchmarks/README.md, "Between nodes"). Where each rank has a core of its own the
# short pause only spends that rank's own idle core; where ranks outnumber cores a waiting rank must leave the core
# to the others, and the long one stays.
POLL_CAP_OWN_CORE = 50e-6
POLL_CAP_SHARED_CORE = 1e-3


def poll_cap(comm: MPI.Comm) -> float:
    """The pause cap for ranks of `comm` polling one-sided windows (collective: counts the ranks on the node)."""
    return POLL_CAP_OWN_CORE if own_cores(comm) else POLL_CAP_SHARED_CORE


class Backoff:
    """Spin briefly, then sleep with growing pauses: ranks share cores, and a busy poll would starve a peer."""

    def __init__(
        self, spins: int = 50, first: float = 20e-6, cap: float = 1e-3, check: Callable[[], None] | None = None
    ) -> None:
        self.spins, self.first, self.cap = spins, first, cap
        # Called at every pause that sleeps: a failure detector (`mpi_ulfm.Watch.check`) raises there, so that no
        # poll of a window waits on a rank that died. Not while spinning: one check costs about 45 us (it runs
        # Open MPI's progress engine), and most waits end within the spins.
        self.check = check
        self.reset()

    def reset(self) -> None:
        self.n, self.pause = 0, self.first

    def wait(self) -> None:
        self.n += 1
        if self.n > self.spins:
            if self.check is not None:
                self.check()
            time.sleep(self.pause)
            self.pause = min(self.cap, self.pause * 2)


_W = TypeVar("_W", bound="Windows")


# The one-sided calls a protocol makes (each one remote operation, the host's to its own memory included) and the
# calls that wait for them: a `Flush` is one blocking round trip to its target, whatever it completes.
_OPS = ("Put", "Get", "Accumulate", "Get_accumulate", "Fetch_and_op", "Compare_and_swap", "Isend", "Irecv")
_FLUSHES = ("Flush", "Flush_all")


@dataclass
class RmaCounts:
    """What the windows of one protocol object did since it was made countable (`Windows.count`): remote operations
    by kind (point-to-point messages among them), blocking round trips (`Flush` calls, waits for a phase of
    messages), and the bytes that `Put`, `Get` and messages moved. A benchmark reads it
    before and after a round (`copy`, `minus`)."""

    ops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_OPS, 0))
    round_trips: int = 0
    data_bytes: int = 0
    waits: int = 0  # polls that found nothing yet (each after one round trip): the rest are the protocol's own
    tests: int = 0  # local tests of posted messages that found them not yet complete (no round trip each)
    # The round trips spent in the tries that a wait followed (a poll may take more than one): `round_trips` less
    # these is the protocol's own, what a round costs when nothing has to be waited for.
    poll_trips: int = 0

    def copy(self) -> RmaCounts:
        return RmaCounts(dict(self.ops), self.round_trips, self.data_bytes, self.waits, self.tests, self.poll_trips)

    def minus(self, before: RmaCounts) -> RmaCounts:
        ops = {k: v - before.ops.get(k, 0) for k, v in self.ops.items()}
        trips, moved = self.round_trips - before.round_trips, self.data_bytes - before.data_bytes
        polls = self.poll_trips - before.poll_trips
        return RmaCounts(ops, trips, moved, self.waits - before.waits, self.tests - before.tests, polls)

    @property
    def remote_ops(self) -> int:
        return sum(self.ops.values())


class CountingWin:
    """A window that counts, into `counts`, every one-sided call made through it and passes it on unchanged.
    Installed only by `Windows.count`: a protocol never asked to count calls its mpi4py windows directly, so the
    counting costs nothing where it is not asked for."""

    def __init__(self, win: Any, counts: RmaCounts) -> None:
        self._win, self._counts = win, counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._win, name)
        counts = self._counts
        if name in _FLUSHES:

            def flush(*args: Any, **kwargs: Any) -> Any:
                counts.round_trips += 1
                return attr(*args, **kwargs)

            return flush
        if name in _OPS:

            def op(*args: Any, **kwargs: Any) -> Any:
                counts.ops[name] += 1
                if name in ("Put", "Get") and isinstance(args[0], (list, tuple)):
                    counts.data_bytes += int(getattr(args[0][0], "nbytes", 0))
                return attr(*args, **kwargs)

            return op
        return attr


class CountingBackoff(Backoff):
    """A `Backoff` whose every pause is counted as one wait (`RmaCounts.waits`), and the round trips made since the
    last pause or reset as a poll's (`RmaCounts.poll_trips`: the try that found nothing); installed by
    `Windows.count`."""

    def __init__(self, backoff: Backoff, counts: RmaCounts) -> None:
        self._counts = counts  # before the base's constructor, whose reset reads it
        super().__init__(backoff.spins, backoff.first, backoff.cap)

    def reset(self) -> None:
        super().reset()
        self._mark = self._counts.round_trips

    def wait(self) -> None:
        counts = self._counts
        counts.waits += 1
        counts.poll_trips += counts.round_trips - self._mark
        super().wait()
        self._mark = counts.round_trips


class Windows:
    """Windows opened in one `Lock_all` epoch each (`self._wins`), freed together: `free()` or a `with` block."""

    comm: MPI.Comm
    _wins: tuple[Any, ...]

    def count(self, counts: RmaCounts) -> RmaCounts:
        """From now on count this object's one-sided calls into `counts` (returned): every `win_*` attribute and the
        window of every `Words` attribute is replaced by a `CountingWin` over it (`_wins`, which `free` closes,
        keeps the windows themselves), and every `Backoff` attribute by a `CountingBackoff`."""
        for name, value in list(vars(self).items()):
            if name.startswith("win_"):
                setattr(self, name, CountingWin(value, counts))
            elif isinstance(value, Words):
                value.win = CountingWin(value.win, counts)
            elif isinstance(value, Backoff):
                setattr(self, name, CountingBackoff(value, counts))
            elif hasattr(value, "count_into"):  # point-to-point messages (`mpi_partial_messages.Messages`)
                value.count_into(counts)
        return counts

    def free(self) -> None:
        """Collective: close the epochs and free the windows."""
        for win in self._wins:
            win.Unlock_all()
        self.comm.Barrier()
        for win in self._wins:
            win.Free()
        self._wins = ()

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._wins:
            self.free()


class Words:
    """The int64 control words of window `win` on rank `target`, each read and written atomically, every access
    completed by its own `Flush` (one round trip each: callers batch neighbouring words with `load_many`)."""

    def __init__(self, win: Any, target: int) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        self.MPI, self.win, self.target = MPI, win, target
        self._val = np.zeros(1, dtype=np.int64)
        self._res = np.zeros(1, dtype=np.int64)
        self._zeros = np.zeros(0, dtype=np.int64)

    def fetch(self, disp: int, value: int, op: Any) -> int:
        """`Fetch_and_op`: apply `op` with `value` to word `disp`; its value before."""
        self._val[0] = value
        self.win.Fetch_and_op(self._val, self._res, self.target, disp, op=op)
        self.win.Flush(self.target)
        return int(self._res[0])

    def load(self, disp: int) -> int:
        return self.fetch(disp, 0, self.MPI.NO_OP)

    def store(self, disp: int, value: int) -> None:
        self.fetch(disp, value, self.MPI.REPLACE)

    def load_many(self, disp: int, out: np.ndarray, flush: bool = True) -> np.ndarray:
        """`len(out)` words from `disp` into `out`, each read atomically, in one `Get_accumulate` (not one round trip
        per word). `flush=False` leaves the `Flush` to the caller, who completes it with other operations."""
        count = len(out)
        if len(self._zeros) < count:
            self._zeros = np.zeros(count, dtype=np.int64)
        self.win.Get_accumulate(
            [self._zeros[:count], self.MPI.INT64_T],
            [out, self.MPI.INT64_T],
            self.target,
            target=(disp, count, self.MPI.INT64_T),
            op=self.MPI.NO_OP,
        )
        if flush:
            self.win.Flush(self.target)
        return out

    def store_many(self, disp: int, values: np.ndarray, flush: bool = True, op: Any = None) -> None:
        """`values` into the words from `disp`, each written atomically, in one `Accumulate(REPLACE)` (or `op`:
        `MPI.MAX` for a counter that only moves on, whichever of several writes lands last)."""
        target = (disp, len(values), self.MPI.INT64_T)
        self.win.Accumulate([values, self.MPI.INT64_T], self.target, target=target, op=op or self.MPI.REPLACE)
        if flush:
            self.win.Flush(self.target)
