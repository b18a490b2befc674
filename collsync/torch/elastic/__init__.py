"""`hvd.elastic`: Horovod's elastic training API (`horovod.torch.elastic`) on collsync.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for data, target in loader:              # loader on state.sampler, an hvd.elastic.ElasticSampler
                ...; state.sampler.record_batch(0, batch_size); state.commit()
            state.sampler.set_epoch(state.epoch + 1)

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    state.register_reset_callbacks([rescale_lr])
    train(state)

Horovod keeps the job's surviving processes alive when a rank fails (its collectives report the failure as
`HorovodInternalError`, `run` restores the last commit, re-forms the world and calls the function again in the same
processes). So does collsync under ULFM (Open MPI 5's `mpirun --with-ft ulfm`: `runtime.mpi_ulfm`): the bsp
`DistributedOptimizer`'s reduction that sees the dead rank shrinks the workers' world to the survivors and raises
`HorovodInternalError` from the step; `run` restores the last commit, runs the reset callbacks (`size()` is n - 1
by then) and calls the function again, whose `sync()` makes every rank rank 0's; an `ElasticSampler` in the state
deals what the commit had not processed among the n - 1. Nothing is relaunched; the steps since the last commit are
computed again.

What differs from Horovod, and why: MPICH and Open MPI without ULFM end the whole job when a rank dies. So there
`commit()` also writes the commit to a file (rank 0, atomically: `collsync.torch.elastic._commit`), `collsync-run`
relaunches the script on the ranks left with that folder in `COLLSYNC_ELASTIC_DIR`, and `run` starts the relaunched
job from the last commit: rank 0 reads it, the reset callbacks run (the world changed), and `sync()` broadcasts it
from rank 0 so every rank starts equal; an `ElasticSampler` in the state deals out only the samples the commit had
not processed. What is recomputed is the work since the last commit, plus the relaunch (start-up, data loading).

Inside one job, `run` keeps Horovod's loop: `HorovodInternalError` (a rank lost under ULFM, or ranks that
disagreed on a collective) restores the last commit, runs the reset callbacks and calls the function again;
`HostsUpdatedInterrupt` (never raised by collsync, which has no host discovery; a script may raise it) does the
same without the restore, and without the sync where it says `skip_sync`. The world cannot grow: `collsync-run`
refuses horovodrun's `--host-discovery-script` and a `--max-np` above `-n`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from collsync.runtime.mpi_ulfm import Shrank
from collsync.say import say
from collsync.torch import _ulfm, _world
from collsync.torch._ops_base import HorovodInternalError, HostsUpdatedInterrupt
from collsync.torch._world import init, shutdown, size
from collsync.torch.elastic.sampler import ElasticSampler
from collsync.torch.elastic.state import ObjectState, State, TorchState

R = TypeVar("R")
# Resets in one job (HorovodInternalError, HostsUpdatedInterrupt) before `run` gives up and raises: besides a rank
# lost under ULFM, collsync's HorovodInternalError is a disagreement on a collective, which calling the function
# again may well repeat, so an endless loop (Horovod's default, bounded there by horovodrun's --reset-limit) would
# hide it.
RESET_LIMIT = 3


def _resume(state: State) -> bool:
    """Start `state` from the commit file of an earlier job, if there is one: rank 0 reads it, every rank learns
    whether it did (and the commit count) from rank 0. Returns whether the run resumed."""
    found = state.load_commit()
    summary = None if found is None else (int(found["commits"]), int(found["size"]))
    summary = state._bcast_object(summary)
    if summary is None:
        return False
    commits, was = summary
    state._commits = commits
    if state._rank() == 0:
        say(
            f"collsync.torch.elastic: rank 0: resumed from commit {commits} (written on {was} rank(s), now "
            f"{size()}) in {state.commit_path}"
        )
    return True


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Horovod's `hvd.elastic.run`: call `func(state, *args, **kwargs)` with every rank's `state` in sync, and
    call it again from the last commit after a reset (see the module docstring). On its first call in a job that
    `collsync-run` relaunched after a lost rank, the state starts from the commit file and the reset callbacks run
    before `func`, as Horovod runs them after a worker was removed."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if not isinstance(state, State):
            raise TypeError(
                f"collsync.torch.elastic.run: {func.__name__}'s first argument must be an hvd.elastic.State "
                f"(TorchState, ObjectState), got {type(state).__name__}"
            )
        if _resume(state):
            state.on_reset()
        world = _world.state("collsync.torch.elastic.run")
        was, world.elastic = world.elastic, True  # a rank lost under ULFM now raises HorovodInternalError here
        try:
            return _loop(func, state, *args, **kwargs)
        finally:
            world.elastic = was

    return wrapper


def _loop(func: Callable[..., R], state: State, *args: Any, **kwargs: Any) -> R:
    """Horovod's loop of `run`: sync, call, and after a reset restore (`HorovodInternalError`), run the reset
    callbacks and go again."""
    skip_sync = False
    resets = 0
    while True:
        try:
            if not skip_sync:
                state.sync()
            return func(state, *args, **kwargs)
        except HorovodInternalError as exc:
            why: BaseException = _restored(state, exc)
            skip_sync = False
        except HostsUpdatedInterrupt as exc:
            skip_sync = exc.skip_sync
            why = exc
        except Exception as exc:
            if not _ulfm.failure(exc):
                raise
            # A rank lost under ULFM, first seen by a collective of the function's own or by sync()'s broadcast.
            try:
                _ulfm.shrink_world(exc)
            except Shrank as shrank:
                internal = HorovodInternalError(f"collsync.torch: worker {_world.rank()}: {shrank}")
                internal.__cause__ = shrank
                why = _restored(state, internal)
            skip_sync = False
        resets += 1
        if resets > RESET_LIMIT:
            raise RuntimeError(
                f"collsync.torch.elastic.run: rank {state._rank()}: {func.__name__} was reset {RESET_LIMIT} "
                f"times in this job and failed again ({type(why).__name__}: {why})"
            ) from why
        state.on_reset()


def _restored(state: State, exc: HorovodInternalError) -> HorovodInternalError:
    """Horovod's answer to `HorovodInternalError`: the last commit restored (one line where a rank was lost)."""
    state.restore()
    if isinstance(exc.__cause__, Shrank) and state._rank() == 0:
        say(
            f"collsync.torch.elastic: rank 0: restored commit {state.commits}; going on in place with {size()} "
            "rank(s) (ULFM)"
        )
    return exc


__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "init",
    "run",
    "shutdown",
]
