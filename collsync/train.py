"""One training run from a resolved config: build the pieces, check they fit, run them on the chosen runtime.

Everything a run needs is built and validated before the first gradient, so a bad config fails in a second with
one line naming the key, not an hour into a job. The run shapes themselves live in `collsync.runs`: the simulator
(`runs.simulated`), the serverless replicas (`runs.replicas`: allreduce, partial allreduce) and the parameter-server
shards (`runs.shards`); this module picks one.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

import collsync.torch as cst
from collsync.data import Batches
from collsync.flat import FlatModel
from collsync.loops import GradFn, Gradients
from collsync.rundir import finished
from collsync.runs.parts import Launch, Parts, build, check_fit, scheduler_ranks
from collsync.runs.replicas import allreduce_step, partial_step, run_replicas
from collsync.runs.shards import run_shards
from collsync.runs.simulated import run_simulated
from collsync.runtime.mpi_world import world
from collsync.runtime.spec import launched_under_mpi, launcher_rank
from collsync.schema import given
from collsync.torch._world import shrunk, state

__all__ = ["Parts", "build", "run"]


def run(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict[str, Any] | None:
    """Train as configured; on the rank that holds the server, write the run folder and return the summary.
    `overrides`: the command line's (Hydra's task overrides), which tell a key given there from a default."""
    instantiate(cfg.runtime).check_launcher()  # a launch that does not fit the runtime stops here, before any data
    done = finished(out_dir, cfg.resume, int(cfg.steps))
    if launched_under_mpi():
        done = world().bcast(done, root=0)  # rank 0's folder decides: the others may not share its file system
    if done is not None:
        if launcher_rank() == 0:
            logging.getLogger("collsync.train").info(
                "run folder %s is finished (%d updates, steps=%d): nothing to train (pass steps > %d to train on)",
                out_dir,
                done["updates"],
                cfg.steps,
                done["updates"],
            )
        return done
    torch.manual_seed(int(cfg.seed))
    parts = build(cfg)
    flat = FlatModel(parts.model)
    check_fit(parts, None)
    if parts.runtime.kind == "sim":
        return run_simulated(parts, flat, out_dir)
    return _run_mpi(parts, flat, out_dir, overrides)


def check(cfg: DictConfig) -> None:
    """What `run` checks before the first gradient, without training (a sweep's members, `collsync.sweep`): the
    launcher, the parts the factories build, their fit, and in the simulator the number of workers too (under MPI
    the launch decides it)."""
    instantiate(cfg.runtime).check_launcher()
    parts = build(cfg)
    check_fit(parts, parts.runtime.workers if parts.runtime.kind == "sim" else None)


def _run_mpi(parts: Parts, flat: FlatModel, out_dir: Path, overrides: Sequence[str]) -> dict[str, Any] | None:
    """The MPI runtimes, as a client of `collsync.torch`: its `init` checks the world against the launcher, shares
    the cores among the ranks and gives each rank its role; `runtime=mpi` opens its shards as the API's server
    modes do (`Shards`), and its server ranks are driven by `runs.shards` (`serve=False`) to evaluate and write
    the run."""
    spec, run = parts.runtime, parts.run
    servers = spec.servers if spec.kind == "mpi" else 0  # serverless: every rank works
    scheduler = scheduler_ranks(parts)  # SpecSync's scheduler on a rank of its own: the last one
    size = state().world.Get_size() if cst.is_initialized() else world().Get_size()
    if size - servers - scheduler < 1:
        also = " and the scheduler's rank (sync.scheduler=rank)" if scheduler else ""
        raise ValueError(
            f"runtime={spec.kind}: {size} rank(s) leave no worker beside {spec.servers} server(s){also}; "
            f"launch at least {spec.servers + scheduler + 1} ranks"
        )
    placement = spec.placement
    if cst.is_initialized() and (state().servers, state().placement) != (servers, placement):
        cst.shutdown()  # a sweep run in one process whose runs differ in runtime.servers or runtime.placement
    # The servers spread over the hosts (`runtime.placement`): `state().world` puts them first either way.
    cst.init(servers=servers, serve=False, deadline=parts.policy.deadline, placement=placement)
    comm = state().world
    workers = comm.Get_size() - servers - scheduler
    if given(overrides, "runtime.workers") is not None:
        _check_given_workers(parts.config["runtime"].get("workers"), comm.Get_size(), workers)
    check_fit(parts, workers)
    grads: GradFn = Gradients(flat, Batches(parts.data, workers, run.batch_size, run.seed))
    sampler = parts.stragglers.sampler(workers, run.seed) if spec.inject_stragglers else None
    hosts = comm.allgather(socket.gethostname())  # summary.json names each rank's host (by rank of `comm`)
    launch = Launch(parts, flat, out_dir, comm, workers, grads, sampler, hosts, shrunk=shrunk)
    if spec.kind == "allreduce":
        return run_replicas(launch, allreduce_step)
    if spec.kind == "partial":
        return run_replicas(launch, partial_step)
    return run_shards(launch)


def _check_given_workers(value: Any, ranks: int, workers: int) -> None:
    """Under MPI the launch decides the workers (its ranks less the server and scheduler ranks): a
    `runtime.workers` given on the command line that says otherwise would be recorded in .hydra/config.yaml and
    ignored, so it is refused, saying what the launch gives and what to pass."""
    if value is None or value == workers:
        return
    more = f"launch {value + ranks - workers} ranks for {value} workers, or " if value >= 1 else ""
    raise ValueError(
        f"runtime.workers={value} does not fit the launch: {ranks} ranks give {workers} worker(s) beside the "
        f"server rank(s), and under MPI the launch decides (runtime.workers sets the simulator's): "
        f"{more}pass runtime.workers={workers} or leave it out"
    )
