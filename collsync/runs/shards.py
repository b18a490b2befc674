"""Parameter-server shards on MPI windows: ranks 0..M-1 each serve one block of the flat parameters, the other
ranks are workers (`runtime=mpi`), and SpecSync's scheduler runs in rank 0's server loop or on a rank of its own,
the last (`sync.scheduler=rank`).

`ShardRun` is one rank's part in such a run, for both fronts: `collsync-train runtime=mpi` runs every rank through
it (`run_shards`), and `collsync.torch`'s server ranks serve through the same `open()` and `serve()` (their
workers are the user's `DistributedOptimizer`). `Serving` says what is served; the `Launch` of a collsync-train
run adds what only it has: the evaluation, the checkpoints, the trace and the run folder.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from collsync import ending
from collsync.checkpoint import Keeper
from collsync.checks import check_trace
from collsync.evaluate import Evaluator
from collsync.loops import Worker, run_server, run_worker
from collsync.lost import grace, silence_bound
from collsync.policy import SyncPolicy
from collsync.rundir import save_incomplete, write_run
from collsync.runs.delays import injected
from collsync.runs.parts import Launch, keep_on_failure, make_server, progress, scheduler_ranks
from collsync.runs.resume import checkpoints, rank0_keeper, restore, resume_counts, shard_parts, shard_state
from collsync.runtime.mpi_checkpoint import ShardStates
from collsync.runtime.mpi_shards import TAG_END, Shards, gather_within
from collsync.runtime.mpi_specsync import SchedulerService, Speculator, install_safe_points
from collsync.runtime.mpi_world import open_mpi
from collsync.runtime.watchdog import agree_on_the_end, worker_watchdog
from collsync.server import Server
from collsync.trace import Trace

if TYPE_CHECKING:
    from mpi4py import MPI

State = dict[str, Any]


@dataclass
class Serving:
    """What the server ranks serve, whichever front launched them. `server(block, trace)`: this rank's `Server`
    of its block of the parameters. `time_scale`: wall seconds per second of SpecSync's clock. `dedicated`:
    SpecSync's scheduler has a rank of its own (the last). `until_left`: serve until every worker left, and tell
    each the scheduler's counts (collsync.torch), rather than until `steps`. `state`: one `Server.state_dict()`
    per shard to go on from (collsync.torch's `server_state`)."""

    numel: int
    dtype: torch.dtype
    servers: int
    workers: int
    policy: SyncPolicy
    server: Callable[[slice, Trace | None], Server]
    time_scale: float = 1.0
    dedicated: bool = False
    until_left: bool = False
    state: list[State] | None = None


class ShardRun:
    """One rank's part in a sharded run: `open()` (collective), then `serve()`, `work()` or `schedule()` by role,
    then `finish()` (collsync-train: gathers, closes, and rank 0 writes the run folder) or `close()`."""

    def __init__(self, comm: MPI.Comm, serving: Serving, launch: Launch | None = None) -> None:
        self.comm, self.serving, self.launch = comm, serving, launch
        self.trace = Trace() if launch is not None else None
        self.train_comm: MPI.Comm = comm
        self.spec_comm: MPI.Comm | None = None
        self.shards: Shards | None = None
        self.states: ShardStates | None = None
        self.scheduling = False  # this rank is SpecSync's scheduler (sync.scheduler=rank)
        self.saved: State | None = None  # rank 0: the checkpoint it resumes from
        self.keeper: Keeper | None = None
        self.have: list[tuple[list[int], list[int]]] | None = None  # each shard's counts, to resume the workers
        self.resumed: State | None = None  # shard j >= 1: its part of the checkpoint
        self.server: Server | None = None
        self.evaluate: Evaluator | None = None
        self.service: SchedulerService | None = None
        self.speculator: Speculator | None = None
        self.mine: Any = None  # what this rank gives rank 0 at the end
        self.answering: Callable[[], None] | None = None  # a server's answer to state requests while it closes
        self.served = False  # collsync-train: this shard's final state was sent (shard j) or taken (rank 0)
        self.evaluated = False  # rank 0 of several shards: the final evaluation was recorded

    def open(self) -> None:
        """Collective over the world: the shards' windows, SpecSync's communicator, the state messages, and where
        each rank resumes (rank 0 reads the checkpoint; the others are sent their part: no shared file system)."""
        sv, comm = self.serving, self.comm
        rank, size = comm.Get_rank(), comm.Get_size()
        # SpecSync's scheduler on a rank of its own (the last) stays out of the shards' windows.
        self.scheduling = sv.dedicated and rank == size - 1
        if sv.dedicated:
            self.train_comm = comm.Split(int(self.scheduling), rank)
        if not self.scheduling:
            self.shards = Shards(self.train_comm, sv.numel, sv.servers, sv.dtype)
        if self.launch is not None:
            # Rank 0 keeps the checkpoints and tells each worker where it resumes: after the last gradient each
            # shard got from it, so none is lost or applied twice.
            self.keeper, self.saved = rank0_keeper(self.launch)
            self.have = comm.bcast(None if self.saved is None else resume_counts(self.saved), root=0)
        self.spec_comm = comm.Dup() if sv.policy.speculation is not None else None
        if self.scheduling:
            return
        if self.launch is None:
            # collsync.torch: worker 0 (world rank M) asks for the states, when the script saves them.
            self.states = ShardStates(comm, sv.servers, asker=sv.servers, dup=False)
        elif sv.servers > 1:
            self.states = ShardStates(self.train_comm, sv.servers)
            self.resumed = self.train_comm.scatter(shard_parts(self.saved, self.train_comm.Get_size()), root=0)

    # -- a server rank -------------------------------------------------------------------------------------------

    def serve(self) -> None:
        """Serve this rank's shard until training ends (with `until_left`: until every worker left)."""
        sv, shards = self.serving, self.shards
        assert shards is not None and shards.serving, "serve(): this rank serves no shard"
        server = self.server = sv.server(shards.block, self.trace)
        self._start(server)
        speculation = sv.policy.speculation
        if speculation is not None and shards.rank == 0:
            assert self.spec_comm is not None
            ranks = list(range(sv.servers, sv.servers + sv.workers))
            self.service = SchedulerService(
                self.spec_comm, speculation, ranks, sv.time_scale, self.trace, schedules=not sv.dedicated
            )
        between = self._between(server)
        poll = self.service.poll if self.service is not None else None
        with self._on_failure(server):
            run_server(
                server,
                shards.own,
                on_update=self.evaluate,
                until_left=sv.until_left,
                publish_delay=self._publish_delay(),
                between=between,
                poll=poll,
                waiting=self._waiting(server),
            )
            self._served(server)
        if self.service is not None:
            # Every worker says BYE when it leaves; the last leaves after this server stopped under a round policy.
            self.service.close(sv.policy.deadline, tell=sv.until_left)
        if self.evaluate is not None and self.evaluate.progress is not None:
            self.evaluate.progress.close()
        if self.trace is not None:
            applies = self.trace.of("apply")
            # Each shard's own clock starts at the (collective) window creation: close enough to compare shards.
            counts: dict[str, Any] = dict(check_trace(self.trace, sv.policy, sv.workers))
            counts["last_update_s"] = applies[-1]["t"] if applies else 0.0
            self.mine = (server.params, server.ema, server.version, counts)

    def _start(self, server: Server) -> None:
        """Where this shard starts: a saved state, or (rank 0 of collsync-train) its evaluator's first point."""
        sv, launch, shards = self.serving, self.launch, self.shards
        assert shards is not None
        if sv.state is not None:
            if len(sv.state) != sv.servers:
                raise ValueError(f"server_state: {len(sv.state)} shard state(s) for {sv.servers} server(s)")
            # Gradients the saved run's workers had sent for a round to come belong to that run: these workers
            # send their own.
            server.load_state_dict({**sv.state[shards.rank], "pending": {}})
        if launch is None or self.trace is None:
            return
        if shards.rank == 0:
            self.evaluate = self._evaluator(launch, server)
            if self.saved is not None:
                assert self.keeper is not None
                restore(self.saved, self.keeper, server, self.trace, self.evaluate, shift_clock=True)
            else:
                self.evaluate(server)
        elif self.resumed is not None:
            server.load_state_dict(self.resumed["server"])
            self.trace.resume(self.resumed["events"], shift_clock=True)

    def _evaluator(self, launch: Launch, server: Server) -> Evaluator:
        """Rank 0's evaluator; with several shards, of the whole model assembled from every shard's last publish."""
        parts, run, shards = launch.parts, launch.parts.run, self.shards
        assert shards is not None and self.trace is not None
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
        """The server loop's hook between two messages: checkpoints (collsync-train), or answers to worker 0's
        requests for the state (collsync.torch: also while the server waits to close)."""
        if self.launch is not None:
            assert self.trace is not None
            return checkpoints(self.keeper, self.states, self.trace, self.evaluate)
        states = self.states
        assert states is not None
        self.answering = lambda: states.answer(server.version, server.state_dict)
        return lambda s: states.answer(s.version, s.state_dict)

    def _publish_delay(self) -> float:
        """A slow server (`stragglers=slow_server`, injected): seconds the slow shard stays busy after each update."""
        launch, shards = self.launch, self.shards
        if launch is None or launch.sampler is None or shards is None:
            return 0.0
        model = launch.parts.stragglers
        return model.slow_server * launch.parts.runtime.time_scale if shards.rank == model.shard else 0.0

    def _waiting(self, server: Server) -> Callable[[list[int]], None] | None:
        """collsync-train: training is over but workers are still out (stopped, cut off, or mid-step), and the wait
        for them may last until the deadline: rank 0 writes the run folder now (shard j >= 1 sends it its final
        state first), so that what was trained never waits on them, nor on whatever ends the job meanwhile."""
        shards = self.shards
        assert shards is not None
        if self.launch is None:
            return None
        if shards.rank > 0:
            return lambda out: self._served(server)
        return lambda out: self._write_trained(server, out)

    def _write_trained(self, server: Server, out: list[int]) -> None:
        """Rank 0, while workers `out` are still waited for: the whole run folder, `waiting_on` naming them in
        summary.json; `finish()` writes it again once they stopped or were lost."""
        launch, shards, trace = self.launch, self.shards, self.trace
        assert launch is not None and shards is not None and trace is not None
        parts = launch.parts
        self._served(server)  # several shards: their final states, which hold their blocks
        params, ema = self._trained(server)
        waiting_on = [{"rank": r, "host": h} for r, h in (shards.own.locate(w) for w in out)]
        extra = {"hosts": launch.hosts, "waiting_on": waiting_on}
        write_run(launch.out_dir, trace, parts.policy, server, parts.config, params=params, ema=ema, extra=extra)
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
        """collsync-train: every shard's final state reaches rank 0 (several shards), once: at the end of the
        server loop, or earlier where workers were still out once training was over (`_waiting`)."""
        shards = self.shards
        assert shards is not None
        if self.launch is None or self.states is None or self.served:
            return
        self.served = True
        if shards.rank > 0:
            assert self.trace is not None
            self.states.send_last(shard_state(server, self.trace))
        else:
            self.states.finish(grace(self.serving.policy.deadline))  # the others' final states: their sends complete

    def _on_failure(self, server: Server) -> contextlib.AbstractContextManager[Any]:
        """A worker stopped, hung or died, or training diverged: rank 0 keeps what was trained before the error
        ends the run (collsync-train; collsync.torch's server ranks abort the world at once)."""
        launch, shards, trace = self.launch, self.shards, self.trace
        if launch is None or shards is None or trace is None:
            return contextlib.nullcontext()
        parts, evaluate = launch.parts, self.evaluate

        def save(why: str) -> None:
            at = evaluate.evaluate_at if evaluate is not None else None
            hosts = {"hosts": launch.hosts}
            save_incomplete(
                launch.out_dir, trace, parts.policy, server, parts.config, why, shards=shards, evaluate=at, extra=hosts
            )

        return keep_on_failure(save if shards.rank == 0 else None, grace(parts.policy.deadline))

    # -- a worker rank and the scheduler's rank ------------------------------------------------------------------

    def work(self) -> None:
        """A worker (collsync-train): pull, compute, push until every shard is done."""
        launch, shards, sv = self.launch, self.shards, self.serving
        assert launch is not None and shards is not None
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

    def schedule(self) -> None:
        """SpecSync's scheduler on a rank of its own (`sync.scheduler=rank`): serve notifies until every worker
        said BYE; what it gives rank 0 at the end: no partial pulls, and its counts and bytes."""
        sv = self.serving
        assert sv.policy.speculation is not None and self.spec_comm is not None
        ranks = list(range(sv.servers, sv.servers + sv.workers))
        service = SchedulerService(self.spec_comm, sv.policy.speculation, ranks, sv.time_scale, None)
        service.serve(sv.policy.deadline)
        self.mine = (0, service.summary())

    # -- the end ------------------------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> bool:
        """Collective: free the windows and the communicators. No `finally: close()` around a run: freeing is
        collective, and after a failure the other ranks are not there to join it (cli._fail aborts the world).
        `timeout`: a rank not there by then (a lost worker) leaves everything to the exit. Whether all was freed."""
        if self.shards is not None and not self.shards.close(while_waiting=self.answering, timeout=timeout):
            return False
        if self.spec_comm is not None:
            self.spec_comm.Free()
        if self.states is not None:
            self.states.free()
        if self.train_comm is not self.comm:
            self.train_comm.Free()
        return True

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
        assert server is not None and launch is not None and trace is not None and self.shards is not None
        if not closed and not open_mpi():  # Open MPI's abort under --enable-recovery ends this rank alone
            ending.abort_at_exit(self.comm)
        lost = lost_workers(trace, [r for r, b in enumerate(blocks) if b is None], launch.hosts)
        params = torch.cat([b[0] for b in blocks[:servers]])
        ema = None if server.ema is None else torch.cat([b[1] for b in blocks[:servers]])
        extra: dict[str, Any] = {}
        if servers > 1:
            self._evaluate_final(server.version, params, ema)
            bounds = self.shards.bounds
            extra["shards"] = [{"rank": j, "params": list(bounds[j]), **b[3]} for j, b in enumerate(blocks[:servers])]
            extra["partial_pulls"] = sum(b for b in blocks[servers:] if b is not None)  # reads without every shard
        if specsync is not None:
            extra["specsync"] = specsync
        extra["hosts"] = launch.hosts
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


def lost_workers(trace: Trace, silent: list[int], hosts: list[str]) -> list[dict[str, Any]]:
    """The summary's `lost`: each worker the server lost (its `lost` event: rank, host, last update it was part
    of), then each rank that did not answer at the end (no last update known: null)."""
    lost = [{"rank": e["rank"], "host": e["host"], "last_update": e["last_update"]} for e in trace.of("lost")]
    known = {e["rank"] for e in lost}
    lost += [{"rank": r, "host": hosts[r], "last_update": None} for r in silent if r not in known]
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
