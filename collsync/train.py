"""One training run from a resolved config: build the pieces, check they fit, run them on the chosen runtime.

Everything a run needs is built and validated before the first gradient, so a bad config fails in a second with
one line naming the key, not an hour into a job.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from collsync.checkpoint import Keeper, Preempted
from collsync.flat import FlatModel
from collsync.loops import GradFn, Gradients, Worker, run_allreduce, run_server, run_worker
from collsync.policy import SyncPolicy
from collsync.rules import combine, gradual_warmup, linear_scaling
from collsync.rules.base import Rule
from collsync.runtime.mpi_specsync import SLICE_S
from collsync.runtime.spec import RuntimeSpec
from collsync.server import Diverged, Server
from collsync.trace import Trace


@dataclass
class Parts:
    """The instantiated pieces of a run."""

    runtime: RuntimeSpec
    policy: SyncPolicy
    penalty: Rule
    optimizer: Rule
    data: Any
    model: torch.nn.Module
    stragglers: Any


def build(cfg: DictConfig) -> Parts:
    """Check the config against its schema (types of every key, converted in place where they only look wrong),
    then instantiate every group (raises ValueError naming the key on bad input)."""
    from collsync import schema

    schema.check(cfg)
    runtime = instantiate(cfg.runtime)
    servers = cfg.runtime.get("servers", 1)
    if runtime.kind == "sim" and servers != 1:
        # runtime=auto without a launcher falls back to the simulator, which has one server: say so, not ignore it.
        raise schema.ConfigError(
            f"runtime.servers={servers} needs MPI ranks to serve on, but this run is the simulator (no launcher): "
            f"launch it under mpiexec / srun with at least {servers + 1} ranks"
        )
    data = instantiate(cfg.data)
    model = instantiate(cfg.model)(input_shape=data.input_shape, classes=data.classes, seed=cfg.seed)
    # A penalty is a Rule applied per arrival, or a wrapper of the optimizer's step (001_... Alg. 3).
    penalty, optimizer = combine(instantiate(cfg.penalty), instantiate(cfg.optimizer))
    return Parts(
        runtime=runtime,
        policy=instantiate(cfg.sync),
        penalty=penalty,
        optimizer=optimizer,
        data=data,
        model=model,
        stragglers=instantiate(cfg.stragglers),
    )


class Evaluator:
    """Test accuracy of theta and of its EMA every `every` updates (and at the end), into the trace.

    `assemble(server)` gives the full (params, ema) to evaluate when the server holds one shard of them; with
    `final_later`, the evaluation at the end is left to the caller (`record`), once every shard has finished.
    """

    def __init__(
        self,
        flat: FlatModel,
        data: Any,
        trace: Trace,
        every: int,
        progress: Any = None,
        assemble: Callable[[Server], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
        final_later: bool = False,
        guard_loss: float | None = None,
    ) -> None:
        self.flat, self.data, self.trace, self.every, self.progress = flat, data, trace, every, progress
        self.assemble, self.final_later = assemble, final_later
        # `guard_loss`: stop once the test loss is non-finite or above this many times the first one measured.
        self.guard_loss, self.first_loss = guard_loss, None

    def accuracy(self, params: torch.Tensor) -> tuple[float, float]:
        self.flat.load(params)
        with torch.no_grad():
            logits = self.flat.module(self.data.x_test)
            loss = torch.nn.functional.cross_entropy(logits, self.data.y_test).item()
            acc = (logits.argmax(1) == self.data.y_test).float().mean().item()
        return acc, loss

    def __call__(self, server: Server) -> None:
        if self.progress is not None:
            self.progress.update(server.version - self.progress.n)
        if server.version % self.every and not server.done and server.version:
            return
        if server.done and self.final_later:
            return
        params, ema = self.assemble(server) if self.assemble is not None else (server.params, server.ema)
        self.record(server.version, params, ema)

    def record(self, version: int, params: torch.Tensor, ema: torch.Tensor | None) -> None:
        acc, loss = self.accuracy(params)
        fields: dict[str, float] = {"acc": acc, "loss": loss}
        if ema is not None:
            fields["ema_acc"], fields["ema_loss"] = self.accuracy(ema)
        self.trace.record("eval", version=version, **fields)
        if self.progress is not None:
            self.progress.set_postfix(acc=f"{acc:.3f}")
        if self.guard_loss is not None:
            self.first_loss = loss if self.first_loss is None else self.first_loss
            if not math.isfinite(loss) or loss > self.guard_loss * self.first_loss:
                raise Diverged(
                    f"guard: the test loss is {loss:.4g} at server step {version}, its start was {self.first_loss:.4g} "
                    f"(guard_loss={self.guard_loss}: stop above that many times the start); lower optimizer.lr, or "
                    "add warm-up or a penalty"
                )


def _check_fit(parts: Parts, workers: int | None) -> None:
    """Incompatible runtime/policy/rule pairs fail here, before any gradient (and before MPI starts)."""
    from collsync.runtime.mpi_world import launcher_size
    from collsync.types import Context

    policy, kind = parts.policy, parts.runtime.kind
    if workers is not None:
        if policy.name == "psp" and policy.quorum is not None and policy.quorum > workers:
            # psp's `pushes` is the policy's quorum: name the key the user set.
            raise ValueError(f"psp: pushes={policy.quorum} must be <= {workers=}")
        try:
            policy.check(workers)
        except ValueError as exc:
            if kind == "sim" or launcher_size() is not None:
                raise
            raise ValueError(
                f"{exc} (runtime={kind} without a launcher is a world of one rank: start it under mpiexec -n N / srun, "
                "or train in the simulator with runtime=sim)"
            ) from exc
        aggregated = policy.full_for(workers)
        if aggregated > 1:
            # One update of `aggregated` averaged gradients, tried on zeros: a rule that needs one gradient per
            # update (DANA's per-worker momentum) refuses it now rather than at the first update of training.
            zeros = torch.zeros(sum(p.numel() for p in parts.model.parameters()))
            ctx = Context(step=0, worker=-1, staleness=0, workers=workers, aggregated=aggregated)
            try:
                parts.optimizer.update(zeros, parts.optimizer.init(zeros), zeros, ctx)
            except ValueError as exc:
                raise ValueError(f"sync={policy.name} averages up to {aggregated} gradients per update: {exc}") from exc
    if parts.runtime.kind == "allreduce" and (parts.policy.name != "bsp"):
        raise ValueError(
            f"runtime=allreduce runs only sync=bsp (got sync={parts.policy.name}); use runtime=mpi for a server"
        )
    if parts.runtime.kind == "allreduce" and parts.runtime.inject_stragglers and parts.stragglers.frozen:
        raise ValueError("runtime=allreduce cannot go on past a frozen worker; use runtime=mpi with sync=backup")
    if parts.policy.timeout is not None and parts.runtime.kind == "allreduce":
        raise ValueError("runtime=allreduce has no server to time out; use runtime=mpi")
    slow = parts.stragglers.slow_server if parts.stragglers is not None else 0.0
    if slow and parts.runtime.kind in ("allreduce", "partial") and parts.runtime.inject_stragglers:
        raise ValueError(f"stragglers.slow_server={slow} needs a server: use runtime=mpi, not {parts.runtime.kind}")
    if slow and parts.runtime.kind != "mpi" and parts.stragglers.shard != 0:
        raise ValueError(f"stragglers.shard={parts.stragglers.shard} needs runtime=mpi with that many servers")
    if slow and parts.runtime.kind == "mpi" and parts.stragglers.shard >= parts.runtime.servers:
        raise ValueError(f"stragglers.shard={parts.stragglers.shard} must be < runtime.servers={parts.runtime.servers}")
    if parts.runtime.kind == "partial":
        from collsync.loops import check_policy

        check_policy(parts.policy)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="updates", unit="upd", leave=False, dynamic_ncols=True)


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any] | None:
    """Train as configured; on the rank that holds the server, write the run folder and return the summary."""
    from collsync.data import Batches

    instantiate(cfg.runtime).check_launcher()  # a launch that does not fit the runtime stops here, before any data
    torch.manual_seed(int(cfg.seed))
    parts = build(cfg)
    flat = FlatModel(parts.model)
    spec = parts.runtime
    _check_fit(parts, None)
    if spec.kind == "sim":
        from collsync.sim import Simulator

        _check_fit(parts, spec.workers)
        keeper = _keeper(cfg, out_dir)
        saved = keeper.resumed()
        sim = Simulator(spec.workers, parts.stragglers, int(cfg.seed))
        server = _server(cfg, parts, flat, spec.workers, sim.trace)
        grads = Gradients(flat, Batches(parts.data, spec.workers, int(cfg.batch_size), int(cfg.seed)))
        bar = _progress(int(cfg.steps), bool(cfg.progress))
        evaluate = Evaluator(flat, parts.data, sim.trace, int(cfg.eval_every), bar, guard_loss=_guard_loss(cfg))
        if saved is not None:
            sim.load_state_dict(saved["driver"], parts.policy)
            _restore(saved, keeper, server, sim.trace, evaluate, shift_clock=False)

        def between() -> None:
            keeper.step(server.version, lambda: _state(server, sim.trace, evaluate, driver=sim.state_dict()))

        with _keep_on_failure(lambda why: _finish(cfg, parts, server, sim.trace, out_dir, extra={"incomplete": why})):
            if saved is None:
                evaluate(server)
            sim.run(server, grads, on_update=evaluate, between=between)
        if bar is not None:
            bar.close()
        spec = sim.specsync_summary(flat.numel, flat.params.element_size())  # SpecSync's counts and bytes, if any
        return _finish(cfg, parts, server, sim.trace, out_dir, extra=spec or None)
    return _run_mpi(cfg, parts, flat, out_dir)


def _schedule(cfg: DictConfig, parts: Parts, workers: int) -> Rule:
    """Wrap the optimizer in the schedules that depend on the number of workers (known only at launch)."""
    optimizer = parts.optimizer
    warmup = int(cfg.get("warmup_updates", 0))
    if warmup:
        optimizer = gradual_warmup(optimizer, warmup, workers)  # 001_... App. C.4: eta / N -> eta, momentum-corrected
    if bool(cfg.get("linear_scaling", False)):
        optimizer = linear_scaling(optimizer, parts.policy.quorum_for(workers))  # 003_...: step x d / c
    return optimizer


def _server(
    cfg: DictConfig, parts: Parts, flat: FlatModel, workers: int, trace: Trace, block: slice | None = None
) -> Server:
    """The server of the whole model, or of one shard's `block` of it."""
    return Server(
        flat.params if block is None else flat.params[block],
        _schedule(cfg, parts, workers),
        parts.policy,
        workers,
        penalty=parts.penalty,
        steps=int(cfg.steps),
        ema_decay=cfg.ema_decay,
        trace=trace,
        guard=str(cfg.get("guard", "stop")),
    )


