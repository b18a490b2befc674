"""SpecSync over MPI (004_..., Alg. 2 and Fig. 7): the scheduler on server rank 0, notify / re-sync as small
nonblocking point-to-point messages, and a real abort of the worker's gradient at its next safe point.

Messages travel on a communicator of their own (`Dup` of the world, so they never meet the windows' or the
trainer's traffic), each a few int64 / float64 words:

    worker -> scheduler   NOTIFY  [worker, iteration]                after each push and pull (Alg. 2 line 10)
    worker -> rank 0      ABORT   [worker, clock, version, wasted]   after an abort: rank 0 traces it
    worker -> both        BYE     [worker]                           last message of a worker (nothing follows)
    scheduler -> worker   RESYNC  [iteration]                        re-sync the gradient after that notify
    scheduler -> worker   RESYNC  [-1]                               last message to a worker, after its BYE
    rank 0 -> worker      SUMMARY {aborts, notifies, ...}            after the end marker, when asked (`tell`)

Messages between two ranks on one communicator never overtake each other, so the BYE / [-1] pair drains both
directions at the end: the scheduler has every abort to trace, and no re-sync is left unreceived.

`collsync.torch` runs the same two classes: its server rank 0 serves through `collsync.serving.ShardEngine`, as
collsync-train's does, and polls a `SchedulerService` from its `run_server` loop, telling every worker its counts
at the end (`close(tell=True)`); each worker's `DistributedOptimizer` holds a `Speculator` whose safe points are
hooks on the user's model (`bye()` when the worker leaves, `drain(told=True)` when its optimizer closes).

The scheduler (`collsync.specsync.Scheduler`) runs inside rank 0's server loop (`loops.run_server(poll=...)`,
`scheduler=server`), which polls it at least every `POLL_S` and on time for its next timer, or on a rank of its
own, the last (`scheduler=rank`), polling the same way. Either way rank 0's server loop takes the abort reports
(`SchedulerService(schedules=False)` when the scheduler is elsewhere): one thread, so the trace it writes `abort`
events into stays in time order. The scheduler's clock is model seconds, wall seconds / `runtime.time_scale`, the
unit of the straggler draws, so `abort_time` and `wait` mean the same in the simulator and here.

Safe points (where a worker looks for a re-sync and aborts): before each leaf module's forward, after each
parameter's gradient in the backward pass (`install_safe_points`), and every `SLICE_S` of an injected straggler
delay (`collsync.runs.delays.injected`). A re-sync is acted on only if the server published a newer version than
the one the gradient is computed on: restarting on the same parameters would gain nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

import time
from typing import Any

import numpy as np

from collsync.specsync import NOTIFY_BYTES, RESYNC_BYTES, Aborted, Scheduler, Speculation, SpecWorker
from collsync.trace import Trace
from collsync.types import Flat, Stamp

NOTIFY, ABORT, BYE, RESYNC, SUMMARY = 11, 12, 13, 14, 15
ABORT_BYTES = 32  # [worker, clock, version, wasted] as float64: counted with the notifications
POLL_S = 0.001  # the longest rank 0's server loop goes without polling the scheduler
SLICE_S = 0.002  # an injected delay is slept in slices this long, with a safe point between two


class SchedulerService:
    """The scheduler's rank: receive notifies, fire the scheduler's timers, send re-syncs; and on rank 0 receive
    the abort reports into `trace` (with `schedules=False`, only that: the scheduler has a rank of its own).

    `workers`: the world ranks of the workers in worker order. `poll()` returns the monotonic time by which it
    wants to be called again (its next timer, or `POLL_S` from now at the latest).
    """

    def __init__(
        self,
        comm: MPI.Comm,
        speculation: Speculation,
        workers: list[int],
        scale: float,
        trace: Trace | None,
        schedules: bool = True,
    ) -> None:
        from mpi4py import MPI

        self.MPI, self.comm, self.workers, self.scale, self.trace = MPI, comm, workers, scale, trace
        self.index = {rank: w for w, rank in enumerate(workers)}
        self.scheduler = Scheduler(len(workers), speculation)
        self.start = time.monotonic()
        self.status = MPI.Status()
        self.requests: list[Any] = []
        self.aborts = 0
        self.wasted_s = 0.0
        self.bytes = 0  # notify, abort and re-sync messages, both directions
        self.byes: set[int] = set()
        self.sending = schedules
        self.schedules = schedules

    def now(self) -> float:
        return (time.monotonic() - self.start) / self.scale

    def poll(self) -> float:
        """Take every message waiting, then fire the timers due; returns when to poll next (monotonic)."""
        self._receive()
        if self.sending:
            for w, iteration in self.scheduler.expire(self.now()):
                buf = np.array([iteration], dtype=np.int64)
                self.requests.append(self.comm.Isend(buf, dest=self.workers[w], tag=RESYNC))
                self.bytes += RESYNC_BYTES
            self.requests = [r for r in self.requests if not r.Test()]
        due = self.scheduler.due()
        soon = time.monotonic() + POLL_S
        return soon if due is None else min(soon, self.start + due * self.scale)

    def _receive(self) -> None:
        MPI, status = self.MPI, self.status
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            source, tag = status.Get_source(), status.Get_tag()
            if tag == ABORT:
                buf = np.empty(4, dtype=np.float64)
                self.comm.Recv(buf, source=source, tag=tag)
                self.bytes += ABORT_BYTES
                w, clock, version, wasted = int(buf[0]), int(buf[1]), int(buf[2]), float(buf[3])
                self.aborts += 1
                self.wasted_s += wasted
                if self.trace is not None:
                    self.trace.record("abort", worker=w, clock=clock, version=version, wasted=wasted)
            else:
                buf = np.empty(2, dtype=np.int64)
                self.comm.Recv(buf, source=source, tag=tag)
                if tag == NOTIFY:
                    self.bytes += NOTIFY_BYTES
                    self.scheduler.notify(self.index[source], self.now())
                elif tag == BYE:
                    self.byes.add(source)

    def close(self, timeout: float | None, tell: bool = False) -> None:
        """After training: no more re-syncs; wait (at most `timeout` s) for every worker's BYE, answer each with the
        end marker, and complete every send. `tell`: then send each worker `summary()` (`collsync.torch`, whose
        workers have no run folder to read the counts from); every abort report came before its worker's BYE, so
        the counts are final."""
        self.sending = False
        end = None if timeout is None else time.monotonic() + timeout
        while len(self.byes) < len(self.workers) and (end is None or time.monotonic() < end):
            self._receive()
            time.sleep(POLL_S)
        if self.schedules:
            marker = np.array([-1], dtype=np.int64)
            self.requests += [self.comm.Isend(marker, dest=rank, tag=RESYNC) for rank in sorted(self.byes)]
        if tell:
            info = self.summary()
            self.requests += [self.comm.isend(info, dest=rank, tag=SUMMARY) for rank in sorted(self.byes)]
        self.MPI.Request.Waitall(self.requests)
        self.requests = []

    def serve(self, timeout: float | None) -> None:
        """A scheduler on a rank of its own: poll (sleeping between polls) until every worker said BYE, then close.
        A worker that dies never says it, but then its failure aborts the world, this rank included."""
        while len(self.byes) < len(self.workers):
            wake = self.poll()
            time.sleep(max(0.0, min(wake - time.monotonic(), POLL_S)))
        self.close(timeout)

    def summary(self) -> dict[str, Any]:
        sched = self.scheduler
        return {
            "aborts": self.aborts,
            "wasted_s": self.wasted_s,
            "resyncs_ignored": sched.resyncs - self.aborts,
            "notifies": sched.notifies,
            "resyncs": sched.resyncs,
            "abort_time": sched.abort_time,
            "abort_rate": sched.abort_rate,
            "tunings": len(sched.tunings),
            "message_bytes": self.bytes,
        }


class Speculator:
    """A worker's side: notify after each push and pull, look for a re-sync at safe points, report aborts. The
    decisions are `state`'s (`specsync.SpecWorker`, the simulator's too); this class carries the messages.

    `peek()` reads the newest version the server published (a re-sync is acted on only if it is newer than the
    gradient under way's, `state.computing`).
    """

    def __init__(self, comm: MPI.Comm, worker: int, scheduler_rank: int, scale: float, peek: Any) -> None:
        from mpi4py import MPI

        self.MPI, self.comm, self.worker, self.rank0, self.scale = MPI, comm, worker, scheduler_rank, scale
        self.tracer = 0  # rank 0 traces the aborts (the scheduler may have a rank of its own)
        self.peek = peek
        self.state = SpecWorker()  # notifies sent, the gradient under way, aborts and the seconds they cost
        self.seen: int | None = None  # the iteration of the last re-sync received and not yet decided on
        self.requests: list[Any] = []
        self.bytes = 0
        self.resync_bytes = 0  # parameters pulled again after aborts (counted by `loops.run_worker`)
        self.summary: dict[str, Any] | None = None  # the scheduler's counts, when `drain(told=True)` got them
        self._buf = np.empty(1, dtype=np.int64)
        self._said_bye = False

    def notify(self) -> None:
        iteration = self.state.notify()
        buf = np.array([self.worker, iteration], dtype=np.int64)
        self.requests.append(self.comm.Isend(buf, dest=self.rank0, tag=NOTIFY))
        self.bytes += NOTIFY_BYTES
        self.requests = [r for r in self.requests if not r.Test()]

    def _take(self) -> None:
        while self.comm.Iprobe(source=self.rank0, tag=RESYNC):
            self.comm.Recv(self._buf, source=self.rank0, tag=RESYNC)
            self.bytes += RESYNC_BYTES
            if self.seen is not None:
                self.state.resync(self.seen, -1)  # superseded before a safe point saw it: ignored, counted
            self.seen = int(self._buf[0])

    def check(self) -> None:
        """A safe point: raise `Aborted` if a re-sync for this gradient came and the server has newer parameters
        (`SpecWorker.resync` decides, once per re-sync: the server's version is read only when one came)."""
        if self.state.computing < 0:
            return
        self._take()
        if self.seen is None:
            return
        iteration, self.seen = self.seen, None
        newest = self.peek().version if iteration == self.state.iteration else -1
        if self.state.resync(iteration, newest):
            raise Aborted

    def report(self, clock: int, version: int, wasted: float) -> None:
        """Tell the scheduler's rank an abort happened (it traces it), `wasted` in model seconds."""
        buf = np.array([self.worker, clock, version, wasted], dtype=np.float64)
        self.requests.append(self.comm.Isend(buf, dest=self.tracer, tag=ABORT))
        self.bytes += ABORT_BYTES
        self.state.aborted(wasted)

    def resync(self, worker: Any, mailbox: Any, params: Flat, wasted: float) -> Stamp:
        """The one abort-and-restart of both MPI fronts (004_... Alg. 2, worker lines 5-7), after `Aborted`: the
        gradient under way is no longer computed, the abort (with `wasted` model seconds) goes to the scheduler's
        rank, the newest parameters are read into `params` (any version will do: it is newer than the one the
        aborted gradient was on, which the policy allowed; the bytes count as re-sync pulls), and `worker`
        (`loops.Worker`) restarts its batch on them unless training ended meanwhile (`stamp.done`). The simulator
        does the same on its virtual clock (`sim.Simulator._resync`)."""
        self.report(worker.clock, worker.version, wasted)
        before = mailbox.bytes_fetched
        stamp: Stamp = mailbox.read(params, lambda _: True)
        self.resync_bytes += mailbox.bytes_fetched - before
        if not stamp.done:
            worker.restart(stamp)
        return stamp

    def close(self, timeout: float | None) -> None:
        """Training is over: BYE, then take re-syncs until the end marker (at most `timeout` s), complete sends."""
        self.bye()
        self.drain(timeout)

    def bye(self) -> None:
        """This worker sends nothing more (BYE to the scheduler's rank and to rank 0; once)."""
        self.state.finish()
        if self._said_bye:
            return
        self._said_bye = True
        for rank in sorted({self.rank0, self.tracer}):
            self.requests.append(self.comm.Isend(np.array([self.worker, 0], dtype=np.int64), dest=rank, tag=BYE))

    def drain(self, timeout: float | None, told: bool = False) -> None:
        """After `bye()`: take re-syncs until the end marker (at most `timeout` s), complete the sends; `told`: then
        receive the scheduler's counts into `summary` (rank 0 sends them after the marker, `close(tell=True)`)."""
        end = None if timeout is None else time.monotonic() + timeout
        marked = False
        while end is None or time.monotonic() < end:
            if self.comm.Iprobe(source=self.rank0, tag=RESYNC):
                self.comm.Recv(self._buf, source=self.rank0, tag=RESYNC)
                if int(self._buf[0]) == -1:
                    marked = True
                    break
            else:
                time.sleep(POLL_S)
        # Polled with pauses, as above: a blocking receive would spin on a core another rank may need.
        while told and marked and (end is None or time.monotonic() < end):
            if self.comm.Iprobe(source=self.tracer, tag=SUMMARY):
                self.summary = self.comm.recv(source=self.tracer, tag=SUMMARY)
                break
            time.sleep(POLL_S)
        self.MPI.Request.Waitall(self.requests)
        self.requests = []


def install_safe_points(module: Any, check: Any) -> list[Any]:
    """Safe points between layers: `check()` before each leaf module's forward and after each parameter's gradient
    in the backward pass; an exception it raises (`Aborted`) leaves the forward or backward there. Returns the
    hook handles (`handle.remove()` takes them off)."""
    handles = []
    for sub in module.modules():
        if next(sub.children(), None) is None:
            handles.append(sub.register_forward_pre_hook(lambda *_: check()))
    for p in module.parameters():
        if p.requires_grad:
            handles.append(p.register_hook(lambda g: (check(), g)[1]))
    return handles
