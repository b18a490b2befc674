"""One training run from a resolved config: build the pieces, check they fit, run them on the chosen runtime.

Everything a run needs is built and validated before the first gradient, so a bad config fails in a second with
one line naming the key, not an hour into a job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from collsync.flat import FlatModel
from collsync.loops import GradFn, Gradients, Worker, run_allreduce, run_server, run_worker
from collsync.policy import SyncPolicy
from collsync.rules import combine, gradual_warmup, linear_scaling
from collsync.rules.base import Rule
from collsync.runtime.spec import RuntimeSpec
from collsync.server import Server
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
    """Instantiate every group of the config (raises ValueError naming the key on bad input)."""
    for key in ("steps", "batch_size", "eval_every"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key}={cfg[key]} must be >= 1")
    data = instantiate(cfg.data)
    model = instantiate(cfg.model)(input_shape=data.input_shape, classes=data.classes, seed=cfg.seed)
    # A penalty is a Rule applied per arrival, or a wrapper of the optimizer's step (001_... Alg. 3).
    penalty, optimizer = combine(instantiate(cfg.penalty), instantiate(cfg.optimizer))
    return Parts(
        runtime=instantiate(cfg.runtime),
        policy=instantiate(cfg.sync),
        penalty=penalty,
        optimizer=optimizer,
        data=data,
        model=model,
        stragglers=instantiate(cfg.stragglers),
    )


class Evaluator:
    """Test accuracy of theta and of its EMA every `every` updates (and at the end), into the trace."""

    def __init__(self, flat: FlatModel, data: Any, trace: Trace, every: int, progress: Any = None) -> None:
        self.flat, self.data, self.trace, self.every, self.progress = flat, data, trace, every, progress

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
        acc, loss = self.accuracy(server.params)
        fields: dict[str, float] = {"acc": acc, "loss": loss}
        if server.ema is not None:
            fields["ema_acc"], fields["ema_loss"] = self.accuracy(server.ema)
        self.trace.record("eval", version=server.version, **fields)
        if self.progress is not None:
            self.progress.set_postfix(acc=f"{acc:.3f}")


def _check_fit(parts: Parts, workers: int | None) -> None:
    """Incompatible runtime/policy/rule pairs fail here, before any gradient (and before MPI starts)."""
    if workers is not None:
        parts.policy.check(workers)
    if parts.runtime.kind == "allreduce" and (parts.policy.name != "bsp"):
        raise ValueError(
            f"runtime=allreduce runs only sync=bsp (got sync={parts.policy.name}); use runtime=mpi for a server"
        )
    if parts.runtime.kind == "allreduce" and parts.runtime.inject_stragglers and parts.stragglers.frozen:
        raise ValueError("runtime=allreduce cannot go on past a frozen worker; use runtime=mpi with sync=backup")
    if parts.policy.timeout is not None and parts.runtime.kind == "allreduce":
        raise ValueError("runtime=allreduce has no server to time out; use runtime=mpi")


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="updates", unit="upd", leave=False, dynamic_ncols=True)


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any] | None:
    """Train as configured; on the rank that holds the server, write the run folder and return the summary."""
    from collsync.data import Batches

    torch.manual_seed(int(cfg.seed))
    parts = build(cfg)
    flat = FlatModel(parts.model)
    spec = parts.runtime
    _check_fit(parts, None)
    if spec.kind == "sim":
        from collsync.runtime.sim import Simulator

        _check_fit(parts, spec.workers)
        sim = Simulator(spec.workers, parts.stragglers, int(cfg.seed))
        server = _server(cfg, parts, flat, spec.workers, sim.trace)
        grads = Gradients(flat, Batches(parts.data, spec.workers, int(cfg.batch_size), int(cfg.seed)))
        bar = _progress(int(cfg.steps), bool(cfg.progress))
        evaluate = Evaluator(flat, parts.data, sim.trace, int(cfg.eval_every), bar)
        evaluate(server)
        sim.run(server, grads, on_update=evaluate)
        if bar is not None:
            bar.close()
        return _finish(cfg, parts, server, sim.trace, out_dir)
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


def _server(cfg: DictConfig, parts: Parts, flat: FlatModel, workers: int, trace: Trace) -> Server:
    return Server(
        flat.params,
        _schedule(cfg, parts, workers),
        parts.policy,
        workers,
        penalty=parts.penalty,
        steps=int(cfg.steps),
        ema_decay=cfg.ema_decay,
        trace=trace,
    )


def _run_mpi(cfg: DictConfig, parts: Parts, flat: FlatModel, out_dir: Path) -> dict[str, Any] | None:
    from collsync.data import Batches
    from collsync.runtime.mpi_world import set_threads, world

    comm = world()
    set_threads(comm)
    spec = parts.runtime
    workers = comm.Get_size() - (spec.servers if spec.kind == "mpi" else 0)
    if workers < 1:
        raise ValueError(
            f"runtime={spec.kind}: {comm.Get_size()} rank(s) leave no worker beside {spec.servers} server(s); "
            f"launch at least {spec.servers + 1} ranks"
        )
    _check_fit(parts, workers)
    grads: GradFn = Gradients(flat, Batches(parts.data, workers, int(cfg.batch_size), int(cfg.seed)))
    sampler = parts.stragglers.sampler(workers, int(cfg.seed)) if spec.inject_stragglers else None
    trace = Trace()
    if spec.kind == "allreduce":
        from collsync.runtime.mpi_coll import MpiCollective

        if sampler is not None:
            grads = _injected(grads, sampler, spec.time_scale, lambda: False)
        coll = MpiCollective(comm)
        server = _server(cfg, parts, flat, workers, trace)
        bar = _progress(int(cfg.steps), bool(cfg.progress) and coll.rank == 0)
        evaluate = Evaluator(flat, parts.data, trace, int(cfg.eval_every), bar)
        run_allreduce(server, coll, grads, on_update=evaluate if coll.rank == 0 else None)
        if bar is not None:
            bar.close()
        return _finish(cfg, parts, server, trace, out_dir) if coll.rank == 0 else None

    from collsync.runtime.mpi_rma import WindowMailbox

    mailbox = WindowMailbox(comm, flat.numel)
    if sampler is not None:
        grads = _injected(grads, sampler, spec.time_scale, lambda: mailbox.peek().done)
    # No `finally: free()`: freeing is collective, and after a failure the other ranks are not there to join it;
    # the error reaches cli._fail, which aborts the world instead.
    if mailbox.is_server:
        server = _server(cfg, parts, flat, workers, trace)
        bar = _progress(int(cfg.steps), bool(cfg.progress))
        evaluate = Evaluator(flat, parts.data, trace, int(cfg.eval_every), bar)
        evaluate(server)
        run_server(server, mailbox, on_update=evaluate)
        if bar is not None:
            bar.close()
        mailbox.free()
        return _finish(cfg, parts, server, trace, out_dir)
    worker = Worker(mailbox.worker, parts.policy, seed=int(cfg.seed))
    run_worker(worker, mailbox, grads, torch.empty_like(flat.params))
    mailbox.free()
    return None


def _injected(grads: GradFn, sampler: Any, scale: float, finished: Callable[[], bool]) -> GradFn:
    """Real runs with the simulator's stragglers: sleep the drawn compute time and message delay (x `scale`).

    A frozen worker computes nothing more until `finished()` (training is over): the rest of the world trains on
    (backup, async) or the server's deadline names it. It still leaves cleanly, so the run folder is written.
    """
    start = time.monotonic()

    def slow(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
        g = grads(params, worker, index)
        if sampler.is_frozen(worker, (time.monotonic() - start) / scale):
            while not finished():
                time.sleep(0.05)
        time.sleep((sampler.compute_time(worker, index) + sampler.message_delay(worker, index)) * scale)
        return g

    return slow


def _finish(cfg: DictConfig, parts: Parts, server: Server, trace: Trace, out_dir: Path) -> dict[str, Any]:
    from collsync.checks import check_trace
    from collsync.metrics import format_summary, summary, write_report

    out_dir.mkdir(parents=True, exist_ok=True)
    counts = check_trace(trace, parts.policy, server.workers)
    trace.write_jsonl(out_dir / "trace.jsonl")
    torch.save(
        {"params": server.params, "ema": server.ema, "version": server.version, "config": OmegaConf.to_container(cfg)},
        out_dir / "params.pt",
    )
    write_report(trace, out_dir, extra={"trace_checks": counts})
    result = {**summary(trace), "trace_checks": counts}
    print(format_summary(result))
    print(f"run folder: {out_dir}")
    return result
