"""A worker lost under ULFM (Open MPI 5's `mpirun --with-ft ulfm`: `runtime.mpi_ulfm`) and first seen by a
collective other than the bsp optimizer's bucketed reduction: a script's own `hvd.allreduce` or `broadcast` inside
`hvd.elastic.run`, or `run`'s `sync()` broadcast.

Survivors may see one failure in different calls (one in the optimizer's reduction, another in the metric's
allreduce that it reached first, a third not at all until its next step), and every one must then make the same
collective calls on the survivors. So the workers' world is shrunk here the way the optimizer's reducer shrinks it
(`BucketReducer.leave`: the same revoke, shrink and agreement on the count of reductions, the same world that
follows), where one is registered; else by `mpi_ulfm.shrink` alone. Either way `mpi_ulfm.Shrank` is raised, which
`hvd.elastic.run` turns into Horovod's `HorovodInternalError`: the last commit restored, the reset callbacks run,
the function called again on the n - 1 left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from collsync.runtime import mpi_ulfm
from collsync.runtime.mpi_world import host_of
from collsync.say import say
from collsync.torch import _world, sampler
from collsync.torch._ops_base import dups, forget

# The bsp optimizer's reducer on the workers' world (`BucketReducer.leave`), while one is there.
LEAVE: list[Callable[..., None]] = []
WHAT = "a collective of the script's"


def failure(error: BaseException) -> bool:
    """Whether `error` is a process failure reported to a collective on the workers' world (`mpi_ulfm.failure`, with
    the world and its duplicates as the communicators it may have run on)."""
    st = _world._STATE
    comms = [] if st is None else [st.comm, *dups(st.comm)]
    return mpi_ulfm.failure(error, *comms)


def shrink_world(error: BaseException) -> NoReturn:
    """After `error`, a process failure reported to a collective on the workers' world: shrink the world to the
    workers left and raise `mpi_ulfm.Shrank`. Where ULFM is off, or `error` is no process failure, `error` itself
    is raised again."""
    if not (mpi_ulfm.enabled() and failure(error)):
        raise error
    st = _world.state("collsync.torch")
    old = st.comm
    also = dups(old)
    if LEAVE:
        LEAVE[-1](error, *also)  # raises Shrank once its own callbacks made the world follow
    shrunk = mpi_ulfm.shrink(old, *also)
    named = ", ".join(f"worker {r} on {host_of(old, r)}" for r in shrunk.lost)
    _world.shrunk(old, shrunk.comm)
    forget(old)
    n, rank = shrunk.comm.Get_size(), shrunk.comm.Get_rank()
    sampler.follow_world(n, rank)
    if rank == 0:
        say(f"collsync: {named} died; going on in place with {n} of {shrunk.was} workers (ULFM)")
    raise mpi_ulfm.Shrank(shrunk, WHAT)


def register(leave: Callable[..., Any]) -> Callable[[], None]:
    """Make `leave` the world's shrink (see the module); returns what undoes it."""
    LEAVE.append(leave)
    return lambda: LEAVE.remove(leave) if leave in LEAVE else None
