"""Gradient buckets summed while the backward pass runs, on a `mpi_thread.CommThread`: the one `BucketReducer`,
behind both fronts: `collsync.torch`'s `DistributedOptimizer(sync="bsp")` (and backup with b = 0) on a
`ParamBuffer` of the user's parameters, and `collsync-train`'s `runtime=allreduce` on a `FlatModel`'s (Horovod's
tensor fusion on its background thread, Sergeev & Del Balso 2018; PyTorch DDP's gradient buckets, Li et al. 2020).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

import math
from collections.abc import Callable
from typing import Any

import torch

from collsync.flat import ParamBuffer
from collsync.runtime import mpi_ulfm
from collsync.runtime.mpi_coll import shutdown, threads_supported, wait
from collsync.runtime.mpi_thread import CommThread
from collsync.runtime.mpi_world import gate, lost
from collsync.types import Flat

DEFAULT_BUCKET_BYTES = 4 * 2**20

PASSES_MESSAGE = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). Increase "
    "backward_passes_per_step to accumulate gradients locally."
)


_IDLE, _ACTIVE, _REDUCED = 0, 1, 2


def _exact_scale(factor: float) -> bool:
    """Multiplying by `factor` (a power of two) rounds nothing, so it commutes with a floating-point sum."""
    return factor > 0 and math.frexp(factor)[0] == 0.5


class BucketReducer:
    """Sums `buffer`'s gradients over `comm` while backward runs: g_bar = post * sum_r (pre * g_r), each rank's
    `buffer.buf` then holding the same g_bar. `post=None`: the mean (1/n) sum_r g_r, divided by the world size as
    `MpiCollective.allreduce_mean` and the simulator divide (`collsync-train`); a number: multiplied by it, as
    Horovod applies its postscale factor (`collsync.torch`, whose Average passes 1/n).

    Buckets are contiguous slices of `buffer.buf` made of whole parameters, last parameter first (backward produces
    the last layers first); a bucket closes once it holds at least `bucket_bytes` (`bucket_bytes=1`: one parameter
    per bucket). The buffer's join flag (see `ParamBuffer`) travels in the first bucket. A post-accumulate-grad hook
    counts each parameter in: on its last backward pass of the step (of `passes`) it moves the gradient into its
    slice, times `pre`, and points `p.grad` at that slice, so the result is where the optimizer reads it and nothing
    is copied back (a `FlatModel`'s gradients are there already). A bucket whose parameters are all in starts.

    Buckets start strictly in bucket order: MPI matches collectives on a communicator by order, and backward may
    finish parameters in another order on another rank (a parameter unused there, data-dependent control flow).
    `wait()` (or, with `eager`, the end of backward: a callback queued on autograd's engine, as DDP does) starts the
    buckets not started yet, their gradients counting as they are (None as zero), so an unused parameter cannot
    hang the step; then it waits, bounded by `deadline` seconds, and scales. Every rank scales the same sums the
    same way, so the replicas stay bit-identical. With pre = 1 and a power-of-two `post` (1/n on 2^k ranks), `post`
    is applied before the sum instead, fused with the move into the buffer: a power-of-two scale rounds nothing,
    so the numbers are the same and the pass after the sum is saved.

    `thread` (the default wherever MPI allows threads and there is more than one rank): each bucket but the last is
    summed, and scaled, on a `CommThread` while backward goes on; the last is summed by the waiting thread itself
    (nothing is left to overlap it with). Else each bucket is an `Iallreduce` started from the hook, and `poll`
    tests the buckets in flight from every hook: MPICH moves a nonblocking collective only while its rank is inside
    an MPI call, so without this a bucket started early makes no progress until the end of backward.

    A rank whose backward reached no parameter runs no hook and no callback; it must call `wait()` to join the
    step's reduction (`averaged` does). Construction and `remove()` are collective over `comm`.

    Under ULFM (`mpi_ulfm.enabled`) a rank that dies costs no restart: each started bucket's own contribution is
    kept (`_mine`) and so is the last mean (`_last`), two copies of the buffer a step; the reduction that reports
    the failure revokes and shrinks `comm`, the survivors agree on the step (`mpi_ulfm.plan`: one behind takes the
    last mean), the thread is made again on the survivors' communicator, `on_shrink`'s callbacks get the
    `mpi_ulfm.Shrunk` (a caller's world, data and scale follow it), and the open reduction is done again over
    n - 1 (`post=None`: the mean of n - 1). With `redo` False (`hvd.elastic`, which rolls back to its last commit)
    the open reduction is left instead: the survivors agree on the count of reductions only, and `wait()` raises
    `mpi_ulfm.Shrank`; the next backward pass starts a new reduction on the survivors' communicator.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        buffer: ParamBuffer,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        pre: float = 1.0,
        post: float | None = None,
        passes: int = 1,
        eager: bool = False,
        thread: bool | None = None,
        poll: bool = True,
        deadline: float | None = None,
        what: str = "a gradient bucket's allreduce",
    ) -> None:
        from mpi4py import MPI  # lazily: collsync's modules import without an MPI library

        if bucket_bytes < 1:
            raise ValueError(f"BucketReducer: {bucket_bytes=} must be >= 1")
        if buffer.buf.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"BucketReducer: gradients must be float32 or float64, got {buffer.buf.dtype}")
        if passes < 1:
            raise ValueError(f"BucketReducer: {passes=} must be >= 1")
        self.MPI = MPI
        self.buffer = buffer
        self.size: int = comm.Get_size()
        self.ulfm = self.size > 1 and mpi_ulfm.enabled()
        self.comm = mpi_ulfm.errors_return(comm) if self.ulfm else comm
        # Kept under ULFM to do a reduction again after a failure: this rank's contribution, and the last mean.
        self._mine = torch.empty_like(buffer.buf) if self.ulfm else buffer.buf
        self._last = torch.empty_like(buffer.buf) if self.ulfm else buffer.buf
        self.completed = 0  # reductions completed (the survivors of a failure compare them: `mpi_ulfm.plan`)
        self.on_shrink: list[Callable[[mpi_ulfm.Shrunk], None]] = []
        self.redo = True  # after a shrink, do the open reduction again (False: leave it, raise mpi_ulfm.Shrank)
        self._also: list[MPI.Comm | None] = []  # communicators the next shrink revokes too (`leave`)
        self._failed: BaseException | None = None  # a failure raised where it cannot be handled (a hook)
        # Under ULFM `post` stays after the sum: a shrink changes the divisor, and the kept contribution must not
        # hold a 1/n already.
        if not self.ulfm and post is not None and pre == 1.0 and post != 1.0 and _exact_scale(post):
            pre, post = post, 1.0
        self.pre, self.post = pre, post
        self.passes, self.eager, self.poll, self.what = passes, eager, poll, what
        self.deadline = deadline  # seconds a bucket may take before a rank counts as stopped (None: no limit)
        self.buckets = _buckets(buffer.sizes, buffer.buf.element_size(), bucket_bytes)
        starts, sizes = buffer.starts, buffer.sizes
        self.slices: list[tuple[int, int]] = [(starts[b[-1]], starts[b[0]] + sizes[b[0]]) for b in self.buckets]
        if buffer.flag:
            self.slices[0] = (self.slices[0][0], buffer.buf.numel())  # the join flag, after the last parameter
        self._views = [buffer.buf[a:z] for a, z in self.slices]
        self._arrays = [v.numpy() for v in self._views]
        self._bucket_of = [0] * len(sizes)
        for b, members in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = b
        self._reset()
        self._state = _IDLE
        if thread is None:
            thread = self.size > 1 and threads_supported()
        if thread and deadline is not None:
            gate(comm, deadline, f"{what}'s set-up")  # the thread's Dup waits for every rank, unbounded
        self._thread = CommThread(comm) if thread else None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(buffer.params)]

    def _reset(self) -> None:
        self._counts = [0] * len(self.buffer.params)
        self._missing = [len(b) for b in self.buckets]
        self._next = 0
        self._requests: list[Any] = []

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        bucket = self._bucket_of[index]

        def hook(param: torch.Tensor) -> None:
            if self._state != _ACTIVE:
                self._begin()
            self._counts[index] += 1
            if self._counts[index] > self.passes:
                raise AssertionError(PASSES_MESSAGE)
            if self._counts[index] < self.passes:
                return
            self._stage(index)
            self._missing[bucket] -= 1
            while self._next < len(self.buckets) and self._missing[self._next] == 0:
                self._start(self._next)
            if self.poll and self._requests and self._thread is None:
                self.MPI.Request.Testall(self._requests)

        return hook

    def _begin(self) -> None:
        """The first hook of a step: re-arm the counters; with `eager`, finish the step when backward ends."""
        self._reset()
        self._state = _ACTIVE
        if self.eager:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _stage(self, index: int) -> None:
        """Parameter `index`'s gradient into its slice of the buffer, times `pre`; `p.grad` becomes that slice."""
        p, view = self.buffer.params[index], self.buffer.views[index]
        g = p.grad
        if g is None:
            view.zero_()
        elif g.is_sparse and self.buffer.sparse_aside:
            view.zero_()  # held aside for a reduction of its own (see `ParamBuffer`); `p.grad` stays sparse
            self.buffer.sparse[index] = g
            return
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
            view.copy_(g.detach().reshape(-1))  # autograd put a new tensor in .grad: move it into the buffer
        if g is None or g.data_ptr() != view.data_ptr():
            p.grad = view.view_as(p)

    def _scaler(self, view: Flat) -> Callable[[], object] | None:
        """What follows a bucket's sum: the division by the world size, the multiplication by `post`, or nothing."""
        if self.post is None:
            return None if self.size == 1 else lambda: view.div_(self.size)
        post = self.post
        return None if post == 1.0 else lambda: view.mul_(post)

    def _start(self, bucket: int) -> None:
        if bucket == 0 and self.buffer.flag:
            self.buffer.buf[-1] = self.pre  # the join flag: this worker steps
        if self.ulfm:
            a, z = self.slices[bucket]
            self._mine[a:z].copy_(self._views[bucket])
        if self._thread is None:
            try:
                self._requests.append(self.comm.Iallreduce(self.MPI.IN_PLACE, self._arrays[bucket], op=self.MPI.SUM))
            except self.MPI.Exception as exc:  # from a hook inside backward: handled once the step waits
                if not self.ulfm:
                    raise
                self._failed = exc
        elif bucket < len(self.buckets) - 1:  # the last one is summed by `_finish` itself, in this thread
            self._thread.post(self._arrays[bucket], self._scaler(self._views[bucket]))
        self._next = bucket + 1

    def _finish(self) -> None:
        try:
            if self.ulfm:
                mpi_ulfm.recovering(self._reduce, self._recover, self._comms)
            else:
                self._reduce()
        except TimeoutError as exc:  # a collective cannot say whom it waits for: the roll call names them
            raise lost(self.comm, str(exc), self.deadline) from None
        except self.MPI.Exception as exc:
            if self.ulfm or not mpi_ulfm.failure(exc, *self._comms()):
                raise
            raise RuntimeError(f"{self.what}: {mpi_ulfm.NOT_THERE}") from exc

    def _comms(self) -> list[MPI.Comm | None]:
        """The communicators this reducer's sums run on now (its own, its thread's)."""
        return [self.comm, None if self._thread is None else self._thread.comm]

    def leave(self, error: BaseException, *also: MPI.Comm) -> None:
        """A failure first seen outside this reducer (a collective of the caller's on the same ranks): revoke `also`
        and recover as a reducer that saw it would, without the redo (survivors that saw it here meet these in the
        same calls); raises `mpi_ulfm.Shrank`."""
        self.redo = False
        self._also = list(also)
        self._recover(error)

    def _recover(self, error: BaseException) -> None:
        """After a process failure (see the class): shrink, agree on the step, rebuild, and set up the redo."""
        also, self._also = [*self._also, None if self._thread is None else self._thread.comm], []
        shrunk = mpi_ulfm.shrink(self.comm, *also)
        threaded = self._thread is not None
        if self._thread is not None:
            self._thread.abandon()
            self._thread = None
        self.comm, self.size, self._failed = shrunk.comm, shrunk.comm.Get_size(), None
        if not self.redo:
            self._leave(shrunk, threaded)
        agreed = mpi_ulfm.plan(self.comm.allgather(self.completed))
        behind = self.comm.Get_rank() in agreed.behind
        if agreed.behind:  # the last mean, from a rank that applied it, to those that did not get it
            into = self.buffer.buf if behind else self._last
            self.comm.Bcast(into.numpy(), root=agreed.root)
        if threaded:
            self._thread = CommThread(self.comm)
        for then in self.on_shrink:
            then(shrunk)
        if behind:
            self._done()
            return
        for b in range(self._next):  # the buckets started: their sums may be partial, so back to this rank's own
            a, z = self.slices[b]
            self.buffer.buf[a:z].copy_(self._mine[a:z])
        self._next, self._requests, self._state = 0, [], _ACTIVE

    def _leave(self, shrunk: mpi_ulfm.Shrunk, threaded: bool) -> None:
        """`_recover` without the redo: the survivors, who may be one reduction apart (see `mpi_ulfm.plan`), agree
        on the highest count (so a later failure's plan holds), the reducer is made idle, and `Shrank` is raised:
        the caller's state goes back to before the step, so no mean of the step is wanted."""
        self.completed = max(self.comm.allgather(self.completed))
        if threaded:
            self._thread = CommThread(self.comm)
        for then in self.on_shrink:
            then(shrunk)
        self._reset()
        self._state = _IDLE
        raise mpi_ulfm.Shrank(shrunk, self.what)

    def _done(self) -> None:
        self._state = _REDUCED
        self.completed += 1
        if self.ulfm:
            self._last.copy_(self.buffer.buf)

    def _reduce(self) -> None:
        if self._state == _REDUCED:  # a rank behind at a failure: it took the last mean (`_recover`)
            return
        if self._failed is not None:
            raise self._failed
        while self._next < len(self.buckets):
            for index in self.buckets[self._next]:
                if self._counts[index] < self.passes:
                    self._stage(index)
            self._start(self._next)
        if self._failed is not None:
            raise self._failed
        if self._thread is not None:
            self._thread.run(self._arrays[-1], self.deadline, self.what)
            _call(self._scaler(self._views[-1]))
        else:
            for request, view in zip(self._requests, self._views, strict=True):
                wait(request, self.deadline, self.what)
                _call(self._scaler(view))
            self._requests = []
        self._done()

    def wait(self) -> Flat:
        """The reduced gradient, `buffer.buf` itself. After an `eager` backward pass that reached a parameter it was
        reduced already (at the end of backward); otherwise the buckets not started yet start now (on a rank whose
        backward reached no parameter: all of them). Call once per step."""
        if self._state == _IDLE:
            self._reset()
        if self._state != _REDUCED:
            self._finish()  # after a failed backward (_ACTIVE), only the buckets not yet started start
        self._state = _IDLE
        return self.buffer.buf

    def idle_round(self) -> Flat:
        """Join: one reduction with zeros (the join flag 0) matching a stepping worker's buckets; the summed buffer,
        unscaled (its flag counts the workers that stepped)."""
        self.buffer.buf.zero_()
        what = f"{self.what} (join)"
        if self._thread is None:
            for array in self._arrays:
                wait(self.comm.Iallreduce(self.MPI.IN_PLACE, array, op=self.MPI.SUM), self.deadline, what)
            return self.buffer.buf
        for array in self._arrays[:-1]:
            self._thread.post(array)
        self._thread.run(self._arrays[-1], self.deadline, what)
        return self.buffer.buf

    def averaged(self, grads: Callable[[Flat, int, int], Flat]) -> Callable[[Flat, int, int], Flat]:
        """Wrap a gradient function whose backward pass fills the buffer (e.g. `loops.Gradients` on a `FlatModel`,
        which returns a copy of its gradients; `eager` reducers) so that it returns the mean over ranks."""

        def mean(params: Flat, worker: int, index: int) -> Flat:
            g = grads(params, worker, index)
            if self._state == _REDUCED:
                self._state = _IDLE
                return g
            return self.wait().clone()  # this rank's backward reached no parameter: it joins the reduction here

        return mean

    def remove(self) -> None:
        """Unregister the hooks (backward passes after this are not reduced) and stop the reduction thread
        (collective: it frees the thread's communicator)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._thread is not None:
            self._thread.close()
            self._thread = None

    def shutdown(self, timeout: float | None = None) -> None:
        """Unregister the hooks, then `mpi_coll.shutdown(comm, timeout)` (by default within the deadline)."""
        self.remove()
        shutdown(self.comm, self.deadline if timeout is None else timeout)


def _call(then: Callable[[], object] | None) -> None:
    if then is not None:
        then()


def _buckets(sizes: list[int], item: int, bucket_bytes: int) -> list[list[int]]:
    """Parameter indices cut into buckets, last parameter first; a bucket closes at `bucket_bytes` or more."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        held += sizes[i] * item
        if held >= bucket_bytes:
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets
