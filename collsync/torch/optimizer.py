"""`DistributedOptimizer`: Horovod's wrapper of a torch optimizer, with collsync's sync modes behind `sync=`.

The optimizer you pass is wrapped in place (its class becomes a subclass that adds `synchronize`,
`skip_synchronize` and `join`; `isinstance`, `state_dict` and learning-rate schedulers keep working) and returned.
What `step()` does depends on the mode:

* `bsp` (no servers): Horovod's semantics. `synchronize()` averages (or sums) every gradient over the workers in
  one fused reduction (mpi4py `Iallreduce`, or Horovod's own allreduce with `backend="horovod"`), honouring
  `compression`, `op`, `gradient_predivide_factor` and `backward_passes_per_step` as Horovod does; then your
  optimizer steps on every replica.
* `backup` (no servers): each step t is a k-of-n partial allreduce (`collsync.runtime.mpi_partial`): the first
  n - b gradients of round t to arrive are averaged (000_..., Chen et al., Alg. 3-4), every replica applies that
  same mean with your optimizer, and a gradient that came late is dropped and counted (`dropped`). A worker whose
  round is already complete reads the mean without contributing.
* `async`, `ssp`, `psp`, `bfasgd`, `specsync` (and any mode once `init` reserved servers): the parameter server on
  MPI windows.
  `step()` pushes this worker's gradient to the shards and pulls fresh parameters into the model. The update is
  applied on the servers by collsync's rule made from your optimizer's class and hyperparameters
  (`config.server_rule`) plus the penalty; your optimizer's own state is not used (it stays empty) and a change of
  its learning rate after construction does not reach the servers (warned once). Training ends for everyone when
  the workers leave (`shutdown()`, at exit, or `join()`): under a round policy (BSP, backup, SSP, PSP) as soon as
  one worker leaves, since its rounds can no longer complete; the other workers' `step()` then returns without
  changing the model (`finished` is True).
* `specsync` (004_..., over async or ssp): as above, and the scheduler in server rank 0's loop may abort a gradient
  under way; `collsync.torch.speculative` says where and what `step()` then does (`speculative(step)`,
  `step(closure)`, or `aborted` after a plain `step()`).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from collsync.runtime.mpi_coll import threads_supported
from collsync.torch import ops
from collsync.torch._world import World, state
from collsync.torch.config import SyncConfig, server_rule, sync_config

_PASSES_MESSAGE = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). Increase "
    "backward_passes_per_step to accumulate gradients locally."
)


def _params(optimizer: torch.optim.Optimizer, named_parameters: Any) -> list[torch.Tensor]:
    """The optimizer's trainable parameters; `named_parameters`, when given, must cover them (as Horovod checks)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if named_parameters is None:
        return params
    named = list(named_parameters)
    if any(not isinstance(n, tuple) for n in named):
        raise ValueError("DistributedOptimizer: named_parameters should be a sequence of (name, parameter) tuples")
    names = {id(p) for _, p in named}
    missing = [p for p in params if id(p) not in names]
    if missing:
        raise ValueError(
            f"DistributedOptimizer: named_parameters was given but misses {len(missing)} of the optimizer's "
            "parameters; pass model.named_parameters() of the model the optimizer was built on"
        )
    return params


