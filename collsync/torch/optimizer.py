"""`DistributedOptimizer`: Horovod's wrapper of a torch optimizer, with collsync's sync modes behind `sync=`.

The optimizer you pass is wrapped in place (its class becomes a subclass that adds `synchronize`,
`skip_synchronize` and `join`; `isinstance`, `state_dict` and learning-rate schedulers keep working) and returned.
What `step()` does depends on the mode, one module per mode family behind the `_mode.Mode` interface:

* `bsp` (no servers, `_allreduce`): Horovod's semantics. `synchronize()` averages (or sums) every gradient over the
  workers in one fused reduction (in buckets while backward runs, on the `runtime.mpi_buckets.BucketReducer` that
  `collsync-train` uses too; or Horovod's own allreduce with `backend="horovod"`), honouring
  `compression`, `op`, `gradient_predivide_factor` and `backward_passes_per_step` as Horovod does; then your
  optimizer steps on every replica.
* `backup` (no servers, `_partial_mode`): each step t is a k-of-n partial allreduce (`runtime.mpi_partial`): the
  first n - b gradients of round t to arrive are averaged (000_..., Chen et al., Alg. 3-4), every replica applies
  that same mean with your optimizer, and a gradient that came late is dropped and counted (`dropped`). A worker
  whose round is already complete reads the mean without contributing, then every round completed since, and has
  `collsync.torch.DistributedSampler` skip as many of its batches (`caught_up`).
* `async`, `ssp`, `psp`, `bfasgd`, `specsync` (and any mode once `init` reserved servers; `_server_mode`): the
  parameter server on MPI windows.
  `step()` pushes this worker's gradient to the shards and pulls fresh parameters into the model. The update is
  applied on the servers by collsync's rule made from your optimizer's class and hyperparameters
  (`server_rule.server_rule`; Horovod's lr x size() rescaled to the gradients one update averages,
  `server_rule.server_lr`) plus the penalty; your optimizer's own state is not used (it stays empty) and a change of
  its learning rate after construction does not reach the servers (warned once). Training ends for everyone when
  the workers leave (`shutdown()`, at exit, or `join()`): under a round policy (BSP, backup, SSP, PSP) as soon as
  one worker leaves, since its rounds can no longer complete; the other workers' `step()` then returns without
  changing the model (`finished` is True).
* `specsync` (004_..., over async or ssp): as above, and the scheduler in server rank 0's loop may abort a gradient
  under way; `collsync.torch.speculative` says where and what `step()` then does (`speculative(step)`,
  `step(closure)`, or `aborted` after a plain `step()`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from collsync.torch import _inputs, ops
from collsync.torch._allreduce import AllreduceMode
from collsync.torch._local_mode import LocalMode
from collsync.torch._mode import Mode
from collsync.torch._partial_mode import PartialMode
from collsync.torch._process_sets import set_world
from collsync.torch._server_mode import ServerMode
from collsync.torch._server_mode import _shard_states as _shard_states  # tests check resume input here
from collsync.torch._world import World, state
from collsync.torch.config import SyncConfig, sync_config


def _params(optimizer: torch.optim.Optimizer, named_parameters: Any) -> list[torch.Tensor]:
    """The optimizer's trainable parameters; `named_parameters`, when given, must cover them (as Horovod checks)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if named_parameters is None:
        return params
    named = list(named_parameters)
    dups = sorted(str(n) for n, k in Counter(n for n, _ in named).items() if k > 1)
    if dups:  # Horovod names its reductions by parameter name, so it refuses duplicates; so does collsync
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    names = {id(p) for _, p in named}
    missing = [p for p in params if id(p) not in names]
    if missing:
        raise ValueError(
            f"DistributedOptimizer: named_parameters was given but misses {len(missing)} of the optimizer's "
            "parameters; pass model.named_parameters() of the model the optimizer was built on"
        )
    return params


