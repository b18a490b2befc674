"""The serverless runs: every rank a worker holding a replica of the server, one skeleton with the step as its
argument. `runtime=allreduce` (full sync, BSP): the mean of every rank's gradient from (bucketed) allreduces.
`runtime=partial` (backup workers, 000_... Alg. 3-4): rounds through a k-of-n partial allreduce, the first
`quorum` gradients of round t averaged and the later ones dropped."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collsync import ending
from collsync.data import Batches
from collsync.evaluate import Evaluator
from collsync.loops import GradFn, Gradients, run_allreduce
from collsync.lost import grace, regroup
from collsync.rounds import run_partial, tolerated
from collsync.rundir import write_run
from collsync.runs.delays import injected
from collsync.runs.partial_ulfm import InPlace, rank0_lost
from collsync.runs.parts import Launch, keep_on_failure, make_server, progress
from collsync.runs.resume import replicas_resume
from collsync.runtime import mpi_ulfm
from collsync.runtime.mpi_buckets import BucketReducer
from collsync.runtime.mpi_coll import MpiCollective, shutdown
from collsync.runtime.mpi_partial import PartialAllreduce
from collsync.runtime.mpi_ulfm import Shrunk
from collsync.runtime.mpi_world import open_mpi
from collsync.server import Server
from collsync.trace import Trace

OnUpdate = Callable[[Server], None] | None


@dataclass
class Step:
    """What differs between the serverless runs: the gradients each rank computes, the training loop, what is
    freed (collectively) before rank 0 writes the run folder and what ends the run after it."""

    grads: GradFn
    train: Callable[[Server, GradFn, OnUpdate], Any]
    free: Callable[[], None]
    shutdown: Callable[[], None]  # the other ranks sleep, rather than spin in MPI, while rank 0 writes
    evaluates_first: bool  # rank 0 evaluates the starting point (not after a resume)
    lost: list[dict[str, Any]] = field(default_factory=list)  # ranks the others finished without (`free` finds them)
    up_to_all: bool = False  # a round may take every gradient (backup's margin: those that came within it)


def allreduce_step(launch: Launch) -> Step:
    """Full sync: the mean from (bucketed) allreduces; a stopped or dead rank ends the run at `sync.deadline`
    rather than hang every other one. Under ULFM a dead rank is shrunk away instead and the others go on from the
    same step (`_follow`)."""
    spec, grads, deadline = launch.parts.runtime, launch.grads, launch.parts.policy.deadline
    coll = MpiCollective(launch.comm, deadline)
    reducer = None
    if launch.sampler is not None:
        # An injected delay must hold this rank's gradient back, so the reduction follows it (no overlap).
        grads = injected(grads, launch.sampler, spec.time_scale, lambda: False)
    elif spec.bucket_mib > 0:
        # Gradient buckets are reduced while the backward pass runs; the mean is ready when it returns.
        bucket_bytes = max(1, int(spec.bucket_mib * 2**20))
        reducer = BucketReducer(launch.comm, launch.flat.buffer, bucket_bytes, eager=True, deadline=deadline)
        grads = reducer.averaged(grads)
    averaged = reducer is not None
    lost: list[dict[str, Any]] = []
    held: list[Server] = []
    if reducer is not None and reducer.ulfm:
        reducer.on_shrink.append(_follow(launch, coll, held, lost))

    def train(server: Server, grads: GradFn, on_update: OnUpdate) -> None:
        held.append(server)
        run_allreduce(server, coll, grads, on_update=on_update, averaged=averaged)

    return Step(grads, train, lambda: None, (reducer or coll).shutdown, evaluates_first=False, lost=lost)


def _follow(
    launch: Launch, coll: MpiCollective, held: list[Server], lost: list[dict[str, Any]]
) -> Callable[[Shrunk], None]:
    """`runtime=allreduce` under ULFM: the reducer shrank the world after a rank died (`mpi_ulfm`), and the run goes
    on with the n' ranks left from the same step, as `collsync-run` would relaunch it but with nothing read back
    or computed again: the replica regroups (`lost` and `world` events, the quorum of n'), the data follows
    `data.Batches` with n' workers (worker w's j-th batch, j the step), the world's communicator is the
    survivors', and the summary lists the rank in `lost`. Rank 0 evaluates, checkpoints and writes the run folder:
    without it the run ends in one line (`partial_ulfm.rank0_lost`), for `collsync-run` to relaunch."""

    def follow(shrunk: Shrunk) -> None:
        server, hosts, old = held[0], launch.hosts, launch.comm
        if 0 in shrunk.lost:
            rank0_lost(shrunk, hosts[0])
        gone = [hosts[r] for r in shrunk.lost]
        lost.extend(ending.lost_rank(r, h, server.contributed[r]) for r, h in zip(shrunk.lost, gone, strict=True))
        regroup(server, shrunk.lost, shrunk.lost, gone)
        n = shrunk.comm.Get_size()
        launch.hosts = [h for r, h in enumerate(hosts) if r not in shrunk.lost]
        launch.comm, launch.workers = shrunk.comm, n
        coll.comm, coll.rank, coll.size = shrunk.comm, shrunk.comm.Get_rank(), n
        if isinstance(launch.grads, Gradients):
            run = launch.parts.run
            launch.grads.batches = Batches(launch.parts.data, n, run.batch_size, run.seed)
        if launch.shrunk is not None:
            launch.shrunk(old, shrunk.comm)
        if shrunk.comm.Get_rank() == 0:
            named = ", ".join(f"rank {r} on {h}" for r, h in zip(shrunk.lost, gone, strict=True))
            logging.getLogger("collsync.train").warning(
                "%s died; going on in place with %d of %d ranks from step %d (ULFM: nothing read back or recomputed)",
                named,
                n,
                shrunk.was,
                server.version,
            )

    return follow


def partial_step(launch: Launch) -> Step:
    """Backup workers: rounds of a k-of-n partial allreduce (`runtime.depth`, `runtime.margin`), driven as
    `collsync.torch` drives them (`rounds`: a late rank catches up unless `runtime.catch_up=false`), and a rank
    silent for the deadline lost while at most `backups` are: the others finish without it, `lost` in the summary."""
    parts, flat, grads = launch.parts, launch.flat, launch.grads
    spec, policy = parts.runtime, parts.policy
    if launch.sampler is not None:
        # A frozen rank never comes back here: the others go on while it is within `depth` rounds, then wait for it
        # (for at most sync.deadline, then it is lost, or the run fails naming it).
        grads = injected(grads, launch.sampler, spec.time_scale, lambda: False, rank=launch.comm.Get_rank())
    ulfm = launch.workers > 1 and mpi_ulfm.enabled()

    def make(comm: Any) -> PartialAllreduce:
        return PartialAllreduce(
            comm,
            flat.numel,
            dtype=flat.params.dtype,
            depth=spec.depth,
            timeout=policy.deadline,
            margin=spec.margin,
            tolerate=tolerated(policy, comm.Get_size()),
            watch=ulfm,
            protocol=spec.protocol,
        )

    lost: list[dict[str, Any]] = []
    # Under ULFM a dead rank is shrunk away and the others go on from the same step with a new partial allreduce.
    shrinking = InPlace(launch, make, lost) if ulfm else None
    fixed = [make(launch.comm)] if shrinking is None else []

    def current() -> PartialAllreduce:
        return fixed[0] if shrinking is None else shrinking.pa

    base = [0]  # the version the replica started at (a resume): the partial allreduce counts its rounds from it

    def train(server: Server, grads: GradFn, on_update: OnUpdate) -> None:
        base[0] = server.version
        if shrinking is not None:
            shrinking.train(server, grads, on_update, spec.catch_up is not False)
        else:
            run_partial(server, current(), grads, on_update=on_update, catch_up=spec.catch_up is not False)

    def free() -> None:
        """Collective, unless ranks were lost: then the windows and the world's end are left to the exit."""
        pa = current()
        if shrinking is not None:
            base[0] = shrinking.kept.base
        if pa.tolerate and pa.leave_live():
            lost.extend(ending.lost_rank(r, pa.host_of(r), pa.lost[r] - 1 + base[0]) for r in sorted(pa.lost))
            leave_without(launch)
            return
        pa.free()  # no `finally`: after a failure cli._fail aborts the world

    def end() -> None:
        if not lost:
            shutdown(launch.comm, policy.deadline)  # the end never waits for ever on a lost rank

    margin = spec.margin is not None and policy.quorum_for(launch.workers) < launch.workers
    return Step(grads, train, free, end, evaluates_first=True, lost=lost, up_to_all=margin)


