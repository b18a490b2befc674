"""Shrinking a communicator in place after a rank died: ULFM (User-Level Failure Mitigation, Bland et al. 2013; the
MPI Forum's fault-tolerance proposal), which Open MPI 5 runs under `mpirun --with-ft ulfm` and mpi4py exposes as
`Comm.Revoke`, `Comm.Shrink` and friends.

A collective that involves a dead process fails on the ranks that notice (`MPI_ERR_PROC_FAILED`); a rank that
noticed revokes the communicator, so that every other rank's pending or next operation on it fails too
(`MPI_ERR_REVOKED`) instead of waiting for a rank that left the collective; every survivor then calls `Shrink`,
which agrees on the survivors and returns a communicator of them alone (in the same order), and collsync goes on
there. ULFM does not make a failed collective uniform: a rank may complete a reduction whose contributions were all
in while another rank of the same reduction fails. So the survivors then exchange how many reductions each
completed (`plan`): those one behind take the mean the others applied (kept by the reducer), and everyone redoes
the reduction still open. MPICH's ch4 reports no process failure to a collective (it hangs), so there the deadlines
apply, as without ULFM.

Errors are returned (`MPI.ERRORS_RETURN`, mpi4py raising them as `MPI.Exception`) on collsync's own communicators
only: what `errors_return` is given.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collsync import ending

if TYPE_CHECKING:
    from mpi4py import MPI

# Open MPI's MCA variable that `mpirun --with-ft ulfm` sets in every rank's environment; `COLLSYNC_ULFM=1` says the
# same for another MPI whose mpi4py has `Comm.Shrink` and which reports process failure (0 turns it off).
FT_ENV, OWN_ENV = "OMPI_MCA_mpi_ft_enable", "COLLSYNC_ULFM"
# How many failures in a row one recovery goes through (a rank dying while the others shrink) before it gives up.
RECOVERIES = 4
NOT_THERE = (
    "a rank died and this MPI cannot shrink the job in place (ULFM is off: under Open MPI 5 launch with "
    "`mpirun --with-ft ulfm`), so the run ends here and `collsync-run` relaunches it on the ranks left"
)


def enabled(env: dict[str, str] | None = None) -> bool:
    """Whether a lost rank can be shrunk away in place: mpi4py has `Comm.Shrink` and the launch turned ULFM on."""
    env = dict(os.environ) if env is None else env
    own = env.get(OWN_ENV, "").strip().lower()
    if own in ("0", "false", "no", "off"):
        return False
    on = own in ("1", "true", "yes", "on") or env.get(FT_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if not on:
        return False
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    return hasattr(MPI.Comm, "Shrink") and hasattr(MPI.Comm, "Revoke")


def errors_return(comm: MPI.Comm) -> MPI.Comm:
    """`comm` with errors returned (raised by mpi4py) rather than fatal; returns it. A predefined communicator
    (COMM_WORLD, `collsync-train`'s) is the application's and is left as it is (mpi4py returns errors there by
    default: `mpi4py.rc.errors`)."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    if comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
        comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


def failure(exc: BaseException | None, *comms: MPI.Comm | None) -> bool:
    """Whether `exc` (or what caused it: a reduction thread's error is re-raised by the waiting thread) is MPI's
    report of a dead process or of a communicator revoked after one. A `Shrank` is not: it is the report of a
    recovery already made. Open MPI's nonblocking collectives (libnbc) report a schedule that met a revoked
    communicator or a dead process as `MPI_ERR_OTHER` ("NBC_Progress: an error 77 was found"), not as its class:
    so any MPI error counts too where one of `comms` (those the failed operation ran on) is revoked or knows of a
    dead process."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    if isinstance(exc, Shrank):
        return False
    classes = {getattr(MPI, name, -1) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")}
    seen, mpi_error = 0, False
    while exc is not None and seen < 8:
        if isinstance(exc, MPI.Exception):
            if exc.Get_error_class() in classes:
                return True
            mpi_error = True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return mpi_error and any(_broken(c) for c in comms)


def _broken(comm: MPI.Comm | None) -> bool:
    """Whether `comm` is revoked or knows of one of its processes dead (ULFM's local knowledge; False without it)."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    if comm is None or comm == MPI.COMM_NULL or not hasattr(comm, "Is_revoked"):
        return False
    try:
        if comm.Is_revoked():
            return True
        failed = comm.Get_failed()
    except MPI.Exception:
        return True  # the query itself failing on a communicator that worked before: it is one a failure broke
    try:
        return bool(failed.Get_size())
    finally:
        if failed != MPI.GROUP_EMPTY:
            failed.Free()


@dataclass(frozen=True)
class Plan:
    """What the survivors do after a shrink, from how many reductions each had completed (`plan`)."""

    step: int  # the reduction every survivor is at once the plan is carried out (the most completed)
    behind: list[int] = field(default_factory=list)  # new ranks one reduction behind: they take `root`'s last mean
    root: int = 0  # the lowest new rank that completed `step` reductions (it sends the last mean to `behind`)


def plan(completed: list[int]) -> Plan:
    """The survivors' agreement on the step, from each survivor's count of completed reductions (by new rank). A
    reduction completes only once every rank contributed, so no two survivors can be more than one apart: those
    one behind take the mean the others completed (and applied), and then all redo the reduction still open."""
    if not completed:
        raise ValueError("mpi_ulfm.plan: no survivor")
    low, high = min(completed), max(completed)
    if high - low > 1:
        raise ValueError(f"mpi_ulfm.plan: survivors {high - low} reductions apart ({completed}); at most 1 can be")
    behind = [r for r, c in enumerate(completed) if c < high]
    return Plan(high, behind, completed.index(high))


@dataclass(frozen=True)
class Shrunk:
    """A communicator shrunk after a failure: the survivors' one, and the ranks of the old one that died."""

    comm: Any
    lost: list[int]
    was: int


class Shrank(RuntimeError):  # noqa: N818 - it reports a recovery made, not an error of its own
    """Raised by a reduction that shrank its communicator after a failure and, asked not to do the open reduction
    again (`BucketReducer.redo`), left it: the caller rolls back instead (`hvd.elastic` restores its last commit).
    `shrunk` is what the shrink made."""

    def __init__(self, shrunk: Shrunk, what: str) -> None:
        named = ", ".join(str(r) for r in shrunk.lost)
        super().__init__(
            f"{what}: rank(s) {named} of {shrunk.was} died; the {shrunk.comm.Get_size()} left shrank the "
            "communicator in place (ULFM) and left the reduction under way"
        )
        self.shrunk = shrunk


def shrink(comm: MPI.Comm, *also: MPI.Comm | None) -> Shrunk:
    """Revoke `comm` (and the communicators in `also`: duplicates of it a thread waits on), then `Shrink` it:
    collective over the survivors, each of which must call it after noticing the failure."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    for c in (*also, comm):
        if c is not None and c != MPI.COMM_NULL:
            try:
                c.Revoke()
            except MPI.Exception:
                pass  # revoked already (by another rank): what was wanted
    new = errors_return(comm.Shrink())
    # MPI_Finalize at exit can wait for ever in Open MPI's ULFM once a rank died (seen: the survivors spinning in
    # `ompi_mpi_finalize` after the run folder was written); a rank lost ends every survivor as `ending` leaves.
    ending.leave_at_exit()
    old = comm.Get_group()
    kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), old)
    lost = sorted(set(range(comm.Get_size())) - set(kept))
    return Shrunk(new, lost, comm.Get_size())


class Watch:
    """A failure detector for waits that no collective reports to: a poll of one-sided windows (the partial
    allreduce's) sees nothing when a rank dies, and Open MPI's ULFM updates a process's own list of failed ranks
    only while its progress engine runs. So a receive from any rank that never comes is posted on a duplicate of
    `comm`, and `check()` (called at every pause of such a poll: `mpi_windows.Backoff`) tests it, which runs the
    progress engine, and reads `Get_failed`: once a rank of `comm` died it raises `MPI.Exception`
    (`MPI_ERR_PROC_FAILED`), as a collective would, within a pause of the death (measured: about 10 ms)."""

    def __init__(self, comm: MPI.Comm) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        self.MPI = MPI
        self.comm = comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._buf = bytearray(1)
        self._request = self.comm.Irecv([self._buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=0)

    def check(self) -> None:
        """Raise `MPI.Exception` (a process failure) once a rank of the communicator is known to have died."""
        self._request.Test()  # raises MPI_ERR_PROC_FAILED_PENDING where the receive itself sees the failure
        failed = self.comm.Get_failed()
        try:
            count = failed.Get_size()
        finally:
            if failed != self.MPI.GROUP_EMPTY:
                failed.Free()
        if count:
            raise self.MPI.Exception(self.MPI.ERR_PROC_FAILED)

    def close(self) -> None:
        """Collective, with every rank alive (after a failure the watch is left to the process's exit)."""
        self._request.Cancel()
        self._request.Wait()
        self.comm.Free()


def recovering(
    attempt: Callable[[], Any], recover: Callable[[BaseException], None], comms: Callable[[], list[Any]] = list
) -> Any:
    """`attempt()`; after a process failure it raises, `recover(error)` then `attempt()` again (a failure inside
    `recover`, another rank dying meanwhile, is recovered from the same way), at most `RECOVERIES` times; any other
    error, and a failure past that, goes on up. `comms()` names the communicators the attempt runs on at the time
    (see `failure`)."""
    error: BaseException | None = None
    for _ in range(RECOVERIES + 1):
        try:
            if error is not None:
                recover(error)
            return attempt()
        except Exception as exc:  # noqa: BLE001 - only MPI's failure reports are handled, the rest re-raised
            if not failure(exc, *comms()):
                raise
            error = exc
    assert error is not None
    raise error
