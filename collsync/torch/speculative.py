"""SpecSync in a user's script (004_..., Zhang et al., *Stay Fresh*, Alg. 2, worker side): `DistributedOptimizer(...,
sync="specsync")` notifies the scheduler after each pull, aborts the gradient under way when a re-sync says the
others pushed enough meanwhile, pulls fresh parameters and computes the batch again.

The scheduler runs in server rank 0's loop (`collsync.torch._serve`); this is the worker's side, on the same
`runtime.mpi_specsync.Speculator` `collsync-train` uses. What a script sees:

    @hvd.speculative                       # or: opt.speculative(train_step, x, y)
    def train_step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

* **Safe points** (where an abort can happen): before each leaf module's forward (a global forward pre-hook, so no
  model needs to be passed), after each parameter's gradient in the backward pass (tensor hooks on the optimizer's
  parameters), and at `step()` before the push. Inside `speculative(...)`, or inside the closure of
  `step(closure)`, a safe point that finds a re-sync for this gradient (and a newer version on the server) raises
  `Aborted`: the step is thrown away, the gradients zeroed, fresh parameters pulled into the model, and the function
  (or the closure) runs again on them. What it did before the safe point runs again; nothing after the push does,
  since the last safe point is before it.
* **A plain Horovod loop** (no wrapper, no closure): forward and backward are never interrupted; `step()` looks for
  a re-sync before it pushes. If one came, the stale gradient is thrown away instead of pushed, fresh parameters are
  pulled, the abort is reported, and `step()` returns as usual with `optimizer.aborted` True: that batch was not
  used (compute it again if it matters; the loop may also just go on to the next one).

An abort is reported to rank 0 with the seconds thrown away (since the pull the gradient started on). Each worker
counts its aborts (`optimizer.specsync`); once the optimizer closes, the scheduler's own counts are there too.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from collsync.runtime.mpi_specsync import RESYNC, Speculator
from collsync.specsync import Aborted, Speculation
from collsync.torch._world import state

# Probes at step()'s safe point before the check (a few microseconds each; see `Speculating._settle`).
_SETTLE_PROBES = 4


class Speculating:
    """One worker's SpecSync over a `ServerMode`: safe-point hooks, aborts, notifies, naive waiting.

    `mode`: the `_server_mode.ServerMode` it speculates for (its mailbox, worker, model parameters); `world`: the MPI
    world, `Dup`ed here for the messages (collective with the servers' `_serve.serve`).
    """

    def __init__(self, mode: Any, world: Any, params: list[torch.Tensor], speculation: Speculation) -> None:
        self.RESYNC = RESYNC
        self.mode = mode
        self.params = params
        self.comm = world.Dup()
        # Rank 0 of the world is server 0, whose loop runs the scheduler; clock in wall seconds (scale 1).
        self.speculator = Speculator(self.comm, mode.mailbox.worker, 0, 1.0, mode.mailbox.peek)
        self.wait = speculation.wait
        self.armed = 0  # > 0 inside speculative() or step(closure)'s closure: safe points raise there
        self.aborted = False  # the last step() threw its gradient away instead of pushing it
        self.started = time.monotonic()  # when the gradient under way started (its pull)
        self.free = False
        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._forward)]
        self.handles += [p.register_hook(self._backward) for p in params]

    # -- safe points --------------------------------------------------------------------------------------------
    def _forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.armed and next(module.children(), None) is None:  # leaf modules: one safe point per layer
            self.speculator.check()

    def _backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.speculator.check()
        return grad

    def _settle(self) -> None:
        """Let MPI move what came during the script's computation, which made no MPI call: a re-sync sent then is
        seen by the second probe, rarely the first (MPICH over UCX), so one check alone would take it a step late."""
        sp = self.speculator
        for _ in range(_SETTLE_PROBES):
            if sp.comm.Iprobe(source=sp.rank0, tag=self.RESYNC):
                return

    @contextmanager
    def _arming(self) -> Iterator[None]:
        self.armed += 1
        try:
            yield
        finally:
            self.armed -= 1

    # -- the step -----------------------------------------------------------------------------------------------
    def computing(self) -> None:
        """A gradient starts on the parameters the model holds now (after a pull)."""
        if self.mode.finished:
            self.speculator.state.finish()
        else:
            self.speculator.state.start(self.mode.worker.version)
        self.started = time.monotonic()

    def before_pull(self) -> None:
        """Naive waiting (004_... §III-B): each pull after a push deferred by `wait` seconds."""
        if self.wait > 0:
            time.sleep(self.wait)

    def pulled(self) -> None:
        """After push and pull: notify the scheduler (Alg. 2, worker lines 8-10) and start the next gradient."""
        if not self.mode.finished:
            sp = self.speculator
            sp.notify()
            # The script's own computation makes no MPI call: a send left in flight may not leave this rank before
            # the next one (at step()), and the scheduler would time this gradient's period from there. A 16-byte
            # send completes without the receiver (eager), so waiting for it costs no round trip.
            sp.MPI.Request.Waitall(sp.requests)
            sp.requests = []
        self.computing()

    def step(self, closure: Any, send: Callable[[], None]) -> Any:
        """`optimizer.step(closure)`: the closure (re-run on fresh parameters while re-syncs abort it), then the last
        safe point, then `send()` (push and pull). Without a closure, an abort here throws the gradient away
        (`aborted`), unless `speculative(...)` runs this step: then it re-runs the whole step."""
        self.aborted = False
        while True:
            loss = None
            try:
                if closure is not None:
                    with self._arming(), torch.enable_grad():
                        loss = closure()
                if self.mode.finished:
                    return loss
                self._settle()
                self.speculator.check()  # the last safe point: before the push
            except Aborted:
                if closure is None and self.armed:
                    raise  # speculative(...) re-runs the user's whole step
                self.abort()
                if closure is not None:
                    continue
                self.aborted = True
                return loss
            send()
            return loss

    def abort(self) -> None:
        """A re-sync aborted the gradient under way: report the seconds thrown away to rank 0, zero the gradients,
        pull the newest parameters into the model (any version will do: it is newer than the one the aborted
        gradient was on, which the policy allowed) and start the batch over on them (Alg. 2, worker lines 5-7)."""
        mode = self.mode
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()  # in place: references the script holds stay valid
        stamp = self.speculator.resync(mode.worker, mode.mailbox, mode.params, time.monotonic() - self.started)
        if stamp.done:
            mode.finished = True
        else:
            mode.flat.set_params(mode.params)
        self.computing()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` with its safe points armed; run again on fresh parameters each time a re-sync
        aborts it. (Once training has ended during an abort, the re-run's `step()` leaves the model unchanged.)"""
        with self._arming():
            while True:
                try:
                    return fn(*args, **kwargs)
                except Aborted:
                    self.abort()

    # -- the end ------------------------------------------------------------------------------------------------
    def leave(self) -> None:
        """This worker sends nothing more: BYE (the scheduler's close waits for every worker's)."""
        self.speculator.bye()

    def drain(self, timeout: float | None) -> None:
        """Take the re-syncs still coming until the end marker, then the scheduler's counts; unhook the model."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.speculator.bye()
        self.speculator.drain(timeout, told=True)

    def close(self) -> None:
        """Free the messages' communicator (collective with the servers, after the shards closed)."""
        if not self.free:
            self.free = True
            self.comm.Free()

    def summary(self) -> dict[str, Any]:
        """This worker's counts, and the scheduler's once the optimizer closed (`scheduler`; None before)."""
        sp = self.speculator
        return {
            "aborts": sp.state.aborts,
            "wasted_s": sp.state.wasted_s,
            "resyncs_ignored": sp.state.ignored,
            "notifies": sp.state.iteration,
            "resync_pull_bytes": sp.resync_bytes,
            "message_bytes": sp.bytes,
            "scheduler": sp.summary,
        }


def speculative(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a training step (forward, backward, `optimizer.step()`) so that a SpecSync re-sync that aborts it
    re-runs it on fresh parameters (see the module docstring). Under any other sync mode it just calls the step,
    so a script may keep the decorator whatever mode it runs."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        speculating = state("speculative").speculating
        if speculating is None:
            return fn(*args, **kwargs)
        return speculating.run(fn, *args, **kwargs)

    return run
