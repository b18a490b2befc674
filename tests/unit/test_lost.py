"""Lost workers: the policy decides whether training goes on without them (`SyncPolicy.tolerates`), the server stops
counting them (`Server.lose`), the trace check accepts the result, and `run_server` loses a silent worker by the
deadline and does not wait for it at the end (a mailbox of threads, no MPI)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch

from collsync.checks import TraceError, check_trace
from collsync.loops import Worker, run_server, run_worker
from collsync.lost import close_serving, lose_silent
from collsync.policy import SyncPolicy, asynchronous, backup, bfasgd, bsp, psp, specsync, ssp
from collsync.rules import sgd
from collsync.server import Server
from collsync.trace import Trace
from collsync.types import Arrival, Flat, Stamp


def arrival(worker: int, clock: int, value: float = 1.0, version: int | None = None) -> Arrival:
    v = clock if version is None else version
    return Arrival(worker, v, torch.full((3,), value, dtype=torch.float64), clock)


def make(policy: SyncPolicy, workers: int, steps: int | None = None) -> Server:
    trace = Trace(lambda: 0.0)
    return Server(torch.zeros(3, dtype=torch.float64), sgd(lr=1.0), policy, workers, steps=steps, trace=trace)


@pytest.mark.parametrize(
    ("policy", "workers", "goes_on", "stops"),
    [
        (asynchronous(), 4, 3, 4),
        (bfasgd(), 4, 3, 4),
        (specsync(), 4, 3, 4),
        (ssp(2), 4, 3, 4),
        (psp(pushes=3), 4, 3, 4),
        (backup(2), 8, 2, 3),
        (bsp(), 4, None, 1),
        (ssp(0), 4, None, 1),  # SSP with bound 0 is BSP
        (asynchronous(on_lost="stop"), 4, None, 1),
        (bsp(on_lost="continue"), 4, 3, 4),
        (backup(1, on_lost="continue"), 4, 3, 4),
    ],
)
def test_policy_tolerates_what_it_can_do_without(policy, workers, goes_on, stops):
    if goes_on is not None:
        assert policy.tolerates(goes_on, workers)
    assert not policy.tolerates(stops, workers)


def test_on_lost_is_checked():
    with pytest.raises(ValueError, match="on_lost='maybe' must be one of continue, stop"):
        asynchronous(on_lost="maybe")


def test_backup_goes_on_without_two_lost_workers_and_stops_at_the_third():
    server = make(backup(2), 8, steps=10)
    for w in range(5):
        server.accept(arrival(w, 0))
    assert server.lose(6, rank=7, host="h") and server.lose(7)
    assert server.quorum == 6 and server.version == 0  # backups cover both: the round still takes 6
    server.accept(arrival(5, 0))
    assert server.version == 1
    assert not server.accept(arrival(7, 1))  # a lost worker that comes back is not counted again
    assert server.trace.of("drop")[-1]["reason"] == "lost"
    assert not server.lose(0)  # three lost of two backups: the run cannot go on
    assert server.lost == [6, 7]
    lost = server.trace.of("lost")
    assert [(e["worker"], e["rank"], e["host"], e["last_update"]) for e in lost] == [(6, 7, "h", 0), (7, None, None, 0)]
    check_trace(server.trace, server.policy, 8)


def test_a_round_waiting_only_on_a_lost_worker_is_applied_and_its_buffered_gradients_dropped():
    server = make(ssp(2), 3, steps=10)
    server.accept(arrival(0, 0))
    server.accept(arrival(1, 0))
    server.accept(arrival(2, 0))
    server.accept(arrival(2, 1))  # worker 2 ran ahead: its round-1 gradient is buffered
    server.accept(arrival(0, 1))
    assert server.version == 1 and server.contributed == [1, 1, 1]
    assert server.lose(2)
    # Round 1 now needs the two live workers only, and worker 2's buffered gradient was dropped, not applied.
    assert server.version == 1
    server.accept(arrival(1, 1))
    assert server.version == 2
    assert server.trace.of("apply")[-1]["workers"] == [0, 1]
    assert server.trace.of("lost")[0]["last_update"] == 1
    counts = check_trace(server.trace, server.policy, 3)
    assert counts["pushed"] == counts["applied"] + counts["dropped"]


def test_check_trace_rejects_an_update_with_a_lost_workers_gradient():
    server = make(asynchronous(), 2, steps=10)
    server.accept(arrival(1, 0))
    server.lose(1)
    server.accept(arrival(0, 1))
    events = list(server.trace.events)
    forged = {**events[-1], "workers": [1], "version": 3}
    with pytest.raises(TraceError, match=r"took a gradient of lost worker\(s\) \[1\]"):
        check_trace([*events, {**events[-2], "worker": 1}, forged], server.policy, 2)


class Threads:
    """A `ServingMailbox` of threads: one published (params, stamp), a queue of gradients. A worker whose `stop`
    event is set freezes in its next read (a stopped process), until `release` is set."""

    def __init__(self, numel: int, workers: int) -> None:
        self.params = torch.zeros(numel, dtype=torch.float64)
        self.stamp = Stamp(-1, False)
        self.lock = threading.Lock()
        self.arrivals: queue.Queue[Arrival] = queue.Queue()
        self.left: set[int] = set()
        self.muted: set[int] = set()  # the workers the server told us it lost (`lose`)
        self.stop = [threading.Event() for _ in range(workers)]
        self.release = threading.Event()
        self.workers = workers
        self.bytes_fetched = 0

    def worker(self, w: int) -> WorkerBox:
        return WorkerBox(self, w)

    def recv(self, timeout: float | None = None) -> Arrival | None:
        try:
            return self.arrivals.get(timeout=timeout)
        except queue.Empty:
            return None

    def publish(self, params: Flat, stamp: Stamp) -> None:
        with self.lock:
            self.params, self.stamp = params.clone(), stamp

    def recycle(self, grad: Flat | None) -> None:
        pass

    def describe(self, workers: list[int]) -> str:
        return ", ".join(f"worker {w}" for w in workers)

    def departed(self) -> list[int]:
        return sorted(self.left)

    def locate(self, worker: int) -> tuple[int | None, str | None]:
        return worker + 1, "here"

    def lose(self, worker: int) -> None:
        self.muted.add(worker)

    def close(self, timeout: float | None = None, lost: Sequence[int] = ()) -> list[Arrival]:
        end = time.monotonic() + (timeout or 0.0)
        while any(w not in self.left and w not in lost for w in range(self.workers)):
            if time.monotonic() > end:
                raise TimeoutError(f"{self.describe([w for w in range(self.workers) if w not in self.left])} out")
            time.sleep(0.005)
        out = []
        while not self.arrivals.empty():
            out.append(self.arrivals.get())
        return out


class WorkerBox:
    def __init__(self, box: Threads, w: int) -> None:
        self.box, self.w, self.bytes_fetched = box, w, 0

    def read(self, out: Flat, ready: Callable[[Stamp], bool], fetch: bool = True) -> Stamp:
        while True:
            if self.box.stop[self.w].is_set():
                self.box.release.wait()
            with self.box.lock:
                stamp = self.box.stamp
                if stamp.version >= 0 and (stamp.done or ready(stamp)):
                    if stamp.done:
                        self.box.left.add(self.w)
                    elif fetch:
                        out.copy_(self.box.params)
                    return stamp
            time.sleep(0.001)

    def send(self, a: Arrival, *, read_next: bool = False) -> None:
        self.box.arrivals.put(a)


def _train(policy: SyncPolicy, workers: int, steps: int, stop: dict[int, int]) -> tuple[Server, Threads, float]:
    """Run a server and `workers` worker threads; worker w freezes after `stop[w]` gradients. Returns the server,
    the mailbox and how long the server took."""
    box = Threads(3, workers)
    server = make(policy, workers, steps=steps)

    def grads(params: Flat, w: int, index: int) -> Flat:
        if index >= stop.get(w, steps * 10):
            box.stop[w].set()
        time.sleep(0.002)
        return torch.full_like(params, 0.01)

    threads = [
        threading.Thread(
            target=run_worker,
            args=(Worker(w, policy), box.worker(w), grads, torch.zeros(3, dtype=torch.float64)),
            daemon=True,
        )
        for w in range(workers)
    ]
    for t in threads:
        t.start()
    started = time.monotonic()
    try:
        run_server(server, box)
        took = time.monotonic() - started
    finally:
        box.publish(box.params, Stamp(server.version, True))  # also after a failure: the workers' reads end
        box.release.set()
        for t in threads:
            t.join(timeout=10)
    return server, box, took


@pytest.mark.parametrize(
    ("policy", "workers", "stop"),
    [
        (asynchronous(deadline=0.3), 3, {1: 5}),
        (backup(2, deadline=0.3), 5, {1: 3, 3: 8}),
        (ssp(1, deadline=0.3), 3, {2: 4}),
    ],
    ids=["async", "backup-two-lost", "ssp"],
)
def test_run_server_goes_on_without_a_silent_worker(policy, workers, stop):
    server, _, took = _train(policy, workers, 40, stop)
    assert server.version == 40
    assert sorted(server.lost) == sorted(stop)
    assert took < 0.3 * len(stop) + 5, took
    events = server.trace.of("lost")
    assert {e["worker"]: (e["rank"], e["host"]) for e in events} == {w: (w + 1, "here") for w in stop}
    counts = check_trace(server.trace, policy, workers)
    assert counts["pushed"] == counts["applied"] + counts["dropped"]
    for e in events:
        later = [a for a in server.trace.of("apply") if a["t"] >= e["t"] and a["version"] > e["last_update"]]
        assert all(e["worker"] not in a["workers"] for a in later)


def test_bsp_stops_on_a_silent_worker_naming_it():
    with pytest.raises(TimeoutError, match=r"got no gradient within deadline=0.3s; waiting on worker 1"):
        _train(bsp(deadline=0.3), 3, 40, {1: 3})


def _ended(policy: SyncPolicy, workers: int) -> tuple[Server, Threads]:
    """A server whose training is over (done) and a mailbox where every worker but the last has left."""
    server = make(policy, workers, steps=1)
    for w in range(workers):
        server.accept(arrival(w, 0))
    assert server.done
    box = Threads(3, workers)
    box.left.update(range(workers - 1))
    return server, box


def test_the_end_tells_who_is_still_out_before_the_deadline_then_loses_it():
    """Training ended before a stopped worker reached the deadline: `waiting` hears of it after the patience, long
    before the deadline (rank 0 writes the run folder there), and the worker is lost at the deadline."""
    server, box = _ended(asynchronous(deadline=1.0), 3)
    heard: list[tuple[list[int], float]] = []
    started = time.monotonic()
    close_serving(server, box, lambda out: heard.append((out, time.monotonic() - started)), patience=0.1)
    took = time.monotonic() - started
    assert [out for out, _ in heard] == [[2]]
    assert heard[0][1] < 0.5, heard
    assert server.lost == [2] and 1.0 <= took < 1.5, took
    assert server.trace.of("lost")[0]["last_update"] == 0


def test_a_worker_still_out_that_stops_before_the_deadline_is_not_lost():
    server, box = _ended(asynchronous(deadline=2.0), 3)
    close_serving(server, box, lambda out: box.left.add(2), patience=0.1)  # it comes back once it was waited on
    assert server.lost == []


def test_workers_that_stop_within_the_patience_are_not_waited_on_and_what_they_sent_is_dropped():
    server, box = _ended(asynchronous(deadline=2.0), 3)
    drops = len(server.trace.of("drop"))
    box.arrivals.put(arrival(2, 0))  # its last gradient, sent after the end; then it reads `done` and leaves
    threading.Timer(0.1, lambda: box.left.add(2)).start()
    close_serving(server, box, lambda out: pytest.fail(f"waited on {out}"), patience=1.0)
    assert server.lost == [] and box.arrivals.empty()
    assert [e["reason"] for e in server.trace.of("drop")[drops:]] == ["finished"]


def test_the_end_tells_nothing_when_the_deadline_is_shorter_than_the_patience():
    server, box = _ended(asynchronous(deadline=0.2), 3)
    close_serving(server, box, lambda out: pytest.fail(f"waited on {out}"), patience=5.0)
    assert server.lost == [2]


def test_a_worker_that_waited_on_the_server_is_not_silent_when_its_round_is_applied_at_last():
    """SSP: workers 0 and 2 sent round 0's gradient 6 s ago and wait at the bound for worker 1, which stopped. At
    the deadline worker 1 is lost and the round applied; 0 and 2 now owe the next gradient, but their silence starts
    there, not when they last sent (before: both lost at the next look, and the run stopped with nobody left)."""
    server, box = make(ssp(1, deadline=5.0), 3), Threads(3, 3)
    for w in (0, 2):
        server.accept(arrival(w, 0))
    now = time.monotonic()
    heard = [now - 6.0] * 3
    assert lose_silent(server, box, heard, now)
    assert server.lost == [1] and server.version >= 1
    assert box.muted == {1}  # the mailbox is told: it sends the lost worker nothing more but the end
    assert not lose_silent(server, box, heard, now + 0.1)  # nobody else silent yet
    assert server.lost == [1]
    with pytest.raises(TimeoutError, match="round 1 got no gradient"):  # both silent for the deadline: none left
        lose_silent(server, box, heard, now + 5.1)


def test_a_psp_worker_away_in_a_collective_is_not_silent():
    """psp, c = 2 of 3: workers 0 and 1 wait in another collective of their script (`Server.pushing`) and send
    nothing for longer than the deadline while worker 2 trains on: they said so, and are not lost; back from it, a
    worker's silence starts at the last look that saw it away."""
    server, box = make(psp(pushes=2, deadline=5.0), 3), Threads(3, 3)
    now = time.monotonic()
    heard = [now - 6.0, now - 6.0, now + 5.0]  # worker 2 pushes on
    server.pushing([0, 1])
    assert not lose_silent(server, box, heard, now) and server.lost == []
    server.pushing([])
    assert not lose_silent(server, box, heard, now + 4.9) and server.lost == []
    assert lose_silent(server, box, heard, now + 5.1) and server.lost == [0, 1]
