"""A run's parts, built once from the config and checked to fit before the first gradient.

`build(cfg)` checks the config against its schema and instantiates every group; from there on the runs read the
typed `Parts` (and its `run: RunConfig`), never the raw config. `check_fit` refuses incompatible runtime / policy /
rule pairs, `make_server` builds the server of the whole model or of one shard, `keep_on_failure` writes what was
trained when a deadline, a divergence or a signal ends a run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from collsync import schema
from collsync.checkpoint import Preempted
from collsync.data import Dataset
from collsync.flat import FlatModel
from collsync.loops import GradFn, check_policy
from collsync.lost import SAVE_GRACE_S
from collsync.policy import SyncPolicy
from collsync.rules import combine, gradual_warmup, linear_scaling
from collsync.rules.base import Rule
from collsync.runtime.mpi_world import launcher_size
from collsync.runtime.spec import RuntimeSpec
from collsync.server import Diverged, Server
from collsync.stragglers import Stragglers, StragglerSampler
from collsync.trace import Trace
from collsync.types import Context

if TYPE_CHECKING:
    from mpi4py import MPI
    from tqdm import tqdm


@dataclass
class Parts:
    """The instantiated pieces of a run, and its top-level keys (`run`) and resolved config (`config`: what a
    checkpoint and params.pt record, plain dicts)."""

    run: schema.RunConfig
    config: dict[str, Any]
    runtime: RuntimeSpec
    policy: SyncPolicy
    penalty: Rule
    optimizer: Rule
    data: Dataset
    model: torch.nn.Module
    stragglers: Stragglers


def build(cfg: DictConfig) -> Parts:
    """Check the config against its schema (types of every key, converted in place where they only look wrong),
    then instantiate every group (raises ValueError naming the key on bad input)."""
    run = schema.check(cfg)
    runtime = instantiate(cfg.runtime)
    servers = cfg.runtime.get("servers", 1)
    if runtime.kind == "sim" and servers != 1:
        # runtime=auto without a launcher falls back to the simulator, which has one server: say so, not ignore it.
        raise schema.ConfigError(
            f"runtime.servers={servers} needs MPI ranks to serve on, but this run is the simulator (no launcher): "
            f"launch it under mpiexec / srun with at least {servers + 1} ranks"
        )
    data = instantiate(cfg.data)
    model = instantiate(cfg.model)(input_shape=data.input_shape, classes=data.classes, seed=run.seed)
    # A penalty is a Rule applied per arrival, or a wrapper of the optimizer's step (001_... Alg. 3).
    penalty, optimizer = combine(instantiate(cfg.penalty), instantiate(cfg.optimizer))
    config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's container: a dict
    return Parts(
        run=run,
        config=config,
        runtime=runtime,
        policy=instantiate(cfg.sync),
        penalty=penalty,
        optimizer=optimizer,
        data=data,
        model=model,
        stragglers=instantiate(cfg.stragglers),
    )


def check_fit(parts: Parts, workers: int | None) -> None:
    """Incompatible runtime/policy/rule pairs fail here, before any gradient (and before MPI starts); with
    `workers` known, also what depends on their number."""
    if workers is not None:
        _check_workers(parts, workers)
    policy, kind, model = parts.policy, parts.runtime.kind, parts.stragglers
    if kind == "allreduce" and policy.name != "bsp":
        raise ValueError(f"runtime=allreduce runs only sync=bsp (got sync={policy.name}); use runtime=mpi for a server")
    if kind == "allreduce" and parts.runtime.inject_stragglers and model.frozen:
        raise ValueError("runtime=allreduce cannot go on past a frozen worker; use runtime=mpi with sync=backup")
    if policy.timeout is not None and kind == "allreduce":
        raise ValueError("runtime=allreduce has no server to time out; use runtime=mpi")
    slow = model.slow_server if model is not None else 0.0
    if slow and kind in ("allreduce", "partial") and parts.runtime.inject_stragglers:
        raise ValueError(f"stragglers.slow_server={slow} needs a server: use runtime=mpi, not {kind}")
    if slow and kind != "mpi" and model.shard != 0:
        raise ValueError(f"stragglers.shard={model.shard} needs runtime=mpi with that many servers")
    if slow and kind == "mpi" and model.shard >= parts.runtime.servers:
        raise ValueError(f"stragglers.shard={model.shard} must be < runtime.servers={parts.runtime.servers}")
    if kind == "partial":
        check_policy(policy)
    if parts.runtime.inject_stragglers and kind != "sim":
        _check_injected(parts)


def _check_injected(parts: Parts) -> None:
    """Injected stragglers sleep `runtime.time_scale` x the model's seconds per batch: a mean sleep past the
    deadline would have every worker lost (or the run wait for ever) before its first update, without a word."""
    scale, model, deadline = parts.runtime.time_scale, parts.stragglers, parts.policy.deadline
    per_batch = scale * (model.mean + model.delay_prob * model.delay)
    if deadline is not None and per_batch > deadline:
        raise ValueError(
            f"runtime.time_scale={scale:g} x stragglers.mean={model.mean:g} s injects {per_batch:g} s per batch, "
            f"longer than sync.deadline={deadline:g} s: no gradient would arrive in time; lower runtime.time_scale "
            f"to at most {deadline / per_batch * scale:g} (the default is 0.01)"
        )


def _check_workers(parts: Parts, workers: int) -> None:
    """What the number of workers decides: the policy's quorum and backups, and a rule that takes one gradient."""
    policy, kind = parts.policy, parts.runtime.kind
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


