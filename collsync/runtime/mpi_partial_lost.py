"""Ranks lost by the k-of-n partial allreduce (`mpi_partial`), and how the others go on without them.

A rank that stops between rounds (SIGSTOP, a hung host) takes no more tickets and reads no more rounds. The
others go on while they can, up to `depth` rounds ahead, and then wait at the gate for it to read. With
`tolerate` = t > 0 (backup workers: t = b, 000_...'s N of N + b gradients still come without b of them), a rank
whose gate waited `timeout` seconds for ranks declares them lost instead of failing, as long as at most t are lost
in all:

* lost[r] <- the round r was to read next (`Fetch_and_op(MAX)`: idempotent, so several ranks may declare it);
  the one whose answer was -1 says so in one line (rank, host, round);
* the lowest live rank then reads for each lost one: for every round it has read itself from lost[r] on, it takes
  r's ticket (after the round is complete, so the arrival arithmetic of later rounds in that ring entry holds, as
  for a rank that is always late) and moves read[r] on, so the gate lets the others reuse the ring;
* a round's quorum still comes from the live ranks; a margin stops waiting once every live rank arrived.

A lost rank that comes back (SIGCONT) finds lost[rank] set at its next call and stops with `RankLost` rather than
take tickets already taken for it. Limits: a rank stopped *inside* a round it counts in (its block of the sum not
done) makes that round fail after `timeout` naming it, as before; the host of the windows (rank `host`) must not
be the lost one across nodes (its memory serves the others; on one node MPICH's shared-memory windows go on).
At the end the ranks first meet through flags (`leave_live`), not a barrier: one that never comes is lost there too
(within `tolerate`), and with any rank lost the windows are left to the process's exit (freeing them is collective).

Under ULFM (`watch=True`: Open MPI 5's `mpirun --with-ft ulfm`) a rank that *dies* is not waited for at all: every
wait's pause checks `mpi_ulfm.Watch`, which raises MPI's process-failure error within a pause of the death, wherever
the rank died (inside a round it counts in too). The object cannot go on after that; the caller shrinks the world
(revoking `comms()` too) and makes a new one on the ranks left (`runs.partial_ulfm`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from collsync import keepalive
from collsync.runtime import mpi_ulfm
from collsync.runtime.mpi_windows import Backoff
from collsync.runtime.mpi_world import RankLost
from collsync.say import say


class LostRanks:
    """The lost-rank side of `PartialWindows` (see the module docstring); words at `_lost_at` and `_left` (n each)."""

    MPI: Any
    size: int
    rank: int
    round: int
    timeout: float | None
    tolerate: int
    lost: dict[int, int]
    _proxied: dict[int, int]
    _hosts: list[str]
    _who: str
    _lost_at: int
    _left: int
    _read: int
    _waited: int
    _full_comm: Any
    msgs: Any
    watch: mpi_ulfm.Watch | None
    _backoff: Backoff

    if TYPE_CHECKING:  # PartialWindows' atomics and layout

        def _fetch(self, disp: int, value: int, op: Any) -> int: ...
        def _load(self, disp: int) -> int: ...
        def _store(self, disp: int, value: int) -> None: ...
        def _store_read(self, rank: int, value: int) -> None: ...
        def _load_many(self, disp: int, count: int) -> Any: ...
        def _entry_at(self, round_: int) -> int: ...
        def _bit(self, rank: int) -> int: ...

    def _watching(self, comm: Any, watch: bool) -> Callable[[], None] | None:
        """The failure detector's check (None without `watch`); made before the windows, as collectively."""
        self.watch = mpi_ulfm.Watch(comm) if watch else None
        return None if self.watch is None else self.watch.check

    def _free_comms(self) -> None:
        """Collective (every rank alive): free the duplicates of `comm` (the messages', the full rounds', the
        watch's)."""
        if self.msgs is not None:
            self.msgs.free()
        if self._full_comm != self.MPI.COMM_NULL:  # freed already (mpi4py sets the handle to COMM_NULL)
            self._full_comm.Free()
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def comms(self) -> list[Any]:
        """The communicators this object waits on besides `comm` (its duplicates): what a rank that saw a failure
        revokes (`mpi_ulfm.shrink`), so that no survivor stays inside one."""
        extra = [self._full_comm] + ([] if self.msgs is None else [self.msgs.comm, self.msgs.deliveries.comm])
        return extra + ([] if self.watch is None else [self.watch.comm])

    def host_of(self, rank: int) -> str:
        return self._hosts[rank]

    def _lose(self, late: Sequence[int], read: Sequence[int], round_: int) -> bool:
        """The gate waited `timeout` for `late`: declare them lost if at most `tolerate` are then lost (True: wait
        again, the lowest live rank reads for them); False: more than tolerated, fail as before."""
        self._learn_lost()
        fresh = [r for r in late if r not in self.lost]
        if not late or len(self.lost) + len(fresh) > self.tolerate:
            return False
        for r in fresh:
            if self._fetch(self._lost_at + r, int(read[r]), self.MPI.MAX) < 0:
                say(
                    f"{self._who}: partial allreduce: rank {r} on {self._hosts[r]} is lost (it has not read round "
                    f"{int(read[r])} for {keepalive.patience(self.timeout)}s, round {round_} waits on it); going on "
                    f"without it (up to {self.tolerate} lost)"
                )
        self._learn_lost()
        self._read_for_lost()
        return True

    def _learn_lost(self) -> None:
        """Bring `lost` (rank -> the round it was to read next) up to date from the words."""
        words = self._load_many(self._lost_at, self.size)
        self.lost.update({r: int(w) for r, w in enumerate(words.tolist()) if w >= 0})

    def _read_for_lost(self) -> None:
        """On the lowest live rank: each lost rank's ticket for every round this rank has read, and its read[]."""
        if not self.lost or self.rank != min(r for r in range(self.size) if r not in self.lost):
            return
        for r, since in self.lost.items():
            upto = self._proxied.get(r, since)
            for u in range(upto, self.round):  # complete rounds (read here): the ticket lands after their close
                self._fetch(self._entry_at(u), self._bit(r), self.MPI.SUM)
            if upto < self.round:
                self._store_read(r, self.round)
                self._proxied[r] = self.round

    def _check_not_lost(self) -> None:
        """A rank the others declared lost must not take part again (its tickets were taken for it)."""
        since = self._load(self._lost_at + self.rank)
        if since >= 0:
            raise RankLost(
                f"{self._who}: partial allreduce: the other ranks went on without this rank from round {since} (it "
                f"was silent for {self.timeout}s); it cannot rejoin: end it, or restart the run"
            )

    def leave_live(self) -> list[int]:
        """At the end, before the collective close: mark this rank done (left[rank] <- 1) and wait until every rank
        not lost is, so none leaves while another still reads the windows. After `timeout`, ranks still missing are
        declared lost if at most `tolerate` are then lost (else `RankLost` names them). Returns the lost ranks: none,
        and the caller may close collectively; some, and the windows are left to the process's exit."""
        self._store(self._left + self.rank, 1)
        start = time.monotonic()
        backoff = Backoff(cap=0.01, check=self._backoff.check)
        while True:
            self._learn_lost()
            left = self._load_many(self._left, self.size).tolist()
            missing = [r for r in range(self.size) if not left[r] and r not in self.lost]
            if not missing:
                return sorted(self.lost)
            timeout = keepalive.patience(self.timeout)  # shorter once the launcher said that a rank died
            if timeout is not None and time.monotonic() - start >= timeout:
                read = self._load_many(self._read, self.size).tolist()
                if not self._lose(missing, read, self.round):
                    late = ", ".join(f"rank {r} on {self._hosts[r]}" for r in missing)
                    raise RankLost(f"{self._who}: partial allreduce: {late} never came to the end ({timeout}s)")
                start = time.monotonic()
            backoff.wait()

    def _roll_call(self, round_: int) -> str:
        """After a full round's allreduce timed out here: mark this rank as alive and waiting, give the others up to
        `timeout` to do the same, and name the ranks that never posted the round or never answered."""
        self._store(self._waited + self.rank, round_)
        deadline = time.monotonic() + (self.timeout or 0.0)
        backoff = Backoff(cap=0.01, check=self._backoff.check)
        while True:
            read = self._load_many(self._read, self.size)
            waited = self._load_many(self._waited, self.size)
            # Not waiting in round_ and not past it (read[r] is a lower bound): not there, or stopped inside it.
            silent = [r for r in range(self.size) if waited[r] < round_ and read[r] <= round_]
            if not silent or time.monotonic() >= deadline:
                break
            backoff.wait()
        cause = (
            "; waiting on "
            + ", ".join(f"rank {r} on {self._hosts[r]}" for r in silent)
            + " (not in the allreduce, or stopped inside it)"
            if silent
            else ": every rank is waiting inside it (MPI made no progress, or ranks disagree on the quorum)"
        )
        return (
            f"{self._who}: partial allreduce: round {round_} (all {self.size} ranks: an allreduce) did not complete "
            f"after timeout={self.timeout}s" + cause
        )
