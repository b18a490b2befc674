"""Collectives over mpi4py for the serverless full-sync path (`runtime=allreduce`).

`MpiCollective` averages a whole flat vector at once. `BucketReducer` averages `FlatModel.grads` while the backward
pass is still running: the gradient is cut into buckets (contiguous slices, last layers first) and each bucket's
reduction starts as soon as backward has produced all of it (Horovod's tensor fusion, PyTorch DDP's gradient
buckets). The reductions run on a `CommThread`: a thread that sits in a blocking `MPI_Allreduce` with the GIL
released while autograd goes on in the main thread (Horovod's background thread), so the sum progresses without the
main thread polling. `shutdown` lets ranks that finish at different times leave together without spinning.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from collsync.flat import FlatModel
from collsync.types import Flat

DEFAULT_BUCKET_BYTES = 4 * 2**20


def wait(request: Any, deadline: float | None, what: str, pause: Callable[[], None] | None = None) -> None:
    """Wait for a nonblocking collective; with a `deadline` (seconds), raise TimeoutError once it has not
    completed in that time: a rank stopped, hangs or died, and a collective cannot tell which (every rank's wait
    fires, and the first to report aborts the world). Between two tests: `pause()` (default: `Backoff`'s growing
    sleeps after `_YIELD_S` of `sched_yield()`); without a `deadline` or a `pause`, MPI's own blocking wait."""
    if deadline is None and pause is None:
        request.Wait()
        return
    if pause is None:
        pause = _yield_then_sleep()
    end = None if deadline is None else time.monotonic() + deadline
    while not request.Test():
        if end is not None and time.monotonic() >= end:
            raise TimeoutError(f"{what} did not complete within deadline={deadline:g}s: a rank stopped, hangs or died")
        pause()


# How long a deadline-bounded wait yields the core between tests before it sleeps. A nonblocking collective on
# MPICH progresses only while its ranks are inside MPI: a rank asleep in a growing back-off stalls every other
# rank's part of the reduction, and they take turns sleeping (measured: a 100k-parameter step 3.6x the blocking
# loop with sleeps from the first miss). Yielding keeps each test prompt and still lets a rank sharing the core
# run; past this, the collective is late (a straggler, a stopped rank) and sleeping spares the CPU.
_YIELD_S = 0.05


def _yield_then_sleep() -> Callable[[], None]:
    from collsync.runtime.mpi_rma import Backoff

    backoff = Backoff(spins=0)
    until = time.monotonic() + _YIELD_S

    def pause() -> None:
        if time.monotonic() < until:
            os.sched_yield()
        else:
            backoff.wait()

    return pause


def threads_supported() -> bool:
    """Whether MPI was initialised with MPI_THREAD_MULTIPLE (mpi4py's default), which a `CommThread` needs: its
    reductions run while the main thread may call MPI on another communicator."""
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