def make_server(parts: Parts, flat: FlatModel, workers: int, trace: Trace, block: slice | None = None) -> Server:
    """The server of the whole model, or of one shard's `block` of it, with the optimizer wrapped in the schedules
    that depend on the number of workers (known only at launch)."""
    run, optimizer = parts.run, parts.optimizer
    if run.warmup_updates:
        # 001_... App. C.4: eta / N -> eta, momentum-corrected.
        optimizer = gradual_warmup(optimizer, run.warmup_updates, workers)
    if run.linear_scaling:
        optimizer = linear_scaling(optimizer, parts.policy.quorum_for(workers))  # 003_...: step x d / c
    return Server(
        flat.params if block is None else flat.params[block],
        optimizer,
        parts.policy,
        workers,
        penalty=parts.penalty,
        steps=run.steps,
        ema_decay=run.ema_decay,
        trace=trace,
        guard=run.guard,
    )


def scheduler_ranks(parts: Parts) -> int:
    """1 when SpecSync's scheduler has a rank of its own (`sync.scheduler=rank` under runtime=mpi), else 0."""
    speculation = parts.policy.speculation
    return int(parts.runtime.kind == "mpi" and speculation is not None and speculation.scheduler == "rank")


@dataclass
class Launch:
    """What every MPI run starts from: its parts, the model, this world, its hosts and the workers' gradients."""

    parts: Parts
    flat: FlatModel
    out_dir: Path
    comm: MPI.Comm
    workers: int
    grads: GradFn
    sampler: StragglerSampler | None  # the straggler draws to inject, or None
    hosts: list[str]  # each rank's host name, by rank of `comm` (summary.json's `hosts`)
    # Told (old, new communicator) once `comm` shrank in place after a rank died (ULFM): the caller's world follows.
    shrunk: Callable[[Any, Any], None] | None = None


def progress(total: int, enabled: bool) -> tqdm | None:
    """A tqdm progress bar of server updates, or None."""
    if not enabled:
        return None
    from tqdm.auto import tqdm as bar  # lazy: tqdm is needed only where a bar is shown

    return bar(total=total, desc="updates", unit="upd", leave=False, dynamic_ncols=True)


@contextlib.contextmanager
def keep_on_failure(save: Callable[[str], Any] | None, wait: float = SAVE_GRACE_S) -> Iterator[None]:
    """A deadline, a divergence or a signal ends the run (the error goes on to cli), but first `save(reason)`
    writes what was trained (on rank 0); without `save` (other ranks), wait `wait` seconds while rank 0 writes
    (it aborts the world when it is done, so the wait is that short unless rank 0 itself is what stopped)."""
    try:
        yield
    except (TimeoutError, Diverged, Preempted) as exc:
        if save is not None:
            save(str(exc))
        else:
            time.sleep(wait)
        raise
