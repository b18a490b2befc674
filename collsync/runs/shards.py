"""collsync-train `runtime=mpi`: parameter-server shards on MPI windows (ranks 0..M-1 each serve one block of the
flat parameters, the other ranks are workers), and SpecSync's scheduler in rank 0's server loop or on a rank of its
own, the last (`sync.scheduler=rank`).

`ShardRun` is the engine both fronts share (`collsync.serving.ShardEngine`) with the trainer's extras handed in
through its hooks: the evaluation, the checkpoints, the trace, the slow shard; `work()` for a worker rank; and
`finish()`, where rank 0 writes the run folder. `run_shards` runs every rank through it.

Ranks here are those of `launch.comm`, `collsync.torch.init`'s world, which puts the servers first (spread over the
hosts by default: `collsync.runtime.placement`); summary.json names them as the launcher does (`named_rank`), and
its `hosts` lists each rank's host by the launcher's rank.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from collsync import ending
from collsync.checkpoint import Keeper
from collsync.checks import check_trace
from collsync.evaluate import Evaluator
from collsync.loops import Worker, run_worker
from collsync.lost import grace, silence_bound
from collsync.rundir import save_incomplete, write_run
from collsync.runs.delays import injected
from collsync.runs.parts import Launch, keep_on_failure, make_server, progress, scheduler_ranks
from collsync.runs.resume import checkpoints, rank0_keeper, restore, resume_counts, shard_parts, shard_state
from collsync.runtime.mpi_checkpoint import ShardStates
from collsync.runtime.mpi_shards import TAG_END, gather_within
from collsync.runtime.mpi_specsync import SchedulerService, Speculator, install_safe_points
from collsync.runtime.mpi_world import open_mpi
from collsync.runtime.placement import launch_order, named_rank
from collsync.runtime.watchdog import agree_on_the_end, worker_watchdog
from collsync.server import Server
from collsync.serving import Serving, ShardEngine, State
from collsync.trace import Trace

if TYPE_CHECKING:
    from mpi4py import MPI


class ShardRun(ShardEngine):
    """collsync-train's rank in a sharded run: the engine, with the trainer's extras handed in through its hooks
    (the evaluation, the checkpoints, the trace, the slow shard and the run folder), `work()` for a worker rank,
    and `finish()`: gathers, closes, and rank 0 writes the run folder."""

    def __init__(self, comm: MPI.Comm, serving: Serving, launch: Launch) -> None:
        super().__init__(comm, serving)
        self.launch = launch
        self.trace: Trace = Trace()
        self.saved: State | None = None  # rank 0: the checkpoint it resumes from
        self.keeper: Keeper | None = None
        self.have: list[tuple[list[int], list[int]]] | None = None  # each shard's counts, to resume the workers
        self.resumed: State | None = None  # shard j >= 1: its part of the checkpoint
        self.evaluate: Evaluator | None = None
        self.speculator: Speculator | None = None
        self.served = False  # this shard's final state was sent (shard j) or taken (rank 0)
        self.evaluated = False  # rank 0 of several shards: the final evaluation was recorded

    # -- the engine's hooks ---------------------------------------------------------------------------------------

    def _open_more(self) -> None:
        # Rank 0 keeps the checkpoints and tells each worker where it resumes: after the last gradient each shard
        # got from it, so none is lost or applied twice (rank 0 reads the checkpoint; the others are sent their
        # part: no shared file system).
        self.keeper, self.saved = rank0_keeper(self.launch)
        self.have = self.comm.bcast(None if self.saved is None else resume_counts(self.saved), root=0)

    def _open_states(self) -> ShardStates | None:
        if self.serving.servers <= 1:
            return None
        states = ShardStates(self.train_comm, self.serving.servers)
        self.resumed = self.train_comm.scatter(shard_parts(self.saved, self.train_comm.Get_size()), root=0)
        return states

    def _start(self, server: Server) -> None:
        """Where this shard starts: rank 0 its evaluator's first point, or the checkpoint; shard j its part."""
        super()._start(server)
        shards = self.shards
        assert shards is not None
        if shards.rank == 0:
            self.evaluate = self._evaluator(self.launch, server)
            if self.saved is not None:
                assert self.keeper is not None
                restore(self.saved, self.keeper, server, self.trace, self.evaluate, shift_clock=True)
            else:
                self.evaluate(server)
        elif self.resumed is not None:
            server.load_state_dict(self.resumed["server"])
            self.trace.resume(self.resumed["events"], shift_clock=True)

    def _on_update(self) -> Callable[[Server], None] | None:
        return self.evaluate

    def _evaluator(self, launch: Launch, server: Server) -> Evaluator:
        """Rank 0's evaluator; with several shards, of the whole model assembled from every shard's last publish."""
        parts, run, shards = launch.parts, launch.parts.run, self.shards
        assert shards is not None
        several = self.serving.servers > 1
        full = launch.flat.params.clone()
        block = shards.block

        def assemble(server: Server) -> tuple[torch.Tensor, torch.Tensor | None]:
            # The other blocks as their servers last published them (their view: theta, or DANA's look-ahead).
            # Not our own shard: it is published only once run_server starts, after the first evaluation.
            shards.snapshot(full)
            full[block] = server.params
            return full, None

        bar = progress(run.steps, run.progress)
        return Evaluator(
            launch.flat,
            parts.data,
            self.trace,
            run.eval_every,
            bar,
            assemble=assemble if several else None,
            final_later=several,
            guard_loss=run.guard_limit,
        )

    def _between(self, server: Server) -> Callable[[Server], None] | None:
        """Checkpoints between two messages."""
        return checkpoints(self.keeper, self.states, self.trace, self.evaluate)

    def _publish_delay(self) -> float:
        """A slow server (`stragglers=slow_server`, injected): seconds the slow shard stays busy after each update."""
        launch, shards = self.launch, self.shards
        if launch.sampler is None or shards is None:
            return 0.0
        model = launch.parts.stragglers
        return model.slow_server * launch.parts.runtime.time_scale if shards.rank == model.shard else 0.0

    def _on_failure(self, server: Server) -> contextlib.AbstractContextManager[Any]:
        """A worker stopped, hung or died, or training diverged: rank 0 keeps what was trained before the error
        ends the run."""
        launch, shards, trace, evaluate = self.launch, self.shards, self.trace, self.evaluate
        assert shards is not None
        parts = launch.parts

        def save(why: str) -> None:
            at = evaluate.evaluate_at if evaluate is not None else None
            hosts = {"hosts": launch_order(launch.comm, launch.hosts)}
            save_incomplete(
                launch.out_dir, trace, parts.policy, server, parts.config, why, shards=shards, evaluate=at, extra=hosts
            )

        return keep_on_failure(save if shards.rank == 0 else None, grace(parts.policy.deadline))

    def _waiting(self, server: Server) -> Callable[[list[int]], None] | None:
        """Training is over but workers are still out (stopped, cut off, or mid-step), and the wait for them may
        last until the deadline: rank 0 writes the run folder now (shard j >= 1 sends it its final state first), so
        that what was trained never waits on them, nor on whatever ends the job meanwhile."""
        shards = self.shards
        assert shards is not None
        if shards.rank > 0:
            return lambda out: self._served(server)
        return lambda out: self._write_trained(server, out)

    def _write_trained(self, server: Server, out: list[int]) -> None:
        """Rank 0, while workers `out` are still waited for: the whole run folder, `waiting_on` naming them in
        summary.json; `finish()` writes it again once they stopped or were lost."""
        launch, shards, parts = self.launch, self.shards, self.launch.parts
        assert shards is not None
        self._served(server)  # several shards: their final states, which hold their blocks
        params, ema = self._trained(server)
        waiting_on = [{"rank": r, "host": h} for r, h in (shards.own.locate(w) for w in out)]
        extra = {"hosts": launch_order(launch.comm, launch.hosts), "waiting_on": waiting_on}
        write_run(launch.out_dir, self.trace, parts.policy, server, parts.config, params=params, ema=ema, extra=extra)
        named = ", ".join(f"rank {x['rank']} on {x['host']}" for x in waiting_on)
        deadline = parts.policy.deadline
        until = "for ever (sync.deadline=null)" if deadline is None else f"up to deadline={deadline:g}s, then lost"
        logging.getLogger("collsync.train").warning(
            "training is over and the run folder written; waiting for worker(s) %s to stop, %s", named, until
        )

    def _trained(self, server: Server) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole model once training is over: this shard's block, then the others' from their final states
        (several shards: evaluated here, the evaluator leaves the final point to its caller)."""
        if self.states is None:
            return server.params, server.ema
        others = [self.states.last[j]["server"] for j in self.states.others]
        params = torch.cat([server.params, *(s["params"] for s in others)])
        ema = None if server.ema is None else torch.cat([server.ema, *(s["ema"] for s in others)])
        self._evaluate_final(server.version, params, ema)
        return params, ema

    def _evaluate_final(self, version: int, params: torch.Tensor, ema: torch.Tensor | None) -> None:
        """Several shards: the final evaluation of the assembled model, once (the run folder may be written twice)."""
        assert self.evaluate is not None
        if not self.evaluated:
            self.evaluate.evaluate_at(version, params, ema)
            self.evaluated = True

    def _served(self, server: Server) -> None:
        """Every shard's final state reaches rank 0 (several shards), once: at the end of the server loop, or
        earlier where workers were still out once training was over (`_waiting`)."""
        shards = self.shards
        assert shards is not None
        if self.states is not None and not self.served:
            self.served = True
            if shards.rank > 0:
                self.states.send_last(shard_state(server, self.trace))
            else:
                self.states.finish(grace(self.serving.policy.deadline))  # the others' final states: sends complete

    def _after(self, server: Server) -> None:
        """The bar closed, and what this shard gives rank 0 at the end: its block, EMA, version and counts."""
        if self.evaluate is not None and self.evaluate.progress is not None:
            self.evaluate.progress.close()
        applies = self.trace.of("apply")
        # Each shard's own clock starts at the (collective) window creation: close enough to compare shards.
        counts: dict[str, Any] = dict(check_trace(self.trace, self.serving.policy, self.serving.workers))
        counts["last_update_s"] = applies[-1]["t"] if applies else 0.0
        self.mine = (server.params, server.ema, server.version, counts)

    # -- a worker rank ------------------------------------------------------------------

    def work(self) -> None:
        """A worker (collsync-train): pull, compute, push until every shard is done."""
        launch, shards, sv = self.launch, self.shards, self.serving
        assert shards is not None
        policy, spec = sv.policy, launch.parts.runtime
        # A worker gives up on a silent server after twice the deadline the server gives its workers, plus the time
        # rank 0 may take to write the run folder after its own deadline fired (it publishes nothing meanwhile).
        silence = silence_bound(policy.deadline)
        mailbox = shards.worker_mailbox(policy.pull_fraction, policy.pull_timeout, silence)
        worker = Worker(mailbox.worker, policy, seed=launch.parts.run.seed)
        if self.have is not None:
            # Go on from the shard that has the fewest of this worker's gradients, in the round it was at there.
            received = [counts[mailbox.worker] for counts, _ in self.have]
            worker.steps = mailbox.resume(received)
            worker.clock = self.have[received.index(worker.steps)][1][mailbox.worker]
        wait, check = 0.0, None
        if policy.speculation is not None:
            assert self.spec_comm is not None
            scheduler = self.comm.Get_size() - 1 if sv.dedicated else 0
            self.speculator = Speculator(self.spec_comm, mailbox.worker, scheduler, spec.time_scale, mailbox.peek)
            install_safe_points(launch.flat.module, self.speculator.check)  # abort between layers
            wait, check = policy.speculation.wait * spec.time_scale, self.speculator.check  # ... and in a delay
        grads = launch.grads
        if launch.sampler is not None:
            grads = injected(grads, launch.sampler, spec.time_scale, lambda: mailbox.peek().done, check)
        with worker_watchdog(shards.mailboxes, self.comm.Get_rank(), silence):
            run_worker(worker, mailbox, grads, torch.empty_like(launch.flat.params), self.speculator, wait)
        if self.speculator is not None:
            self.speculator.close(policy.deadline)
            moved = (mailbox.bytes_pushed, mailbox.bytes_fetched, self.speculator.resync_bytes)
            self.mine = (mailbox.partial_reads, moved)
        else:
            self.mine = (mailbox.partial_reads, None)

    # -- the end ------------------------------------------------------------------------------------------------

    def finish(self) -> dict[str, Any] | None:
        """collsync-train, every rank: rank 0 gathers the shards' blocks and counts, the workers' partial pulls and
        SpecSync's bytes; then every rank closes, and rank 0 writes the run folder (returns its summary)."""
        servers = self.serving.servers
        serving = self.shards is not None and self.shards.serving
        # Never waits for a lost worker: those rank 0's server lost are skipped, the others bounded by the grace.
        deadline = self.serving.policy.deadline
        bound = None if deadline is None else grace(deadline)
        skip = [servers + w for w in self.server.lost] if self.server is not None else []
        blocks = gather_within(self.comm, self.mine if serving else self.mine[0], bound, servers, skip) or []
        specsync = None
        if self.spec_comm is not None:
            gathered = gather_within(self.comm, None if serving else self.mine[1], bound, servers, skip, TAG_END + 1)
            if self.service is not None:
                moved = [b for b in gathered or [] if isinstance(b, tuple)]
                remote = next((b for b in gathered or [] if isinstance(b, dict)), None)  # a scheduler rank's own
                specsync = specsync_summary(self.service, moved, remote)
        # A rank gone: rank 0 tells the others; none frees the windows (collective: it would touch the rank gone).
        gone = agree_on_the_end(self.comm, blocks, bool(skip), bound, before=deadline or 0.0)
        closed = False if gone else self.close(timeout=bound)
        if not closed:  # no MPI_Finalize (it waits for the rank gone); under MPICH the others wait for rank 0's abort
            ending.leave_at_exit(linger=0.0 if open_mpi() or self.comm.Get_rank() == 0 else 2 * grace(deadline))
        if self.comm.Get_rank() != 0:
            return None
        server, launch, trace = self.server, self.launch, self.trace
        assert server is not None and self.shards is not None
        if not closed and not open_mpi():  # Open MPI's abort under --enable-recovery ends this rank alone
            ending.abort_at_exit(self.comm)
        lost = lost_workers(trace, [r for r, b in enumerate(blocks) if b is None], launch.hosts, self.comm)
        params = torch.cat([b[0] for b in blocks[:servers]])
        ema = None if server.ema is None else torch.cat([b[1] for b in blocks[:servers]])
        extra: dict[str, Any] = {}
        if servers > 1:
            self._evaluate_final(server.version, params, ema)
            bounds = self.shards.bounds
            extra["shards"] = [
                {"rank": named_rank(self.comm, j), "params": list(bounds[j]), **b[3]}
                for j, b in enumerate(blocks[:servers])
            ]
            extra["partial_pulls"] = sum(b for b in blocks[servers:] if b is not None)  # reads without every shard
        if specsync is not None:
            extra["specsync"] = specsync
        extra["hosts"] = launch_order(launch.comm, launch.hosts)
        if lost:
            extra["lost"] = lost
        parts = launch.parts
        return write_run(launch.out_dir, trace, parts.policy, server, parts.config, params=params, ema=ema, extra=extra)