class CommThread:
    """A thread that runs in-place sums over its own duplicate of `comm`, one at a time, in the order posted.

    `post(array, then)` queues `MPI_Allreduce(IN_PLACE, array, SUM)` and returns at once; `then()` (the division by
    the world size, say) runs in the thread after the sum, while the data is still in cache. `wait(deadline, what)`
    returns once everything posted is done. mpi4py releases the GIL inside MPI calls and torch inside its kernels,
    so the thread's reduction and the main thread's backward pass run at the same time (Horovod's background thread,
    Sergeev & Del Balso 2018; the gradients come out last layer first, so the first buckets are summed while the
    earlier layers' gradients are still being computed).

    Every rank posts the same sequence (MPI matches collectives on a communicator by order); the duplicate
    communicator keeps these sums apart from whatever the main thread reduces meanwhile. `wait` with a `deadline`
    raises TimeoutError once the sums have not completed in that many seconds (a rank stopped, hangs or died, and a
    collective cannot say which); the thread is then stuck in MPI until the world is aborted, as collsync's entry
    point does after any error. `blocking=False`: the thread polls `Iallreduce` with `Test` and `sched_yield()`
    instead of waiting inside MPI: MPICH spins in a blocking wait, and where ranks outnumber the node's cores that
    spin takes a core another rank needs (4.9x the hand-written loop at 4 ranks on 2 cores, measured when
    `collsync.torch` waited that way). The default, None, chooses that where the node is oversubscribed.
    Construction and `close()` are collective over `comm`.
    """

    def __init__(self, comm: Any, *, blocking: bool | None = None, name: str = "collsync-allreduce") -> None:
        from mpi4py import MPI

        from collsync.runtime.mpi_world import own_cores

        if not threads_supported():
            raise RuntimeError("CommThread: MPI was not initialised with MPI_THREAD_MULTIPLE")
        self.MPI = MPI
        self.comm = comm.Dup()
        if blocking is None:
            blocking = own_cores(comm)
        self.blocking = blocking
        self._cv = threading.Condition()
        self._jobs: deque[tuple[Any, Callable[[], None] | None] | None] = deque()
        self._posted = 0
        self._done = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, array: Any, then: Callable[[], None] | None = None) -> None:
        """Queue an in-place sum of `array` (a numpy view of a tensor) over the ranks, then `then()`."""
        with self._cv:
            self._jobs.append((array, then))
            self._posted += 1
            self._cv.notify()

    def _sum(self, array: Any) -> None:
        MPI = self.MPI  # noqa: N806 - the module's own name
        if self.blocking:
            self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            return
        wait(self.comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), None, "a reduction", pause=os.sched_yield)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._jobs.popleft()
            if job is None:
                return
            array, then = job
            try:
                self._sum(array)
                if then is not None:
                    then()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread, which raises it
                with self._cv:
                    self._error = error
                    self._cv.notify_all()
                return
            with self._cv:
                self._done += 1
                if self._done == self._posted:
                    self._cv.notify_all()

    def run(self, array: Any, deadline: float | None, what: str) -> None:
        """Wait for everything posted, then sum `array` in the calling thread (the last bucket of a step: nothing is
        left to overlap it with, and a hand-over to the thread and back costs two wake-ups, which on a loaded node
        are scheduling delays). Bounded by `deadline` as `wait` is: the sum is an `Iallreduce` tested in a loop."""
        MPI = self.MPI  # noqa: N806 - the module's own name
        self.wait(deadline, what)
        if deadline is None and self.blocking:
            self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            return
        # Yield between tests even with a core per rank: a Python loop spinning on Test without it made a
        # 100k-parameter step 1.8x the hand-written loop on a loaded node (1.02x with it, 1.00x blocking).
        wait(self.comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), deadline, what, pause=os.sched_yield)

    @property
    def idle(self) -> bool:
        """Nothing posted is still running."""
        return self._done == self._posted

    def wait(self, deadline: float | None, what: str) -> None:
        """Return once every posted sum is done; raise TimeoutError after `deadline` seconds (None: no limit), or
        the thread's own error."""
        end = None if deadline is None else time.monotonic() + deadline
        with self._cv:
            while self._done < self._posted:
                if self._error is not None:
                    raise RuntimeError(f"{what} failed: {self._error}") from self._error
                if not self._thread.is_alive():
                    raise RuntimeError(f"{what}: the reduction thread is closed")
                if end is None:
                    self._cv.wait()
                    continue
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{what} did not complete within deadline={deadline:g}s: a rank stopped, hangs or died"
                    )
                self._cv.wait(left)

    def close(self) -> None:
        """Stop the thread once it is idle, and free the duplicate communicator (collective). A thread still stuck
        in a sum (after a timeout) is left to the world's abort."""
        with self._cv:
            self._jobs.append(None)
            self._cv.notify()
        self._thread.join(timeout=1.0)
        if not self._thread.is_alive() and self.comm != self.MPI.COMM_NULL:
            self.comm.Free()


class MpiCollective:
    """`Collective` over an MPI communicator.

    Allreduce runs in place on the tensor's numpy view: `Tensor.numpy()` shares memory with a CPU tensor, so MPI
    reads and writes torch's buffer directly and no copy is made.
    """

    def __init__(self, comm: Any, deadline: float | None = None) -> None:
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.deadline = deadline  # seconds an allreduce may take before a rank counts as stopped (None: no limit)

    def allreduce_mean(self, flat: Flat) -> Flat:
        from mpi4py import MPI

        buf = flat.detach().contiguous()
        if self.deadline is None:
            self.comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
        else:
            wait(self.comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM), self.deadline, "an allreduce")
        return buf.div_(self.size)

    def broadcast(self, flat: Flat, root: int = 0) -> Flat:
        buf = flat.detach().contiguous()
        self.comm.Bcast(buf.numpy(), root=root)
        return buf

    def iallreduce_mean(self, flat: Flat) -> tuple[Any, Flat]:
        """Start a nonblocking sum; `finish(request, flat)` waits and divides. Lets work overlap communication."""
        from mpi4py import MPI

        buf = flat.detach().contiguous()
        return self.comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM), buf

    def finish(self, request: Any, buf: Flat) -> Flat:
        request.Wait()
        return buf.div_(self.size)

    def barrier(self) -> None:
        self.comm.Barrier()

    def shutdown(self, timeout: float | None = None) -> None:
        """See `shutdown` below."""
        shutdown(self.comm, timeout)