def _run_mpi(cfg: DictConfig, parts: Parts, flat: FlatModel, out_dir: Path) -> dict[str, Any] | None:
    """The MPI runtimes, as a client of `collsync.torch`: its `init` checks the world against the launcher, shares
    the cores among the ranks and gives each rank its role; `runtime=mpi` opens its shards as the API's server
    modes do (`Shards`), and its server ranks are driven here (`serve=False`) to evaluate and write the run."""
    import collsync.torch as cst
    from collsync.data import Batches
    from collsync.torch._world import state

    spec = parts.runtime
    servers = spec.servers if spec.kind == "mpi" else 0  # serverless: every rank works
    scheduler = _scheduler_ranks(parts)  # SpecSync's scheduler on a rank of its own: the last one
    size = state().world.Get_size() if cst.is_initialized() else _world_size()
    if size - servers - scheduler < 1:
        also = " and the scheduler's rank (sync.scheduler=rank)" if scheduler else ""
        raise ValueError(
            f"runtime={spec.kind}: {size} rank(s) leave no worker beside {spec.servers} server(s){also}; "
            f"launch at least {spec.servers + scheduler + 1} ranks"
        )
    if cst.is_initialized() and state().servers != servers:
        cst.shutdown()  # a sweep run in one process whose runs differ in runtime.servers
    cst.init(servers=servers, serve=False)
    comm = state().world
    workers = comm.Get_size() - servers - scheduler
    _check_fit(parts, workers)
    grads: GradFn = Gradients(flat, Batches(parts.data, workers, int(cfg.batch_size), int(cfg.seed)))
    sampler = parts.stragglers.sampler(workers, int(cfg.seed)) if spec.inject_stragglers else None
    launch = _Launch(cfg, parts, flat, out_dir, comm, workers, grads, sampler)
    runners = {"allreduce": _run_allreduce, "partial": _run_partial}
    return runners.get(spec.kind, _run_shards)(launch)