def run_shards(launch: Launch) -> dict[str, Any] | None:
    """collsync-train `runtime=mpi`: this rank's part (server, worker or SpecSync's scheduler), then the end."""
    parts, flat = launch.parts, launch.flat
    serving = Serving(
        numel=flat.numel,
        dtype=flat.params.dtype,
        servers=parts.runtime.servers,
        workers=launch.workers,
        policy=parts.policy,
        server=lambda block, trace: make_server(parts, flat, launch.workers, trace or Trace(), block),
        time_scale=parts.runtime.time_scale,
        dedicated=bool(scheduler_ranks(parts)),
    )
    run = ShardRun(launch.comm, serving, launch)
    run.open()
    if run.scheduling:
        run.schedule()
    elif run.shards is not None and run.shards.serving:
        run.serve()
    else:
        run.work()
    return run.finish()


def lost_workers(trace: Trace, silent: list[int], hosts: list[str], comm: Any = None) -> list[dict[str, Any]]:
    """The summary's `lost`: each worker the server lost (its `lost` event: rank, host, last update it was part
    of), then each rank of `comm` that did not answer at the end (no last update known: null); both by the
    launcher's rank (the events record it so already: `WindowMailbox.locate`)."""
    lost = [ending.lost_rank(e["rank"], e["host"], e["last_update"]) for e in trace.of("lost")]
    known = {e["rank"] for e in lost}
    lost += [ending.lost_rank(named_rank(comm, r), hosts[r], None) for r in silent if named_rank(comm, r) not in known]
    return lost


def specsync_summary(
    service: SchedulerService, moved: list[tuple[int, int, int]], remote: dict[str, Any] | None
) -> dict[str, Any]:
    """SpecSync's counts and the Fig. 13 bytes: the workers' pushes, pulls and re-sync pulls (every shard), and the
    notify / re-sync / abort messages. `remote`: the scheduler's counts when it has a rank of its own (rank 0 then
    counted only the abort reports)."""
    pushed, fetched, resync = (sum(b[k] for b in moved) for k in range(3))
    info = service.summary()
    notify = info.pop("message_bytes")
    if remote is not None:
        notify += remote.pop("message_bytes")
        info = {**remote, "aborts": info["aborts"], "wasted_s": info["wasted_s"]}
        info["resyncs_ignored"] = info["resyncs"] - info["aborts"]
    return {**info, "bytes": {"push": pushed, "pull": fetched - resync, "resync_pull": resync, "notify": notify}}