_IDLE, _ACTIVE, _REDUCED = 0, 1, 2


class BucketReducer:
    """Averages `flat.grads` over `comm` during the backward pass: after `loss.backward()` returns, every rank's
    `flat.grads` holds the same mean gradient (1/n) sum_r g_r.

    Buckets are contiguous slices of `flat.grads` made of whole parameters, in reverse parameter order (backward
    produces the last layers first); a bucket closes once it holds at least `bucket_bytes` (so a parameter larger
    than that is a bucket of its own, and `bucket_bytes=1` gives one parameter per bucket). A post-accumulate-grad
    hook on each parameter counts it in; when a bucket is complete, `Iallreduce(IN_PLACE, SUM)` starts on it.

    Buckets start strictly in bucket order: MPI requires every rank to start collectives on a communicator in the
    same order, and backward may finish parameters in a different order on different ranks (a parameter unused on
    one rank, data-dependent control flow). At the end of backward (a callback queued on autograd's engine, as DDP
    does) the buckets not yet started start, so a parameter the forward pass did not use cannot hang the step (its
    gradient counts as whatever `.grad` holds, zero after `FlatModel.zero_grad`); then each bucket is waited on and
    divided by the world size while it is still in cache. Every rank divides the same sums the same way, so the
    replicas stay bit-identical.

    `thread` (the default wherever MPI allows threads and there is more than one rank): each bucket's sum runs on a
    `CommThread`, which divides it too, while backward goes on; the end of backward waits for them and sums the
    last bucket itself (nothing is left to overlap it with). Else
    each bucket is an `Iallreduce` from the hook, and `poll` tests the buckets in flight from every hook: MPICH
    moves a nonblocking collective only while its rank is inside an MPI call, so without this a bucket started early
    makes no progress until the end of backward.

    One backward pass per step (no gradient accumulation across backward passes: each one is reduced). A rank whose
    backward reached no parameter at all runs no hook and no callback; it must call `wait()` to join the step's
    reduction (`averaged` does).
    """

    def __init__(
        self,
        comm: Any,
        flat: FlatModel,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        poll: bool = True,
        deadline: float | None = None,
        thread: bool | None = None,
    ) -> None:
        from mpi4py import MPI

        if bucket_bytes < 1:
            raise ValueError(f"BucketReducer: {bucket_bytes=} must be >= 1")
        if flat.grads.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"BucketReducer: gradients must be float32 or float64, got {flat.grads.dtype}")
        self.MPI = MPI
        self.comm = comm
        self.flat = flat
        self.size: int = comm.Get_size()
        self.poll = poll
        self.deadline = deadline  # seconds a bucket may take before a rank counts as stopped (None: no limit)
        item = flat.grads.element_size()
        # Buckets over parameter indices, last parameter first; bucket b spans flat.grads[starts[b]:stops[b]].
        self.buckets: list[list[int]] = []
        current: list[int] = []
        held = 0
        for i in reversed(range(len(flat.layers))):
            _, start, stop = flat.layers[i]
            current.append(i)
            held += (stop - start) * item
            if held >= bucket_bytes:
                self.buckets.append(current)
                current, held = [], 0
        if current:
            self.buckets.append(current)
        self.slices: list[tuple[int, int]] = [(flat.layers[b[-1]][1], flat.layers[b[0]][2]) for b in self.buckets]
        self._views = [flat.grads[a:z] for a, z in self.slices]
        self._arrays = [v.numpy() for v in self._views]
        self._bucket_of = [0] * len(flat.layers)
        for b, members in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = b
        self._sizes = [len(b) for b in self.buckets]
        self._missing = list(self._sizes)
        self._next = 0
        self._requests: list[Any] = []
        self._state = _IDLE
        if thread is None:
            thread = self.size > 1 and threads_supported()
        self._thread = CommThread(comm) if thread else None
        params = dict(flat.module.named_parameters())
        self._handles = [
            params[name].register_post_accumulate_grad_hook(self._hook(i)) for i, (name, _, _) in enumerate(flat.layers)
        ]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        _, start, stop = self.flat.layers[index]
        ptr = self.flat.grads[start:stop].data_ptr()
        bucket = self._bucket_of[index]

        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None or grad.data_ptr() != ptr:
                # Autograd put a new tensor in .grad (it was None, or create_graph=True): move it into the buffer.
                view = self.flat.grads[start:stop]
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad.reshape(-1))
                param.grad = view.view_as(param)
            if self._state != _ACTIVE:
                self._begin()
            self._missing[bucket] -= 1
            while self._next < len(self.buckets) and self._missing[self._next] == 0:
                self._start(self._next)
            if self.poll and self._requests and self._thread is None:
                self.MPI.Request.Testall(self._requests)

        return hook

    def _begin(self) -> None:
        """The first hook of a backward pass: re-arm the counters, finish the step when backward ends."""
        self._missing = list(self._sizes)
        self._next = 0
        self._requests = []
        self._state = _ACTIVE
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _start(self, bucket: int) -> None:
        if self._thread is not None:
            if bucket < len(self.buckets) - 1:  # the last one is summed by `_finish` itself, in this thread
                view = self._views[bucket]
                self._thread.post(self._arrays[bucket], lambda: view.div_(self.size))
        else:
            self._requests.append(self.comm.Iallreduce(self.MPI.IN_PLACE, self._arrays[bucket], op=self.MPI.SUM))
        self._next = bucket + 1

    def _finish(self) -> None:
        while self._next < len(self.buckets):
            self._start(self._next)
        if self._thread is not None:
            self._thread.run(self._arrays[-1], self.deadline, "a gradient bucket's allreduce")
            self._views[-1].div_(self.size)
            self._state = _REDUCED
            return
        for request, view in zip(self._requests, self._views, strict=True):
            wait(request, self.deadline, "a gradient bucket's allreduce")
            if self.size > 1:
                view.div_(self.size)
        self._requests = []
        self._state = _REDUCED

    def wait(self) -> Flat:
        """The mean gradient, `flat.grads` itself. After a backward pass that reached a parameter it was reduced
        already (at the end of backward); otherwise every bucket is reduced now. Call once per step."""
        if self._state == _IDLE:
            self._next, self._requests = 0, []
        if self._state != _REDUCED:
            self._finish()  # after a failed backward (_ACTIVE), only the buckets not yet started start
        self._state = _IDLE
        return self.flat.grads

    def averaged(self, grads: Callable[[Flat, int, int], Flat]) -> Callable[[Flat, int, int], Flat]:
        """Wrap a gradient function whose backward pass fills `flat.grads` (e.g. `loops.Gradients`, which returns a
        copy of it) so that it returns the mean over ranks."""

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
        """Unregister the hooks, then `shutdown(comm, timeout)`."""
        self.remove()
        shutdown(self.comm, timeout)