class _Distributed:
    """Mixed in front of the user's optimizer class (its name kept): Horovod's extra methods."""

    _collsync: Mode
    _should_synchronize: bool

    def step(self, closure: Any = None) -> Any:
        return self._collsync.step(super().step, closure, self._should_synchronize)  # type: ignore[misc]

    def _local_step(self) -> Any:
        """The wrapped class's own step, without synchronising (`broadcast_optimizer_state`'s first step)."""
        return super().step()  # type: ignore[misc]

    def synchronize(self) -> None:
        self._collsync.synchronize()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def join(self) -> int:
        return self._collsync.join()

    def close(self) -> None:
        """Release what this optimizer holds (windows, hooks; collective over the workers, and with the servers in
        server modes, whose shards end here). `shutdown()` does it for optimizers still open. The model keeps its
        parameters; `step()` must not be called afterwards."""
        st = state("close")
        mode = self._collsync
        if mode.close in st.cleanups:
            st.cleanups.remove(mode.close)
            mode.close()
        if st.joiner is not None and st.joiner() is self:
            st.joiner = None
        if st.speculating is not None and st.speculating is mode.spec:
            st.speculating = None

    def server_state_dict(self) -> dict[str, Any]:
        """Server modes, on worker 0: the servers' state (each shard's parameters, EMA, rule state and version,
        taken between two of its messages), to save beside the model's and pass back as
        `DistributedOptimizer(..., server_state=...)` to resume. It holds tensors, numbers and lists only, so
        `torch.load(weights_only=True)` reads it. Serverless modes have no server: save the model and the
        optimizer's `state_dict()` on rank 0 as with Horovod."""
        mode = self._collsync
        if not isinstance(mode, ServerMode):
            raise ValueError(
                f"server_state_dict(): sync={mode.name!r} has no server; save model.state_dict() and "
                "optimizer.state_dict() on rank 0 and broadcast them when resuming, as with Horovod"
            )
        return mode.server_state_dict()

    def speculative(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, a training step (forward, backward, `step()`), run again on fresh parameters each
        time a SpecSync re-sync aborts it (`collsync.torch.speculative`); other modes just call it."""
        spec = self._collsync.spec
        return fn(*args, **kwargs) if spec is None else spec.run(fn, *args, **kwargs)

    @property
    def sync_mode(self) -> str:
        """The mode this optimizer runs: bsp, backup, async, ssp, psp, bfasgd or specsync."""
        return self._collsync.name

    @property
    def version(self) -> int | None:
        """Server modes: the server version of the parameters the model holds (its last pull); else None."""
        return self._collsync.version

    @property
    def aborted(self) -> bool:
        """SpecSync: the last `step()` threw its gradient away (a re-sync came; the model holds fresh parameters,
        the batch was not used). Never True inside `speculative(...)` or with a closure: those re-run instead."""
        spec = self._collsync.spec
        return spec is not None and spec.aborted

    @property
    def specsync(self) -> dict[str, Any] | None:
        """SpecSync: this worker's `aborts`, `wasted_s`, `notifies`, `resync_pull_bytes`, `message_bytes`, and
        `scheduler`, the scheduler's counts (`aborts`, `resyncs`, `notifies`, `abort_time`, `abort_rate`,
        `tunings`, ...), there once the optimizer closed (`close()` or `shutdown()`). None in other modes."""
        spec = self._collsync.spec
        return None if spec is None else spec.summary()

    @property
    def dropped(self) -> int:
        """Backup workers: this worker's gradients that came too late for their round (0 in other modes)."""
        return self._collsync.dropped

    @property
    def caught_up(self) -> int:
        """Backup workers: rounds this worker applied without computing for them, having come late (`catch_up`):
        its sampler skipped that many batches (0 in other modes)."""
        return self._collsync.caught_up

    @property
    def lost(self) -> list[dict[str, Any]]:
        """Server modes: the workers the servers lost (silent for the deadline: stopped, partitioned, dead) and
        went on without, each as `rank` (its `rank()`), `world_rank`, `host` and `last_update` (the last server
        version its gradient was part of); known once the optimizer closed (`close()` or `shutdown()`), [] before.
        bsp under ULFM: the workers that died and were shrunk away, from then on (`last_update`: the reductions
        this optimizer had completed). [] in other modes."""
        return list(self._collsync.lost)

    @property
    def finished(self) -> bool:
        """Server modes: training ended (a worker left a round policy); `step()` no longer changes the model."""
        return self._collsync.finished


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: Any = ops.Compression.none,
    backward_passes_per_step: int = 1,
    op: int = ops.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = ops.global_process_set,
    *,
    sync: Any = None,
    server_state: dict[str, Any] | None = None,
    **sync_options: Any,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that `step()` synchronises the workers as `sync` says (default: what `init(sync=...)`
    set, else "bsp"); returns the same object, its class extended. Horovod's arguments keep Horovod's meaning under
    `bsp`; `sync_options` are the mode's own (`backups=1`, `max_lead=3`, `penalty="gap_aware"`, ... see
    `collsync.torch.sync_config`; after `init(sync=...)` they merge with the options it was given, and a value that
    contradicts one of those is refused naming both). `num_groups` / `groups` only group Horovod's reductions:
    collsync fuses every gradient into one reduction, so they change nothing. `server_state`: server modes, what
    `server_state_dict()` returned in an earlier run: the servers go on from it (the workers pull its parameters).
    `process_set` (`bsp` only): the gradients are reduced over that set's workers; on a worker outside it the
    optimizer steps on its own gradients, as Horovod's does. Sparse gradients (`nn.Embedding(sparse=True)`) under
    `bsp` are reduced as Horovod reduces them: densified with `sparse_as_dense`, else the allgather of their indices
    and values (`sparse_allreduce_async`), `.grad` staying sparse.

    Raises:
        ValueError: a bad option, a mode the world cannot run, an optimizer the parameter server cannot apply.
        NotImplementedError: Adasum, Min/Max/Product, a process set outside `bsp`, sparse gradients without
            `sparse_as_dense` outside `bsp`.
    """
    st = state("DistributedOptimizer")
    _inputs.optimizer(optimizer, "DistributedOptimizer")  # a model passed for it: named before anything reads it
    _inputs.optimizer_args(backward_passes_per_step, gradient_predivide_factor)
    _inputs.compression(compression, "DistributedOptimizer")
    op = _checked_op(op, gradient_predivide_factor, backward_passes_per_step, optimizer)
    on = set_world(st, process_set, "DistributedOptimizer")
    if sync is None:
        sync = st.sync if st.sync is not None else "bsp"
    config = sync_config(sync, **sync_options)
    if named_parameters is not None:  # a list: read twice below (a model's named_parameters() is a generator)
        named_parameters = _inputs.named_parameters(named_parameters)
    params = _params(optimizer, named_parameters)
    if not params:
        raise ValueError("DistributedOptimizer: the optimizer has no parameter that requires a gradient")
    if server_state is not None and not st.servers:
        raise ValueError("DistributedOptimizer: server_state is for server modes; this world reserved no servers")
    mode: Mode
    if on is not st and (st.servers or config.policy.name != "bsp" or st.backend == "horovod"):
        raise NotImplementedError("DistributedOptimizer: process sets are supported with sync='bsp' on mpi4py only")
    if on is None:
        mode = LocalMode(st.comm.Get_rank())
    elif st.servers:
        mode = ServerMode(st, optimizer, params, config, server_state)
    else:
        mode = _serverless(
            on,
            optimizer,
            params,
            config,
            compression,
            backward_passes_per_step,
            op,
            gradient_predivide_factor,
            sparse_as_dense,
            process_set,
        )
    cls = type(optimizer)
    optimizer.__class__ = type(cls.__name__, (_Distributed, cls), {"__module__": cls.__module__})
    optimizer._collsync = mode  # type: ignore[attr-defined]
    optimizer._should_synchronize = True  # type: ignore[attr-defined]
    optimizer._parameter_names = _parameter_names(optimizer, named_parameters)  # type: ignore[attr-defined]
    st.cleanups.append(mode.close)
    # Weakly: once the script drops the optimizer, `join()` is Horovod's plain join again (a later test or phase
    # of a script that joins beside the others' allreduces must not run a forgotten optimizer's reductions).
    st.joiner = weakref.ref(optimizer)
    if mode.spec is not None:
        st.speculating = mode.spec  # `collsync.torch.speculative(step)` runs steps through it
    return optimizer


def _checked_op(op: int, predivide: float, passes: int, optimizer: torch.optim.Optimizer) -> int:
    """Horovod's checks of `DistributedOptimizer`'s arguments (its messages), and collsync's refusals; the op."""
    refused = {ops.Adasum: "Adasum", ops.Min: "Min", ops.Max: "Max", ops.Product: "Product"}
    if op in refused:
        raise NotImplementedError(f"DistributedOptimizer: op={refused[op]} is not supported by collsync (Average, Sum)")
    op = ops._op(op, None, "DistributedOptimizer")
    if predivide != 1.0 and op != ops.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if passes <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if isinstance(optimizer, _Distributed):
        raise ValueError("DistributedOptimizer: this optimizer is wrapped already")
    return op