def _scheduler_ranks(parts: Parts) -> int:
    """1 when SpecSync's scheduler has a rank of its own (`sync.scheduler=rank` under runtime=mpi), else 0."""
    speculation = parts.policy.speculation
    return int(parts.runtime.kind == "mpi" and speculation is not None and speculation.scheduler == "rank")


def _world_size() -> int:
    from collsync.runtime.mpi_world import world

    return world().Get_size()


@dataclass
class _Launch:
    """What every MPI runtime starts from: the config, its parts, the model, this world and the workers' gradients."""

    cfg: DictConfig
    parts: Parts
    flat: FlatModel
    out_dir: Path
    comm: Any
    workers: int
    grads: GradFn
    sampler: Any  # the straggler draws to inject, or None


def _run_allreduce(run: _Launch) -> dict[str, Any] | None:
    """Serverless full sync: every rank a worker with a server replica, the mean from (bucketed) allreduces."""
    from collsync.runtime.mpi_coll import BucketReducer, MpiCollective

    cfg, parts, flat, spec, grads = run.cfg, run.parts, run.flat, run.parts.runtime, run.grads
    trace = Trace()
    deadline = parts.policy.deadline  # a stopped or dead rank ends the run, rather than hang every other one
    coll = MpiCollective(run.comm, deadline)
    reducer = None
    if run.sampler is not None:
        # An injected delay must hold this rank's gradient back, so the reduction follows it (no overlap).
        grads = _injected(grads, run.sampler, spec.time_scale, lambda: False)
    elif spec.bucket_mib > 0:
        # Gradient buckets are reduced while the backward pass runs; the mean is ready when it returns.
        reducer = BucketReducer(run.comm, flat, max(1, int(spec.bucket_mib * 2**20)), deadline=deadline)
        grads = reducer.averaged(grads)
    server = _server(cfg, parts, flat, run.workers, trace)
    bar = _progress(int(cfg.steps), bool(cfg.progress) and coll.rank == 0)
    evaluate = Evaluator(flat, parts.data, trace, int(cfg.eval_every), bar, guard_loss=_guard_loss(cfg))
    update = _replicas_resume(run, server, trace, evaluate)
    with _keep_on_failure(_saver(run, server, trace) if coll.rank == 0 else None, _grace(deadline)):
        run_allreduce(server, coll, grads, on_update=update, averaged=reducer is not None)
    if bar is not None:
        bar.close()
    result = _finish(cfg, parts, server, trace, run.out_dir) if coll.rank == 0 else None
    # The other ranks sleep, rather than spin in MPI, while rank 0 writes the run folder.
    (reducer or coll).shutdown()
    return result