class ShutdownTimeout(TimeoutError):
    """`shutdown` gave up waiting; `request` is its barrier, still posted (the late ranks will complete it)."""

    def __init__(self, message: str, request: Any) -> None:
        super().__init__(message)
        self.request = request


def shutdown(comm: Any, timeout: float | None = None, while_waiting: Callable[[], None] | None = None) -> None:
    """Return once every rank of `comm` has called this: an `Ibarrier`, tested with growing sleeps in between.

    A rank that finishes early (the others still training, or rank 0 still writing the run folder) sleeps instead
    of spinning inside a blocking barrier on a core a slower rank may need. With `timeout` seconds, raise an error
    naming this rank if the others have not all arrived by then (a rank stuck or gone): `ShutdownTimeout`, whose
    `request` is the barrier, still posted; wait on it, or abort the world (collsync's entry point does).
    `while_waiting()` is called between two tests (a server still answering requests while the others finish).
    """
    from collsync.runtime.mpi_rma import Backoff
    from collsync.runtime.mpi_world import rank_prefix

    request = comm.Ibarrier()
    backoff = Backoff()
    end = None if timeout is None else time.monotonic() + timeout
    while not request.Test():
        if end is not None and time.monotonic() > end:
            raise ShutdownTimeout(
                f"{rank_prefix(comm)}: shutdown: not every rank reached shutdown within {timeout}s "
                "(one is still working, stuck or gone)",
                request,
            )
        if while_waiting is not None:
            while_waiting()
        backoff.wait()


def as_float(tensor: torch.Tensor) -> torch.Tensor:
    """MPI moves float32 and float64 tensors; anything else is rejected loudly."""
    if tensor.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"mpi: tensors must be float32 or float64, got {tensor.dtype}")
    return tensor