def leave_without(launch: Launch) -> None:
    """Ranks were lost: every rank leaves at exit without `MPI_Finalize` (which would wait for them), and under
    MPICH rank 0 ends the job once the run folder is written (mpiexec would wait for a stopped rank)."""
    rank0 = launch.comm.Get_rank() == 0
    if rank0 and not open_mpi():
        ending.abort_at_exit(launch.comm)
    else:
        ending.leave_at_exit(linger=0.0 if open_mpi() or rank0 else 2 * grace(launch.parts.policy.deadline))


def run_replicas(launch: Launch, step_for: Callable[[Launch], Step]) -> dict[str, Any] | None:
    """Train every replica with `step_for(launch)`'s step; rank 0 evaluates, checkpoints and writes the run
    folder (returns the summary; the other ranks None)."""
    parts, run, flat = launch.parts, launch.parts.run, launch.flat
    rank = launch.comm.Get_rank()
    step = step_for(launch)
    trace = Trace()
    server = make_server(parts, flat, launch.workers, trace)
    bar = progress(run.steps, run.progress and rank == 0)
    evaluate = Evaluator(flat, parts.data, trace, run.eval_every, bar, guard_loss=run.guard_limit)
    update = replicas_resume(launch, server, trace, evaluate)
    hosts = {"hosts": launch.hosts}

    def save(why: str) -> None:
        write_run(launch.out_dir, trace, parts.policy, server, parts.config, extra={"incomplete": why, **hosts})

    with keep_on_failure(save if rank == 0 else None, grace(parts.policy.deadline)):
        if step.evaluates_first and rank == 0 and server.version == 0:
            evaluate(server)
        step.train(server, step.grads, update)
    if bar is not None:
        bar.close()
    step.free()
    extra = {**hosts, **({"lost": step.lost} if step.lost else {})}
    result = None
    if rank == 0:
        result = write_run(
            launch.out_dir, trace, parts.policy, server, parts.config, extra=extra, up_to_all=step.up_to_all
        )
    step.shutdown()
    return result