def _run_partial(run: _Launch) -> dict[str, Any] | None:
    """Serverless backup workers: every rank a worker with a server replica, rounds through a partial allreduce."""
    from collsync.loops import run_partial
    from collsync.runtime.mpi_coll import shutdown
    from collsync.runtime.mpi_partial import PartialAllreduce

    cfg, parts, flat, comm, grads = run.cfg, run.parts, run.flat, run.comm, run.grads
    rank = comm.Get_rank()
    if run.sampler is not None:
        # A frozen rank never comes back here: the others go on while it is within `depth` rounds, then wait for it
        # (for at most sync.deadline, then the run fails naming it).
        grads = _injected(grads, run.sampler, parts.runtime.time_scale, lambda: False)
    trace = Trace()
    pa = PartialAllreduce(
        comm, flat.numel, dtype=flat.params.dtype, depth=parts.runtime.depth, timeout=parts.policy.deadline
    )
    server = _server(cfg, parts, flat, run.workers, trace)
    bar = _progress(int(cfg.steps), bool(cfg.progress) and rank == 0)
    evaluate = Evaluator(flat, parts.data, trace, int(cfg.eval_every), bar, guard_loss=_guard_loss(cfg))
    update = _replicas_resume(run, server, trace, evaluate)
    with _keep_on_failure(_saver(run, server, trace) if rank == 0 else None, _grace(parts.policy.deadline)):
        if rank == 0 and server.version == 0:
            evaluate(server)
        run_partial(server, pa, grads, on_update=update)
    if bar is not None:
        bar.close()
    pa.free()  # collective; no `finally`: after a failure cli._fail aborts the world
    result = _finish(cfg, parts, server, trace, run.out_dir) if rank == 0 else None
    shutdown(comm)  # the other ranks sleep, rather than spin in MPI, while rank 0 writes the run folder
    return result