def _parameter_names(optimizer: torch.optim.Optimizer, named_parameters: Any) -> dict[torch.Tensor, str]:
    """Horovod's `_parameter_names`, which scripts and Horovod's own tests read: each parameter's name, from
    `named_parameters` or, without them, `allreduce.noname.{group}.{index}` as Horovod names them."""
    if named_parameters is None:
        return {
            p: f"allreduce.noname.{i}.{j}"
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        }
    return {p: name for name, p in named_parameters}


def _serverless(
    st: World,
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    config: SyncConfig,
    compression: Any,
    passes: int,
    op: int,
    predivide: float,
    sparse_as_dense: bool,
    process_set: Any = ops.global_process_set,
) -> Mode:
    """The mode of a world without server ranks: bsp (`AllreduceMode`) or backup (`PartialMode`)."""
    name = config.policy.name
    if config.servers:
        raise ValueError(
            f"DistributedOptimizer(sync={name!r}) runs on parameter-server ranks, which are reserved when the "
            f"world starts: call collsync.torch.init(sync={name!r}) (or init(servers=M), or set COLLSYNC_SERVERS)"
        )
    if name == "bsp":
        return AllreduceMode(
            st,
            params,
            compression,
            passes,
            op,
            predivide,
            sparse_as_dense,
            deadline=config.policy.deadline,
            process_set=process_set,
        )
    if name == "backup":
        if compression is not ops.Compression.none or op != ops.Average or predivide != 1.0:
            raise ValueError(
                "DistributedOptimizer(sync='backup'): the partial allreduce averages plain gradients; "
                "compression, op and gradient_predivide_factor are for sync='bsp'"
            )
        return PartialMode(st, params, config, passes=passes, optimizer=optimizer)
    raise ValueError(f"DistributedOptimizer: sync={name!r} has no serverless form; reserve servers at init()")
