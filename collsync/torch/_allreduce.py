"""`bsp` without servers: Horovod's semantics and numbers (see `collsync.torch.optimizer`).

`synchronize()` averages (or sums) every gradient over the workers in one fused reduction, honouring
`compression`, `op`, `gradient_predivide_factor` and `backward_passes_per_step` as Horovod does; then the user's
optimizer steps on every replica. Where it can (one dtype, no compression, mpi4py with threads, more than one
worker), the reduction runs in buckets while backward goes on (`runtime.mpi_buckets.BucketReducer`, the one
`collsync-train` uses); else it is one `ops.allreduce_` (or Horovod's own, with `backend="horovod"`) of the
gradients copied into one buffer.

Under ULFM (Open MPI 5's `mpirun --with-ft ulfm`) the bucketed reduction survives a worker that dies: the reducer
shrinks the workers' communicator and does the step's reduction again over the n - 1 left (`runtime.mpi_ulfm`);
here the mean's divisor, the world (`size()`, `rank()`), and `collsync.torch.DistributedSampler`'s shards follow,
and `opt.lost` names the worker. The step and the user's optimizer go on as if nothing happened. Inside
`hvd.elastic.run` the step is not done again: after the shrink `synchronize()` raises `HorovodInternalError`, as
Horovod's does, and `run` rolls the state back to its last commit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from collsync import ending
from collsync.flat import ParamBuffer
from collsync.runtime.horovod import allreduce_ as horovod_allreduce_
from collsync.runtime.mpi_buckets import PASSES_MESSAGE, BucketReducer
from collsync.runtime.mpi_coll import threads_supported
from collsync.runtime.mpi_ulfm import Shrank, Shrunk
from collsync.runtime.mpi_world import host_of
from collsync.say import say
from collsync.torch import _mode, _ulfm, _world, ops, sampler
from collsync.torch._mode import Mode
from collsync.torch._names import forget
from collsync.torch._ops_base import HorovodInternalError
from collsync.torch._ops_reduce import _allreduce_start
from collsync.torch._world import World


class AllreduceMode(Mode):
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
        process_set: Any = ops.global_process_set,
    ) -> None:
        # `st.comm` is the process set's communicator where the optimizer reduces over one (`process_set`).
        self.st, self.compression, self.passes, self.op = st, compression, passes, op
        self.process_set = process_set
        # Horovod's split of the average: 1/f before the sum, f/size after it (the 1/size applied by the reduction).
        self.pre, self.post = (1.0 / predivide, predivide) if op == ops.Average else (1.0, 1.0)
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault(p.dtype, []).append(p)
        self.flats = [
            ParamBuffer(ps, flag=i == 0, sparse_as_dense=sparse_as_dense, sparse=True)
            for i, ps in enumerate(groups.values())
        ]
        self.counts = {id(p): 0 for p in params}
        self.synchronized = False
        self.checked = False  # whether the workers agreed on the buffers' types and sizes (at the first reduction)
        self.reducer: BucketReducer | None = None
        self._lost: list[dict[str, Any]] = []
        self.handles: list[Any] = []
        self._unregister: Callable[[], None] = lambda: None
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
            self.reducer = BucketReducer(
                st.comm,
                self.flats[0],
                _mode.BUCKET_BYTES,
                pre=self.pre,
                post=post,
                passes=passes,
                deadline=deadline,
                what="DistributedOptimizer: the gradient allreduce",
            )
            if self.reducer.ulfm and process_set is ops.global_process_set:
                self.reducer.on_shrink.append(self._shrunk)
                # A failure first seen by another collective shrinks the world through this reducer (`_ulfm`).
                self._unregister = _ulfm.register(self.reducer.leave)
        else:
            self.handles = [p.register_post_accumulate_grad_hook(self._count) for p in params]

    @property
    def lost(self) -> list[dict[str, Any]]:
        """The workers that died and were shrunk away (ULFM), as `ending.lost_rank` records them."""
        return self._lost

    def _shrunk(self, shrunk: Shrunk) -> None:
        """The workers' communicator shrank after a worker died (see the module): the rest follows it."""
        old, n = self.st.comm, shrunk.comm.Get_size()
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        world = old.Get_group().Translate_ranks(shrunk.lost, MPI.COMM_WORLD.Get_group())
        self._lost.extend(
            ending.lost_rank(r, host_of(old, r), self._completed(), int(w))
            for r, w in zip(shrunk.lost, world, strict=True)
        )
        if self.reducer is not None and self.op == ops.Average:
            self.reducer.post = self.post / n
        _world.shrunk(old, shrunk.comm)
        forget(old)
        sampler.follow_world(n, shrunk.comm.Get_rank())
        if shrunk.comm.Get_rank() == 0:
            named = ", ".join(f"worker {r} on {host_of(old, r)}" for r in shrunk.lost)
            say(f"collsync: {named} died; going on in place with {n} of {shrunk.was} workers (ULFM)")

    def _completed(self) -> int | None:
        """The reductions this optimizer completed: the last step a lost worker took part in."""
        return None if self.reducer is None else self.reducer.completed

    def _count(self, p: torch.Tensor) -> None:
        self.counts[id(p)] += 1
        if self.counts[id(p)] > self.passes:
            raise AssertionError(PASSES_MESSAGE)

    def reduce(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Average (or sum) each flat buffer over the workers, through compression, on the chosen backend."""
        out = []
        for flat in flats:
            wire, ctx = self.compression.compress(flat)
            if self.st.backend == "horovod":
                horovod_allreduce_(wire, self.op, self.pre, self.post)
            else:
                # The workers agree on the buffers' layout at the first reduction only (the same buffers every step).
                what = "DistributedOptimizer: the gradient allreduce"
                args = (self.op, self.pre, self.post, what, True, self.process_set)
                _allreduce_start(wire, wire, *args, check=not self.checked).wait()
            out.append(self.compression.decompress(wire, ctx))
        self.checked = True
        return out

    def synchronize(self) -> None:
        if self.reducer is not None:
            # Inside hvd.elastic.run a lost worker rolls the state back to its last commit: no redo of this step.
            self.reducer.redo = not (self.st.elastic and self.process_set is ops.global_process_set)
            try:
                self.reducer.wait()
            except Shrank as exc:
                raise HorovodInternalError(f"collsync.torch: worker {self.st.comm.Get_rank()}: {exc}") from exc
        else:
            means = self.reduce([f.grads() for f in self.flats])
            for flat, mean in zip(self.flats, means, strict=True):
                flat.set_grads(mean)
            for key in self.counts:
                self.counts[key] = 0
        self._sparse()
        self.synchronized = True

    def _sparse(self) -> None:
        """The sparse gradients (an `nn.Embedding(sparse=True)`'s, without `sparse_as_dense`), held aside by the
        buffers: each reduced as Horovod reduces it, the allgather of its indices and values
        (`ops.sparse_allreduce_async`: the sum of the workers' sparse gradients, uncoalesced, divided by the number
        of workers for Average), all started before any is waited for, in parameter order on every worker."""
        for flat in self.flats:
            if not flat.sparse:
                continue
            waits = [
                (flat.params[i], ops.sparse_allreduce_async(g, op=self.op, process_set=self.process_set))
                for i, g in sorted(flat.sparse.items())
            ]
            flat.sparse.clear()
            for p, wait in waits:
                p.grad = wait()

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
            if self.reducer is not None:
                sums = [self.reducer.idle_round()]
            else:
                sums = self.reduce([f.grads(active=False) for f in self.flats])
            if sums[0][-1].item() == 0:  # nobody stepped in this reduction: everyone has joined
                break
            rounds += 1
        joined = ops.allgather_object(rounds, process_set=self.process_set)
        return max(r for r, k in enumerate(joined) if k == min(joined))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self._unregister()
        if self.reducer is not None:
            self.reducer.remove()