def _run_shards(run: _Launch) -> dict[str, Any] | None:
    """Parameter-server shards on MPI windows: ranks 0..M-1 each serve one block, the other ranks are workers."""
    from collsync.checks import check_trace
    from collsync.runtime.mpi_checkpoint import ShardStates
    from collsync.runtime.mpi_shards import Shards

    cfg, parts, flat, comm, workers, grads = run.cfg, run.parts, run.flat, run.comm, run.workers, run.grads
    spec, servers = parts.runtime, parts.runtime.servers
    # SpecSync's scheduler on a rank of its own (the last) stays out of the shards' windows.
    dedicated = bool(_scheduler_ranks(parts))
    scheduling = dedicated and comm.Get_rank() == comm.Get_size() - 1
    train_comm = comm.Split(int(scheduling), comm.Get_rank()) if dedicated else comm
    shards = None if scheduling else Shards(train_comm, flat.numel, servers)
    trace = Trace()
    # Rank 0 keeps the checkpoints (with several shards, every shard's state at one version: runtime/mpi_checkpoint.py)
    # and tells each worker where it resumes: after the last gradient each shard got from it, so none is lost or
    # applied twice.
    keeper, saved = _rank0_keeper(run)
    have = comm.bcast(None if saved is None else _resume_counts(saved), root=0)
    # SpecSync: its messages on a communicator of their own; the scheduler runs in rank 0's server loop.
    speculation = parts.policy.speculation
    spec_comm = comm.Dup() if speculation is not None else None
    service, speculator = None, None
    scheduler_rank = comm.Get_size() - 1 if dedicated else 0
    if scheduling:
        return _run_scheduler_rank(run, spec_comm, train_comm)
    assert shards is not None
    states = ShardStates(train_comm, servers) if servers > 1 else None
    # Shards 1..M-1 resume from their parts of rank 0's checkpoint (sent: no shared file system needed).
    resumed = None if states is None else train_comm.scatter(_shard_parts(saved, train_comm.Get_size()), root=0)
    # No `finally: close()`: freeing is collective, and after a failure the other ranks are not there to join it;
    # the error reaches cli._fail, which aborts the world instead.
    if shards.serving:
        block = shards.block
        server = _server(cfg, parts, flat, workers, trace, block=block)
        evaluate = None
        if shards.rank == 0:
            bar = _progress(int(cfg.steps), bool(cfg.progress))
            full = flat.params.clone()

            def assemble(server: Server) -> tuple[torch.Tensor, torch.Tensor | None]:
                # The other blocks as their servers last published them (their view: theta, or DANA's look-ahead).
                # Not our own shard: it is published only once run_server starts, after the first evaluation.
                shards.snapshot(full)
                full[block] = server.params
                return full, None

            evaluate = Evaluator(
                flat,
                parts.data,
                trace,
                int(cfg.eval_every),
                bar,
                assemble=assemble if servers > 1 else None,
                final_later=servers > 1,
                guard_loss=_guard_loss(cfg),
            )
            if saved is not None:
                _restore(saved, keeper, server, trace, evaluate, shift_clock=True)
            else:
                evaluate(server)
        elif resumed is not None:
            server.load_state_dict(resumed["server"])
            trace.resume(resumed["events"], shift_clock=True)
        model = parts.stragglers
        slow = run.sampler is not None and model.slow_server > 0 and shards.rank == model.shard
        # A worker stopped, hung or died, or training diverged: keep what was trained before the error ends the run.
        save = (lambda why: _save_incomplete(run, server, trace, shards, evaluate, why)) if shards.rank == 0 else None
        between: Callable[[Server], None] | None = None
        if keeper is not None and states is not None:
            between = _ShardCheckpoints(keeper, states, trace, evaluate)
        elif keeper is not None:
            between = lambda s: keeper.step(s.version, lambda: _state(s, trace, evaluate, {}))  # noqa: E731
        elif states is not None:
            between = lambda s: states.answer(s.version, lambda: _shard_state(s, trace))  # noqa: E731
        delay = model.slow_server * spec.time_scale * slow
        if speculation is not None and shards.rank == 0:
            from collsync.runtime.mpi_specsync import SchedulerService

            ranks = list(range(servers, servers + workers))
            service = SchedulerService(spec_comm, speculation, ranks, spec.time_scale, trace, schedules=not dedicated)
        poll = service.poll if service is not None else None
        with _keep_on_failure(save, _grace(parts.policy.deadline)):
            run_server(server, shards.own, on_update=evaluate, publish_delay=delay, between=between, poll=poll)
            if states is not None and shards.rank > 0:
                states.send_last(_shard_state(server, trace))
            elif states is not None:
                states.finish(_grace(parts.policy.deadline))  # the others' final states: their sends complete
        if service is not None:
            service.close(parts.policy.deadline)
        if shards.rank == 0 and bar is not None:
            bar.close()
        applies = trace.of("apply")
        # Each shard's own clock starts at the (collective) window creation: close enough to compare shards.
        counts = {**check_trace(trace, parts.policy, workers), "last_update_s": applies[-1]["t"] if applies else 0.0}
        mine: Any = (server.params, server.ema, server.version, counts)
    else:
        # A worker gives up on a silent server after twice the deadline the server gives its workers, plus the time
        # rank 0 may take to write the run folder after its own deadline fired (it publishes nothing meanwhile).
        deadline = parts.policy.deadline
        silence = None if deadline is None else 2 * deadline + _grace(deadline)
        mailbox = shards.worker_mailbox(parts.policy.pull_fraction, parts.policy.pull_timeout, silence)
        worker = Worker(mailbox.worker, parts.policy, seed=int(cfg.seed))
        if have is not None:
            # Go on from the shard that has the fewest of this worker's gradients, in the round it was at there.
            received = [counts[mailbox.worker] for counts, _ in have]
            worker.steps = mailbox.resume(received)
            worker.clock = have[received.index(worker.steps)][1][mailbox.worker]
        wait = 0.0
        if speculation is not None:
            from collsync.runtime.mpi_specsync import Speculator, install_safe_points

            speculator = Speculator(spec_comm, mailbox.worker, scheduler_rank, spec.time_scale, mailbox.peek)
            install_safe_points(flat.module, speculator.check)  # abort between layers
            wait = speculation.wait * spec.time_scale
        if run.sampler is not None:
            check = speculator.check if speculator is not None else None  # ... and during the injected delay
            grads = _injected(grads, run.sampler, spec.time_scale, lambda: mailbox.peek().done, check)
        run_worker(worker, mailbox, grads, torch.empty_like(flat.params), speculator, wait)
        if speculator is not None:
            speculator.close(parts.policy.deadline)
        mine = mailbox.partial_reads
    blocks = comm.gather(mine, root=0)
    specsync = None
    if spec_comm is not None:
        bytes_ = None if speculator is None else (mailbox.bytes_pushed, mailbox.bytes_fetched, speculator.resync_bytes)
        gathered = comm.gather(bytes_, root=0) or []
        if service is not None:
            moved = [b for b in gathered if isinstance(b, tuple)]
            remote = next((b for b in gathered if isinstance(b, dict)), None)  # a scheduler rank's own counts
            specsync = _specsync_summary(service, moved, remote)
        spec_comm.Free()
    shards.close()
    if states is not None:
        states.free()
    if dedicated:
        train_comm.Free()
    if shards.rank != 0:
        return None
    params = torch.cat([b[0] for b in blocks[:servers]])
    ema = None if server.ema is None else torch.cat([b[1] for b in blocks[:servers]])
    if servers > 1:
        assert evaluate is not None
        evaluate.record(server.version, params, ema)
    extra = {
        "shards": [{"rank": j, "params": list(shards.bounds[j]), **b[3]} for j, b in enumerate(blocks[:servers])],
        "partial_pulls": sum(blocks[servers:]),  # reads that went on without every shard (PSP's partial pull)
    }
    extra = {**(extra if servers > 1 else {}), **({"specsync": specsync} if specsync is not None else {})}
    return _finish(cfg, parts, server, trace, run.out_dir, params=params, ema=ema, extra=extra or None)