class _Flat:
    """Parameters (and their gradients) of one dtype copied to and from one contiguous buffer."""

    def __init__(self, params: list[torch.Tensor], flag: bool = False, sparse_as_dense: bool = False) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        dtype = params[0].dtype
        # `flag`: one more element after the gradients, 1 from a worker that steps and 0 from one that joined, so
        # the reduction itself says whether anyone still steps (join without a reduction of its own).
        self.flag = flag
        self.sparse_as_dense = sparse_as_dense
        self.buf = torch.zeros(sum(self.sizes) + int(flag), dtype=dtype)

    def grads(self, active: bool = True) -> torch.Tensor:
        """The gradients into the buffer (a missing gradient counts as zero; all zero once this worker joined)."""
        if self.flag:
            self.buf[-1] = float(active)
        if not active:
            self.buf.zero_()
            return self.buf
        offset = 0
        for p, n in zip(self.params, self.sizes, strict=True):
            view = self.buf[offset : offset + n]
            if p.grad is None:
                view.zero_()
            elif p.grad.is_sparse:
                if not self.sparse_as_dense:
                    raise NotImplementedError(
                        "DistributedOptimizer: sparse gradients are reduced only with sparse_as_dense=True"
                    )
                view.copy_(p.grad.detach().to_dense().reshape(-1))
            else:
                view.copy_(p.grad.detach().reshape(-1))
            offset += n
        return self.buf

    def set_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p, n in zip(self.params, self.sizes, strict=True):
            src = flat[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = src.clone()
            elif p.grad.is_sparse:
                p.grad = src.clone().to_sparse()  # back to sparse for the update, as Horovod does
            else:
                p.grad.detach().copy_(src)
            offset += n

    def set_params(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p, n in zip(self.params, self.sizes, strict=True):
                p.copy_(flat[offset : offset + n].view_as(p))
                offset += n

    def read_params(self) -> torch.Tensor:
        offset = 0
        for p, n in zip(self.params, self.sizes, strict=True):
            self.buf[offset : offset + n].copy_(p.detach().reshape(-1))
            offset += n
        return self.buf


def _one_dtype(params: list[torch.Tensor], mode: str) -> _Flat:
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point or torch.float16 in dtypes:
        raise ValueError(
            f"DistributedOptimizer(sync={mode!r}): parameters must all be float32 or all float64, got "
            f"{sorted(map(str, dtypes))}"
        )
    return _Flat(params)


def _exact_scale(factor: float) -> bool:
    """Multiplying by `factor` (a power of two) rounds nothing, so it commutes with a floating-point sum."""
    return factor > 0 and math.frexp(factor)[0] == 0.5


class _Overlap:
    """bsp's reduction of one flat gradient buffer while backward runs (Horovod's tensor fusion on its background
    thread; Sergeev & Del Balso 2018).

    The parameters' gradients live in `flat.buf`, in buckets of about `BUCKET_BYTES` of whole parameters, last
    parameters first (backward produces them first). When a parameter's last backward pass of the step (of
    `passes`) accumulates its gradient, the hook moves it into its slice of the buffer, scaled on the way, and points
    `p.grad` at that slice, so the reduced mean is where the optimizer reads it and nothing is copied back. A bucket
    whose parameters are all in starts at once on a `CommThread` (buckets strictly in order: MPI matches collectives
    by order, and a rank may finish parameters in another order); `finish()` (from `step()` or `synchronize()`)
    starts what is left, parameters that got no gradient counting as zero, waits, bounded by `deadline`, and sums
    the last bucket itself (`CommThread.run`: nothing is left to overlap it with).

    The mean is Horovod's: g_bar = post * sum_r (pre * g_r). When pre is 1 and post a power of two (1/n for
    Average on a world of 2^k ranks), post is applied before the sum, fused with the move into the buffer: scaling
    by a power of two rounds nothing, so the numbers are the same, and the pass after the sum is saved. Otherwise
    the thread scales each bucket after its sum. The join flag (the buffer's last element, 1 from a worker that
    steps) travels in the first bucket.
    """

    BUCKET_BYTES = 4 * 2**20

    def __init__(self, comm: Any, flat: _Flat, pre: float, post: float, passes: int, deadline: float | None) -> None:
        from collsync.runtime.mpi_coll import CommThread

        self.flat, self.passes, self.deadline = flat, passes, deadline
        if pre == 1.0 and post != 1.0 and _exact_scale(post):
            pre, post = post, 1.0
        self.pre, self.post = pre, post
        buf, params = flat.buf, flat.params
        self.views: list[torch.Tensor] = []
        offset = 0
        for n in flat.sizes:
            self.views.append(buf[offset : offset + n])
            offset += n
        item = buf.element_size()
        self.buckets: list[list[int]] = []
        current: list[int] = []
        held = 0
        for i in reversed(range(len(params))):
            current.append(i)
            held += flat.sizes[i] * item
            if held >= self.BUCKET_BYTES:
                self.buckets.append(current)
                current, held = [], 0
        if current:
            self.buckets.append(current)
        starts = [0, *itertools.accumulate(flat.sizes)][:-1]
        slices = [(starts[b[-1]], starts[b[0]] + flat.sizes[b[0]]) for b in self.buckets]
        slices[0] = (slices[0][0], buf.numel())  # the join flag, after the last parameter
        self.slices = [buf[a:z] for a, z in slices]
        self.arrays = [v.numpy() for v in self.slices]
        self.bucket_of = [0] * len(params)
        for b, members in enumerate(self.buckets):
            for i in members:
                self.bucket_of[i] = b
        self.counts = [0] * len(params)
        self.missing = [len(b) for b in self.buckets]
        self.next = 0
        self.thread = CommThread(comm)

    def hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def counted(p: torch.Tensor) -> None:
            self.counts[index] += 1
            if self.counts[index] > self.passes:
                raise AssertionError(_PASSES_MESSAGE)
            if self.counts[index] < self.passes:
                return
            self._stage(index)
            bucket = self.bucket_of[index]
            self.missing[bucket] -= 1
            while self.next < len(self.buckets) and self.missing[self.next] == 0:
                self._start(self.next)

        return counted

    def _stage(self, index: int) -> None:
        """Parameter `index`'s gradient into its slice of the buffer, times `pre`; `p.grad` becomes that slice."""
        p, view = self.flat.params[index], self.views[index]
        g = p.grad
        if g is None:
            view.zero_()
        elif g.is_sparse:
            raise NotImplementedError(
                "DistributedOptimizer: sparse gradients are reduced only with sparse_as_dense=True"
            )
        elif g.data_ptr() == view.data_ptr() and g.is_contiguous():
            if self.pre != 1.0:
                view.mul_(self.pre)  # accumulated in place (no zero_grad(set_to_none=True) in between)
        elif self.pre != 1.0:
            torch.mul(g.detach().reshape(-1), self.pre, out=view)
        else:
            view.copy_(g.detach().reshape(-1))
        if g is None or g.data_ptr() != view.data_ptr():
            p.grad = view.view_as(p)

    def _start(self, bucket: int) -> None:
        if bucket == 0 and self.flat.flag:
            self.flat.buf[-1] = self.pre  # the join flag: this worker steps
        if bucket < len(self.buckets) - 1:  # the last one is summed by `finish` itself (CommThread.run)
            view = self.slices[bucket]
            self.thread.post(self.arrays[bucket], None if self.post == 1.0 else lambda: view.mul_(self.post))
        self.next = bucket + 1

    def finish(self) -> None:
        """Start the buckets not started yet (their parameters' gradients as they are, None as zero) and wait."""
        while self.next < len(self.buckets):
            for index in self.buckets[self.next]:
                if self.counts[index] < self.passes:
                    self._stage(index)
            self._start(self.next)
        try:
            self.thread.run(self.arrays[-1], self.deadline, "DistributedOptimizer: the gradient allreduce")
            if self.post != 1.0:
                self.slices[-1].mul_(self.post)
        finally:
            self.counts = [0] * len(self.counts)
            self.missing = [len(b) for b in self.buckets]
            self.next = 0

    def idle_round(self) -> torch.Tensor:
        """Join: one reduction with zeros and the flag 0, matching a stepping worker's buckets; the summed buffer."""
        self.flat.buf.zero_()
        for b in range(len(self.buckets) - 1):
            self.thread.post(self.arrays[b])
        self.thread.run(self.arrays[-1], self.deadline, "DistributedOptimizer: join's allreduce")
        return self.flat.buf

    def close(self) -> None:
        self.thread.close()


class AllreduceMode:
    """Full sync (`bsp` without servers), Horovod's numbers: see the module docstring."""

    name = "bsp"

    def __init__(
        self,
        st: World,
        params: list[torch.Tensor],
        compression: Any,
        passes: int,
        op: int,
        predivide: float,
        sparse_as_dense: bool = False,
        deadline: float | None = None,
    ) -> None:
        self.st, self.compression, self.passes, self.op = st, compression, passes, op
        # Horovod's split of the average: 1/f before the sum, f/size after it (the 1/size applied by the reduction).
        self.pre, self.post = (1.0 / predivide, predivide) if op == ops.Average else (1.0, 1.0)
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault(p.dtype, []).append(p)
        self.flats = [_Flat(ps, flag=i == 0, sparse_as_dense=sparse_as_dense) for i, ps in enumerate(groups.values())]
        self.counts = {id(p): 0 for p in params}
        self.synchronized = False
        self.overlap: _Overlap | None = None
        size = st.comm.Get_size()
        if (
            st.backend != "horovod"
            and compression is ops.Compression.none
            and not sparse_as_dense
            and len(self.flats) == 1
            and self.flats[0].buf.dtype in (torch.float32, torch.float64)
            and size > 1
            and threads_supported()
        ):
            post = self.post / size if op == ops.Average else self.post
            self.overlap = _Overlap(st.comm, self.flats[0], self.pre, post, passes, deadline)
            self.handles = [p.register_post_accumulate_grad_hook(self.overlap.hook(i)) for i, p in enumerate(params)]
        else:
            self.handles = [p.register_post_accumulate_grad_hook(self._count) for p in params]

    def _count(self, p: torch.Tensor) -> None:
        self.counts[id(p)] += 1
        if self.counts[id(p)] > self.passes:
            raise AssertionError(_PASSES_MESSAGE)

    def reduce(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Average (or sum) each flat buffer over the workers, through compression, on the chosen backend."""
        out = []
        for flat in flats:
            wire, ctx = self.compression.compress(flat)
            if self.st.backend == "horovod":
                from collsync.runtime.horovod import allreduce_

                allreduce_(wire, self.op, self.pre, self.post)
            else:
                ops.allreduce_(wire, op=self.op, prescale_factor=self.pre, postscale_factor=self.post)
            out.append(self.compression.decompress(wire, ctx))
        return out

    def synchronize(self) -> None:
        if self.overlap is not None:
            self.overlap.finish()
            self.synchronized = True
            return
        means = self.reduce([f.grads() for f in self.flats])
        for flat, mean in zip(self.flats, means, strict=True):
            flat.set_grads(mean)
        for key in self.counts:
            self.counts[key] = 0
        self.synchronized = True

    def step(self, base: Callable[[Any], Any], closure: Any, sync: bool) -> Any:
        if sync:
            if self.synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown.",
                    stacklevel=3,
                )
            self.synchronize()
        self.synchronized = False
        return base(closure)

    def join(self) -> int:
        """Contribute zeros to the gradient reductions of the workers still stepping, until every worker joined
        (Horovod's join, for the optimizer's reductions; other collectives are not matched). Returns the rank
        that joined last."""
        rounds = 0
        while True:
            if self.overlap is not None:
                sums = [self.overlap.idle_round()]
            else:
                sums = self.reduce([f.grads(active=False) for f in self.flats])
            if sums[0][-1].item() == 0:  # nobody stepped in this reduction: everyone has joined
                break
            rounds += 1
        joined = ops.allgather_object(rounds)
        return max(r for r, k in enumerate(joined) if k == min(joined))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self.overlap is not None:
            self.overlap.close()


class PartialMode:
    """Backup workers without servers: see the module docstring."""

    name = "backup"

    def __init__(self, st: World, params: list[torch.Tensor], config: SyncConfig, passes: int = 1) -> None:
        from collsync.loops import check_policy
        from collsync.runtime.mpi_partial import PartialAllreduce

        self.st = st
        policy = config.policy
        check_policy(policy)
        workers = st.comm.Get_size()
        policy.check(workers)
        self.quorum = policy.quorum_for(workers)
        self.flat = _one_dtype(params, policy.name)
        self.round = 0
        self.dropped = 0
        self.overlap: _Overlap | None = None
        self.handles: list[Any] = []
        self.pa: Any = None
        if self.quorum == workers > 1 and threads_supported():
            # b = 0: nobody is ever dropped, so this is bsp; it takes bsp's path (buckets reduced while backward
            # runs) rather than n window round trips a step.
            self.overlap = _Overlap(st.comm, self.flat, 1.0, 1.0 / workers, passes, policy.deadline)
            self.handles = [p.register_post_accumulate_grad_hook(self.overlap.hook(i)) for i, p in enumerate(params)]
            return
        self.pa = PartialAllreduce(
            st.comm, self.flat.buf.numel(), dtype=self.flat.buf.dtype, depth=config.depth, timeout=policy.deadline
        )

    def synchronize(self) -> None:
        if self.overlap is not None:
            self.overlap.finish()
            self.round += 1
            return
        result = self.pa.try_read(self.quorum, self.round)
        if result is None:
            result = self.pa(self.flat.grads(), self.quorum, self.round)
        self.dropped += self.st.comm.Get_rank() not in result.contributors
        self.round += 1
        self.flat.set_grads(result.mean)

    def step(self, base: Callable[[Any], Any], closure: Any, sync: bool) -> Any:
        if sync:
            self.synchronize()
        return base(closure)

    def join(self) -> int:
        raise NotImplementedError(
            "join() under sync='backup': every worker must take part in every round of the partial allreduce; "
            "give every worker the same number of steps (e.g. drop_last=True)"
        )

    def close(self) -> None:
        from collsync.runtime.mpi_coll import shutdown

        shutdown(self.st.comm)
        for handle in self.handles:
            handle.remove()
        if self.overlap is not None:
            self.overlap.close()
        else:
            self.pa.free()


class ServerMode:
    """A worker of the parameter-server shards: see the module docstring. `step()` is `loops.push` then
    `loops.pull`, the two halves of the worker loop `collsync-train` runs (`loops.run_worker`)."""

    def __init__(
        self,
        st: World,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        config: SyncConfig,
        server_state: dict[str, Any] | None = None,
    ) -> None:
        from collsync.loops import Worker
        from collsync.runtime.mpi_shards import Shards
        from collsync.torch._serve import Job, send_job

        policy = config.policy
        self.name = policy.name
        self.st = st
        workers = st.comm.Get_size()
        policy.check(workers)
        rule = config.rule if config.rule is not None else server_rule(optimizer)
        self.flat = _one_dtype(params, policy.name)
        numel = self.flat.buf.numel()
        if numel < st.servers:
            raise ValueError(f"DistributedOptimizer: {numel} parameters cannot be split over {st.servers} servers")
        self.params = self.flat.read_params().clone()
        shard_states = _shard_states(server_state, st.servers, policy.name)
        if st.comm.Get_rank() == 0:
            job = Job(self.params.clone(), policy, rule, config.penalty, workers, state=shard_states)
            send_job(st.world, st.servers, job)
        self.shards = Shards(st.world, numel, st.servers, self.flat.buf.dtype)
        self.mailbox = self.shards.worker_mailbox(policy.pull_fraction, policy.pull_timeout)
        self.worker = Worker(self.mailbox.worker, policy)
        self.lrs = [g.get("lr") for g in optimizer.param_groups]
        self.optimizer = optimizer
        self.deadline = policy.deadline
        self.finished = False
        self.left = False
        self.closed = False
        self.spec: Any = None
        if policy.speculation is not None:
            from collsync.torch.speculative import Speculating

            # SpecSync: the messages' communicator, right after the shards, as the servers make theirs.
            self.spec = Speculating(self, st.world, params, policy.speculation)
        self._pull()
        if self.spec is not None:
            self.spec.computing()  # the first gradient: no notify before it (Alg. 2 notifies after a push)

    def _pull(self) -> None:
        from collsync.loops import pull

        if pull(self.worker, self.mailbox, self.params).done:
            self.finished = True
        else:
            self.flat.set_params(self.params)  # a fetch B-FASGD skipped leaves `params` as it was: no change

    def synchronize(self) -> None:
        """Nothing to average locally: the gradient goes to the servers at `step()` (clip it in between)."""

    def step(self, base: Callable[[Any], Any], closure: Any, sync: bool) -> Any:
        if self.spec is not None:
            # SpecSync: the closure re-runs on an abort; without one, an abort here throws the gradient away.
            return self.spec.step(closure, self._send)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.finished:
            return loss
        self._send()
        return loss

    def _send(self) -> None:
        """Push this worker's gradient and pull fresh parameters into the model (SpecSync: wait, then notify)."""
        from collsync.loops import push

        if [g.get("lr") for g in self.optimizer.param_groups] != self.lrs:
            self.lrs = [g.get("lr") for g in self.optimizer.param_groups]
            warnings.warn(
                f"DistributedOptimizer(sync={self.name!r}): the learning rate changed to {self.lrs}, but the "
                "parameter server applies the rule it was given at construction",
                stacklevel=5 if self.spec is not None else 4,
            )
        push(self.worker, self.mailbox, self.flat.grads().clone())
        if self.spec is not None:
            self.spec.before_pull()
        self._pull()
        if self.spec is not None:
            self.spec.pulled()

    @property
    def version(self) -> int:
        """The server version of the parameters the model holds (the last pull)."""
        return self.worker.version

    def join(self) -> int:
        self.leave()
        return self.st.comm.Get_rank()

    def server_state_dict(self) -> dict[str, Any]:
        from collsync.torch._serve import server_states

        if self.st.comm.Get_rank() != 0:
            raise ValueError("server_state_dict(): only worker 0 (rank() == 0) asks the servers for their state")
        if self.closed:
            raise ValueError("server_state_dict(): this optimizer is closed and its servers gone; ask before close()")

        def seen_the_end() -> None:
            if not self.left and self.mailbox.peek().done:
                self.leave()  # training ended (another worker left a round policy): the servers wait for us

        shards = server_states(self.st.world, self.st.servers, seen_the_end)
        return {"format": 1, "sync": self.name, "shards": shards}

    def leave(self) -> None:
        if not self.left:
            self.mailbox.leave()
            self.left = True
            self.finished = True
            if self.spec is not None:
                self.spec.leave()

    def close(self) -> None:
        self.leave()
        self.closed = True
        if self.spec is not None:
            # The scheduler answers every worker's BYE once all came: the end marker, then its counts.
            self.spec.drain(self.deadline)
        self.shards.close()
        if self.spec is not None:
            self.spec.close()


def _shard_states(saved: dict[str, Any] | None, servers: int, name: str) -> list[dict[str, Any]] | None:
    """The per-shard states of `server_state_dict()`'s result, checked against this world."""
    if saved is None:
        return None
    if not isinstance(saved, dict) or saved.get("format") != 1 or "shards" not in saved:
        raise ValueError("server_state: not what DistributedOptimizer.server_state_dict() returns")
    if len(saved["shards"]) != servers:
        raise ValueError(f"server_state: saved from {len(saved['shards'])} server(s), this world has {servers}")
    if saved.get("sync") != name:
        raise ValueError(f"server_state: saved under sync={saved.get('sync')!r}, resumed under sync={name!r}")
    return list(saved["shards"])


class _Distributed:
    """Mixed in front of the user's optimizer class (its name kept): Horovod's extra methods."""

    _collsync: Any
    _should_synchronize: bool

    def step(self, closure: Any = None) -> Any:
        return self._collsync.step(super().step, closure, self._should_synchronize)  # type: ignore[misc]

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
        if st.joiner == mode.join:
            st.joiner = None
        if st.speculating is not None and st.speculating is getattr(mode, "spec", None):
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
        spec = getattr(self._collsync, "spec", None)
        return fn(*args, **kwargs) if spec is None else spec.run(fn, *args, **kwargs)

    @property
    def sync_mode(self) -> str:
        """The mode this optimizer runs: bsp, backup, async, ssp, psp, bfasgd or specsync."""
        return self._collsync.name

    @property
    def version(self) -> int | None:
        """Server modes: the server version of the parameters the model holds (its last pull); else None."""
        return getattr(self._collsync, "version", None)

    @property
    def aborted(self) -> bool:
        """SpecSync: the last `step()` threw its gradient away (a re-sync came; the model holds fresh parameters,
        the batch was not used). Never True inside `speculative(...)` or with a closure: those re-run instead."""
        spec = getattr(self._collsync, "spec", None)
        return spec is not None and spec.aborted

    @property
    def specsync(self) -> dict[str, Any] | None:
        """SpecSync: this worker's `aborts`, `wasted_s`, `notifies`, `resync_pull_bytes`, `message_bytes`, and
        `scheduler`, the scheduler's counts (`aborts`, `resyncs`, `notifies`, `abort_time`, `abort_rate`,
        `tunings`, ...), there once the optimizer closed (`close()` or `shutdown()`). None in other modes."""
        spec = getattr(self._collsync, "spec", None)
        return None if spec is None else spec.summary()

    @property
    def dropped(self) -> int:
        """Backup workers: this worker's gradients that came too late for their round (0 in other modes)."""
        return getattr(self._collsync, "dropped", 0)

    @property
    def finished(self) -> bool:
        """Server modes: training ended (a worker left a round policy); `step()` no longer changes the model."""
        return getattr(self._collsync, "finished", False)


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
    `collsync.torch.sync_config`). `num_groups` / `groups` only group Horovod's reductions: collsync fuses every
    gradient into one reduction, so they change nothing. `server_state`: server modes, what
    `server_state_dict()` returned in an earlier run: the servers go on from it (the workers pull its parameters).

    Raises:
        ValueError: a bad option, a mode the world cannot run, an optimizer the parameter server cannot apply.
        NotImplementedError: Adasum, process sets, sparse gradients without `sparse_as_dense`.
    """
    st = state("DistributedOptimizer")
    ops._process_set(process_set, "DistributedOptimizer")
    if op == ops.Adasum:
        raise NotImplementedError("DistributedOptimizer: op=Adasum is not supported by collsync")
    op = ops._op(op, None, "DistributedOptimizer")
    if gradient_predivide_factor != 1.0 and op != ops.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if isinstance(optimizer, _Distributed):
        raise ValueError("DistributedOptimizer: this optimizer is wrapped already")
    if sync is None:
        sync = st.sync if st.sync is not None else "bsp"
    config = sync_config(sync, **sync_options)
    params = _params(optimizer, named_parameters)
    if not params:
        raise ValueError("DistributedOptimizer: the optimizer has no parameter that requires a gradient")
    mode: Any
    name = config.policy.name
    if server_state is not None and not st.servers:
        raise ValueError("DistributedOptimizer: server_state is for server modes; this world reserved no servers")
    if st.servers:
        mode = ServerMode(st, optimizer, params, config, server_state)
    elif config.servers:
        raise ValueError(
            f"DistributedOptimizer(sync={name!r}) runs on parameter-server ranks, which are reserved when the "
            f"world starts: call collsync.torch.init(sync={name!r}) (or init(servers=M), or set COLLSYNC_SERVERS)"
        )
    elif name == "bsp":
        mode = AllreduceMode(
            st,
            params,
            compression,
            backward_passes_per_step,
            op,
            gradient_predivide_factor,
            sparse_as_dense,
            deadline=config.policy.deadline,
        )
    elif name == "backup":
        if compression is not ops.Compression.none or op != ops.Average or gradient_predivide_factor != 1.0:
            raise ValueError(
                "DistributedOptimizer(sync='backup'): the partial allreduce averages plain gradients; "
                "compression, op and gradient_predivide_factor are for sync='bsp'"
            )
        mode = PartialMode(st, params, config, passes=backward_passes_per_step)
    else:
        raise ValueError(f"DistributedOptimizer: sync={name!r} has no serverless form; reserve servers at init()")
    cls = type(optimizer)
    optimizer.__class__ = type(cls.__name__, (_Distributed, cls), {"__module__": cls.__module__})
    optimizer._collsync = mode  # type: ignore[attr-defined]
    optimizer._should_synchronize = True  # type: ignore[attr-defined]
    st.cleanups.append(mode.close)
    st.joiner = mode.join
    if getattr(mode, "spec", None) is not None:
        st.speculating = mode.spec  # `collsync.torch.speculative(step)` runs steps through it
    return optimizer