def _run_scheduler_rank(run: _Launch, spec_comm: Any, train_comm: Any) -> None:
    """SpecSync's scheduler on a rank of its own (`sync.scheduler=rank`): serve notifies until every worker said
    BYE, then join the world's collectives of `_run_shards` (what it sends rank 0: its counts and bytes)."""
    from collsync.runtime.mpi_specsync import SchedulerService

    parts, servers, comm = run.parts, run.parts.runtime.servers, run.comm
    assert parts.policy.speculation is not None
    ranks = list(range(servers, servers + run.workers))
    service = SchedulerService(spec_comm, parts.policy.speculation, ranks, parts.runtime.time_scale, None)
    service.serve(parts.policy.deadline)
    comm.gather(0, root=0)  # no partial pulls here
    comm.gather(service.summary(), root=0)
    spec_comm.Free()
    train_comm.Free()
    return None


def _specsync_summary(service: Any, moved: list[tuple[int, int, int]], remote: dict[str, Any] | None) -> dict[str, Any]:
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


# How long rank 0 may take to write the run folder (evaluation, trace, plots) once a deadline fired, a divergence
# or a signal stopped it: the other ranks wait that long before their own error aborts the world (rank 0 aborts it
# as soon as it is done), and a worker waits that much longer than the deadlines on a silent server.
_SAVE_GRACE_S = 30.0


def _grace(deadline: float | None) -> float:
    """`_SAVE_GRACE_S`, shorter where the user asked for short deadlines (they would rather fail fast)."""
    return _SAVE_GRACE_S if deadline is None else min(_SAVE_GRACE_S, max(3.0, 3 * deadline))


def _guard_loss(cfg: DictConfig) -> float | None:
    return None if str(cfg.get("guard", "stop")) == "off" else float(cfg.get("guard_loss", 10.0))


def _keeper(cfg: DictConfig, out_dir: Path, disabled: str | None = None) -> Keeper:
    """The run's checkpoints as configured (`checkpoint.every` updates / `.seconds`, `resume`)."""
    ck = cfg.get("checkpoint") or {}
    resume = cfg.get("resume")
    return Keeper(
        OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
        out_dir,
        ck.get("every"),
        ck.get("seconds"),
        None if resume is None else str(resume),
        disabled=disabled,
    )


def _rank0_keeper(run: _Launch, disabled: str | None = None) -> tuple[Keeper | None, dict[str, Any] | None]:
    """Rank 0's checkpoints and the checkpoint it resumes from (the other ranks: None, None)."""
    if run.comm.Get_rank() != 0:
        return None, None
    keeper = _keeper(run.cfg, run.out_dir, disabled=disabled)
    return keeper, keeper.resumed()


def _replicas_resume(
    run: _Launch, server: Server, trace: Trace, evaluate: Evaluator
) -> Callable[[Server], None] | None:
    """The serverless runtimes: every replica resumes from rank 0's checkpoint (sent to them: no shared file system
    needed); returns rank 0's `on_update`, which evaluates and checkpoints (None on the other ranks)."""
    keeper, saved = _rank0_keeper(run)
    state = run.comm.bcast(None if saved is None else saved["server"], root=0)
    if keeper is None:
        if state is not None:
            server.load_state_dict(state)
        return None
    if saved is not None:
        _restore(saved, keeper, server, trace, evaluate, shift_clock=True)

    def update(s: Server) -> None:
        evaluate(s)
        keeper.step(s.version, lambda: _state(s, trace, evaluate, {}))

    return update


def _state(server: Server, trace: Trace, evaluate: Evaluator | None, driver: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's payload: the server, the runtime's own state, the trace so far and the guard's reference."""
    return {
        "server": server.state_dict(),
        "driver": driver,
        "events": list(trace.events),
        "evaluator": {"first_loss": evaluate.first_loss if evaluate is not None else None},
    }


def _restore(
    saved: dict[str, Any],
    keeper: Keeper,
    server: Server,
    trace: Trace | None,
    evaluate: Evaluator | None,
    *,
    shift_clock: bool,
) -> None:
    """Go on from a checkpoint: the server's state, then the trace (marked where it resumed) and the guard."""
    server.load_state_dict(saved["server"])
    if trace is not None:
        trace.resume(saved["events"], shift_clock=shift_clock)
        trace.record("resume", version=server.version, checkpoint=str(keeper.source))
    if evaluate is not None:
        evaluate.first_loss = saved["evaluator"]["first_loss"]


def _resume_counts(saved: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """Per shard (0..M-1) of a checkpoint: how many gradients it had from each worker, and each one's last round."""
    servers = [saved["server"], *(part["server"] for part in saved.get("shards", []))]
    return [(list(s["received"]), list(s["clocks"])) for s in servers]


def _shard_parts(saved: dict[str, Any] | None, size: int) -> list[dict[str, Any] | None] | None:
    """Rank 0's scatter of a checkpoint over the shards' world: shard j's part to rank j, nothing to the others."""
    if saved is None:
        return [None] * size
    parts = list(saved.get("shards", []))
    return [None, *parts, *[None] * (size - 1 - len(parts))]


def _shard_state(server: Server, trace: Trace) -> dict[str, Any]:
    """What shard j >= 1 contributes to rank 0's checkpoint: its server and its trace (for the end-of-run counts)."""
    return {"server": server.state_dict(), "events": list(trace.events)}


def _frozen(x: Any) -> Any:
    """A deep copy of a checkpoint payload's tensors and containers (it is written after training went on)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _frozen(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_frozen(v) for v in x]
    return x


class _ShardCheckpoints:
    """Rank 0's `between` hook with several shards (runtime/mpi_checkpoint.py): when a checkpoint is due (or a
    signal asked for one) ask the other shards for their state at the next version, take its own there, and write
    the file once every state is in; after a signal, stop the run (`Preempted`) once it is written."""

    def __init__(self, keeper: Keeper, states: Any, trace: Trace, evaluate: Evaluator | None) -> None:
        self.keeper, self.states, self.trace, self.evaluate = keeper, states, trace, evaluate
        self.version: int | None = None  # the version being gathered
        self.own: dict[str, Any] | None = None
        self.others: list[dict[str, Any]] | None = None

    def __call__(self, server: Server) -> None:
        if self.version is None:
            if self.keeper.due(server.version):
                self.version = server.version + 1
                self.states.ask(self.version)
            else:
                self.states.collect()  # a shard that finished sends its final state once
            return
        if self.own is None and server.version >= self.version:
            self.own = _frozen(_state(server, self.trace, self.evaluate, {}))
        others = self.states.collect()
        if others is not None:
            self.others = others
        if self.own is None or self.others is None:
            return
        version = self.own["server"]["version"]
        self.keeper.write(version, {**self.own, "shards": self.others})
        self.version, self.own, self.others = None, None, None
        self.keeper.stop_if_asked(version)


@contextlib.contextmanager
def _keep_on_failure(save: Callable[[str], Any] | None, grace: float = _SAVE_GRACE_S) -> Iterator[None]:
    """A deadline, a divergence or a signal ends the run (the error goes on to cli), but first `save(reason)`
    writes what was trained (on rank 0); without `save` (other ranks), wait `grace` seconds while rank 0 writes
    (it aborts the world when it is done, so the wait is that short unless rank 0 itself is what stopped)."""
    try:
        yield
    except (TimeoutError, Diverged, Preempted) as exc:
        if save is not None:
            save(str(exc))
        else:
            time.sleep(grace)
        raise


def _saver(run: _Launch, server: Server, trace: Trace) -> Callable[[str], Any]:
    """Rank 0's `save` for the serverless runtimes: its replica holds the whole model."""
    return lambda why: _finish(run.cfg, run.parts, server, trace, run.out_dir, extra={"incomplete": why})


def _save_incomplete(
    run: _Launch, server: Server, trace: Trace, shards: Any, evaluate: Evaluator | None, message: str
) -> None:
    """Rank 0 after a deadline: write the run folder with what the servers hold (the other shards' blocks as they
    last published them), the summary marked incomplete with the reason."""
    server.drain()
    if shards.servers > 1:
        params = run.flat.params.clone()
        shards.snapshot(params)
        params[shards.block] = server.params
        ema = None
    else:
        params, ema = server.params, server.ema
    if evaluate is not None:
        evaluate.record(server.version, params, ema)
    _finish(run.cfg, run.parts, server, trace, run.out_dir, params=params, ema=ema, extra={"incomplete": message})


def _injected(
    grads: GradFn, sampler: Any, scale: float, finished: Callable[[], bool], check: Callable[[], None] | None = None
) -> GradFn:
    """Real runs with the simulator's stragglers: sleep the drawn compute time and message delay (x `scale`).

    A frozen worker computes nothing more until `finished()` (training is over): the rest of the world trains on
    (backup, async) or the server's deadline names it. It still leaves cleanly, so the run folder is written.
    `check()`: SpecSync's safe point, called between slices of the sleep (it raises to abort the gradient).
    """
    start = time.monotonic()

    def slow(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
        g = grads(params, worker, index)
        if sampler.is_frozen(worker, (time.monotonic() - start) / scale):
            while not finished():
                time.sleep(0.05)
        delay = (sampler.compute_time(worker, index) + sampler.message_delay(worker, index)) * scale
        if check is None:
            time.sleep(delay)
            return g
        # SpecSync: the delay stands for computation, so a re-sync may abort it (`check` raises) at any slice.
        end = time.monotonic() + delay
        while (left := end - time.monotonic()) > 0:
            check()
            time.sleep(min(left, SLICE_S))
        return g

    return slow


def _finish(
    cfg: DictConfig,
    parts: Parts,
    server: Server,
    trace: Trace,
    out_dir: Path,
    *,
    params: torch.Tensor | None = None,
    ema: torch.Tensor | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Check the trace, write the run folder (trace, parameters, report) and print the summary. `params` / `ema`
    are the whole model's when the server held one shard of them."""
    from collsync.checks import check_trace
    from collsync.metrics import format_summary, summary
    from collsync.rundir import keep_on_write_failure
    from collsync.runfiles import write_report

    try:
        counts = check_trace(trace, parts.policy, server.workers)
    except (AssertionError, ValueError) as exc:
        if not (extra or {}).get("incomplete"):
            raise
        counts = {"error": str(exc)}  # a run cut short may leave gradients that were never applied or dropped
    if params is None:
        params, ema = server.params, server.ema
    saved = {"params": params, "ema": ema, "version": server.version, "config": OmegaConf.to_container(cfg)}
    extra = {"trace_checks": counts, **(extra or {})}
    with keep_on_write_failure(out_dir, saved):  # a disk that filled up meanwhile: the parameters go elsewhere
        out_dir.mkdir(parents=True, exist_ok=True)
        trace.write_jsonl(out_dir / "trace.jsonl")
        torch.save(saved, out_dir / "params.pt")
        write_report(trace, out_dir, extra=extra)
    result = {**summary(trace), **extra}
    # Through logging, line by line: under Hydra its handlers show each line on the console and keep it in the run
    # folder's collsync.log, so the log a run leaves (e.g. a Slurm job's) holds its summary and where it went.
    import logging

    log = logging.getLogger(__name__)
    for line in format_summary(result).splitlines():
        log.info(line)
    log.info("run folder: %s", out_dir)
    return result
