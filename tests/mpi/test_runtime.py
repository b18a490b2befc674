"""The MPI runtimes against the same server, policies and invariants as the simulator."""

from __future__ import annotations

import os
import random
import re
import time

import pytest
import torch

from collsync.checks import check_trace
from collsync.loops import Worker, pull, push, run_server, run_worker
from collsync.policy import asynchronous, backup, bsp, ssp
from collsync.rules import fasgd, momentum
from collsync.runtime.mpi_coll import MpiCollective
from collsync.runtime.mpi_rma import WindowMailbox
from collsync.runtime.mpi_windows import RmaCounts
from collsync.runtime.mpi_world import check_world_size, launcher_size, machine, node_layout, own_cores, world
from collsync.server import Server, replay
from collsync.trace import Trace
from collsync.types import Arrival, Stamp


def test_world_matches_the_launcher(comm):
    assert world().Get_size() == comm.Get_size()
    assert launcher_size({"PMI_SIZE": "4"}) == 4 and launcher_size({}) is None
    with pytest.raises(RuntimeError, match="launcher started 4 ranks but MPI sees a world of 1"):
        check_world_size(4, 1)


def test_node_layout_counts_the_cores_of_ranks_bound_one_core_each(comm):
    """Under `srun --cpu-bind=cores` each rank's mask is one core: the machine's ranks may still each have their own
    (a rank's own mask alone would call every node with two ranks oversubscribed). The machine is `machine()`, the
    kernel's boot id: ranks MPI keeps off shared memory (MPIR_CVAR_NOLOCAL=1) or on namespaced hosts still share it."""
    from mpi4py import MPI

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no affinity masks on this platform")
    keys = comm.allgather(machine())
    here = [r for r, key in enumerate(keys) if key == keys[comm.Get_rank()]]
    node_rank, node = here.index(comm.Get_rank()), len(here)
    start = os.sched_getaffinity(0)
    masks = comm.allgather(sorted(start))
    # The binding below assumes the machine's ranks start with one mask (mpiexec binds nothing by default).
    if comm.allreduce(len({tuple(masks[r]) for r in here}) > 1, op=MPI.LOR):
        pytest.skip("the ranks of a machine start with different affinity masks")
    cores = sorted(start)
    try:
        assert node_layout(comm) == (node, len(cores))
        os.sched_setaffinity(0, {cores[node_rank % len(cores)]})  # one core each, round robin, as a binding does
        assert node_layout(comm) == (node, min(node, len(cores)))
        assert own_cores(comm) == (node <= len(cores))
    finally:
        os.sched_setaffinity(0, start)


def test_allreduce_mean_is_exact_on_small_integers(comm):
    coll = MpiCollective(comm)
    x = torch.arange(10, dtype=torch.float64) * (coll.rank + 1)
    mean = coll.allreduce_mean(x.clone())
    expected = torch.arange(10, dtype=torch.float64) * sum(r + 1 for r in range(coll.size)) / coll.size
    assert torch.equal(mean, expected)
    req, buf = coll.iallreduce_mean(torch.full((5,), float(coll.rank), dtype=torch.float64))
    assert torch.equal(coll.finish(req, buf), torch.full((5,), (coll.size - 1) / 2, dtype=torch.float64))


def test_published_versions_are_never_torn(comm):
    if comm.Get_size() < 2:
        pytest.skip("a mailbox needs a server and at least one worker")
    numel, versions = 20_000, 30
    with WindowMailbox(comm, numel, dtype=torch.float64) as box:
        if box.is_server:
            for v in range(1, versions + 1):
                box.publish(torch.full((numel,), float(v), dtype=torch.float64), Stamp(v))
                time.sleep(random.random() * 1e-3)
            box.publish(torch.zeros(numel, dtype=torch.float64), Stamp(versions + 1, done=True))
            assert box.close() == []
        else:
            out = torch.empty(numel, dtype=torch.float64)
            seen = 0
            while True:
                stamp = box.read(out, lambda s, seen=seen: s.version > seen)
                if stamp.done:
                    break
                assert stamp.version > seen
                assert torch.all(out == stamp.version), "a read mixed two published versions"
                seen = stamp.version


def _least_squares(numel: int):
    target = torch.linspace(-1, 1, numel, dtype=torch.float64)

    def grads(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
        time.sleep(random.Random(worker * 7919 + index).random() * 2e-3)  # uneven workers
        return params - target + 0.01 * (worker + 1)

    return grads


@pytest.mark.parametrize(
    ("policy", "rule"),
    [
        (asynchronous(), lambda: momentum(lr=0.1)),
        (backup(1), lambda: momentum(lr=0.1)),
        (bsp(), lambda: momentum(lr=0.1)),
        (ssp(2), lambda: momentum(lr=0.1)),
        (asynchronous(c_push=2.0, c_fetch=2.0), lambda: fasgd(lr=0.01)),
    ],
    ids=["async", "backup", "bsp", "ssp", "bfasgd"],
)
def test_server_and_workers_over_windows(comm, policy, rule):
    if comm.Get_size() < 2 or (policy.backups and comm.Get_size() < 3):
        pytest.skip("needs a server and enough workers for the policy")
    numel, steps = 257, 40
    workers = comm.Get_size() - 1
    start = torch.zeros(numel, dtype=torch.float64)
    # Round policies as both fronts open them: the server sends the parameters (runtime.mpi_sent); streams poll.
    with WindowMailbox(comm, numel, dtype=torch.float64, sends=policy.sent()) as box:
        if box.is_server:
            trace = Trace()
            server = Server(start, rule(), policy, workers, steps=steps, trace=trace)
            received = []
            recv = box.recv

            def recording(timeout=None):
                arrival = recv(timeout)
                if arrival is not None:
                    # A copy: once the server is done with a gradient, its buffer takes the next receive.
                    grad = None if arrival.grad is None else arrival.grad.clone()
                    received.append(arrival._replace(grad=grad))
                return arrival

            close = box.close

            def closing(timeout=None):
                left = close(timeout)
                received.extend(left)
                return left

            box.recv = recording  # type: ignore[method-assign]
            box.close = closing  # type: ignore[method-assign]
            run_server(server, box)
            counts = check_trace(trace, policy, workers)
            assert server.version == steps
            assert counts["pushed"] == counts["applied"] + counts["dropped"] == len(received)
            again = replay(start, rule(), policy, workers, received, steps=steps)
            assert torch.equal(again.params, server.params)
        else:
            sent = run_worker(
                Worker(box.worker, policy, seed=1), box, _least_squares(numel), torch.empty(numel, dtype=torch.float64)
            )
            assert sent > 0


@pytest.mark.parametrize("sent", [False, True], ids=["window", "sent"])
def test_a_round_through_the_windows_is_four_round_trips_or_none(comm, sent):
    """Issue 33, item 3. Through the window (stream policies: `sends` None) a push is one round trip (the gradient
    and its header under one Flush), its flag goes with the next read's first poll, and a pull is three once nothing
    is waited for (the header with this worker's flag; the Get; the seqlock's re-read of seq), each poll that waits
    one; before, a round took 7-9 and a poll two. With server-sent parameters (round policies, `runtime.mpi_sent`)
    the push is one message (header and gradient) and the pull a local test of the delivery: no round trip at all
    (the push was one, its Flush, until the push became a message)."""
    if comm.Get_size() < 2:
        pytest.skip("a mailbox needs a server and at least one worker")
    # bsp: no version is published while a worker reads (its round needs its push), so no read is torn and retried.
    numel, steps, policy = 300, 15, bsp()
    workers = comm.Get_size() - 1
    with WindowMailbox(comm, numel, dtype=torch.float64, sends=policy.sent() if sent else None) as box:
        if box.is_server:
            start = torch.zeros(numel, dtype=torch.float64)
            server = Server(start, momentum(lr=0.1), policy, workers, steps=steps, trace=Trace())
            run_server(server, box)
            assert server.version == steps
            counts = check_trace(server.trace, policy, workers)
            assert counts["pushed"] == counts["applied"] + counts["dropped"]
        else:
            counts = box.count(RmaCounts())
            worker, params = Worker(box.worker, policy, seed=1), torch.empty(numel, dtype=torch.float64)
            grads = _least_squares(numel)
            pulls, pushes = [], []
            while True:
                before = counts.copy()
                if pull(worker, box, params).done:
                    break
                pulls.append(counts.minus(before))
                before = counts.copy()
                push(worker, box, grads(params, worker.rank, worker.steps), pull_next=True)
                pushes.append(counts.minus(before))
            trips = 0 if sent else 1
            assert pushes and all(c.round_trips == trips and c.waits == 0 for c in pushes), [
                c.round_trips for c in pushes
            ]
            own = [c.round_trips - c.poll_trips for c in pulls]
            assert all(x == (0 if sent else 3) for x in own), own
            assert all(c.poll_trips <= c.waits + 1 for c in pulls), [(c.poll_trips, c.waits) for c in pulls]
            if sent:  # one delivery a pull (the parameters and the stamp), one message a push and nothing else
                assert all(c.ops["Irecv"] == 2 and c.ops["Get"] == 0 for c in pulls[1:]), [c.ops for c in pulls]
                assert all(c.ops["Isend"] == 1 and c.remote_ops == 1 for c in pushes), [c.ops for c in pushes]


def test_an_async_worker_whose_window_read_is_slower_than_the_publishes_still_reads_each_step(comm):
    """Issue 33, item 4: async reads by delivery (`policy.Sent`, least version 0). Through the window a read is a
    seqlock (Get, then re-read seq, retry if a publish moved it), so a worker whose Get takes longer than the server
    takes between two publishes never read a clean copy: across a 5 ms link, behind three fast workers, one made 1
    step in 8 epochs. Here the server publishes every 0.2 ms and the worker's window Get is held 5 ms (as a slow
    link's), and each of its reads after a push still comes within seconds, whole, and includes its push."""
    if comm.Get_size() < 2:
        pytest.skip("a mailbox needs a server and at least one worker")
    policy, numel, steps = asynchronous(), 64, 5
    workers = comm.Get_size() - 1
    assert policy.sent() is not None and policy.sent().least(7) == 0
    with WindowMailbox(comm, numel, dtype=torch.float64, sends=policy.sent()) as box:
        if box.is_server:
            version, taken, pushes = 0, 0, [0] * workers
            box.publish(torch.zeros(numel, dtype=torch.float64), Stamp(0))
            end = time.monotonic() + 60.0
            while taken < workers * steps and time.monotonic() < end:
                arrival = box.recv(timeout=0.0)
                version += 1
                if arrival is not None:
                    taken += 1
                    pushes[arrival.worker] += 1
                box.publish(torch.full((numel,), float(version), dtype=torch.float64), Stamp(version))
                time.sleep(2e-4)
            box.publish(torch.zeros(numel, dtype=torch.float64), Stamp(version + 1, done=True))
            box.close(timeout=30.0)
            assert taken == workers * steps, (taken, workers * steps)
            assert pushes == [steps] * workers, pushes
        else:
            get = box._get_params

            def slow_get(buf, seq):  # a window read as slow as one across a slow link
                time.sleep(5e-3)
                return get(buf, seq)

            box._get_params = slow_get  # type: ignore[method-assign]
            worker, params = Worker(box.worker, policy), torch.empty(numel, dtype=torch.float64)
            assert pull(worker, box, params).version == 0
            for step in range(steps):
                pushed_from = worker.version
                push(worker, box, torch.ones(numel, dtype=torch.float64), pull_next=True)
                began, stamp = time.monotonic(), None
                while stamp is None and time.monotonic() - began < 10.0:
                    stamp = box.try_read(params, worker.ready)
                assert stamp is not None, f"worker {box.worker}: no read within 10 s of its push"
                if stamp.done:  # the last push's delivery and `done` came in one test: `done` supersedes it
                    assert step == steps - 1, (step, stamp)
                    break
                assert torch.all(params == stamp.version), "a read mixed two published versions"
                assert stamp.version > pushed_from  # its push was dealt with before the version it reads
                worker.begin(stamp)
            assert pull(worker, box, params).done


@pytest.mark.parametrize("name", ["ssp", "bsp"])
def test_an_ssp_worker_reads_its_next_version_before_its_push_lands(comm, name):
    """Issue 33, item 3: under SSP (bound 1, `stream=True`, no `patience`) the servers send every version as it is
    published (`policy.Sent.streams`), so a worker that pushed round 0 computes round 1 on the version it holds while
    the server has not even taken the push (here: held in a barrier); under BSP it reads its own writes and must wait
    for it."""
    if comm.Get_size() < 2:
        pytest.skip("a mailbox needs a server and at least one worker")
    policy = ssp(1, stream=True, patience=None) if name == "ssp" else bsp()
    numel, workers = 6, comm.Get_size() - 1
    with WindowMailbox(comm, numel, dtype=torch.float64, sends=policy.sent()) as box:
        if box.is_server:
            box.publish(torch.zeros(numel, dtype=torch.float64), Stamp(0, False))
            comm.Barrier()  # every worker pushed round 0 and tried its next read; none of the pushes was taken
            taken = [box.recv(timeout=30.0) for _ in range(workers)]
            assert all(a is not None and a.clock == 0 for a in taken), taken
            box.publish(torch.ones(numel, dtype=torch.float64), Stamp(1, True))
            box.close(timeout=30.0)
        else:
            worker, params = Worker(box.worker, policy), torch.empty(numel, dtype=torch.float64)
            assert pull(worker, box, params).version == 0
            push(worker, box, torch.ones(numel, dtype=torch.float64), pull_next=True)
            stamp = box.try_read(params, worker.ready)
            if name == "ssp":
                assert stamp is not None and stamp.version == 0 and worker.ready(stamp), stamp
                worker.begin(stamp)  # round 1 on version 0; its next round needs version 1
            else:
                assert stamp is None, stamp  # round 1 needs version 1: the push first
            comm.Barrier()
            assert pull(worker, box, params).done


@pytest.mark.parametrize("case", ["fresh", "held"])
def test_a_patient_ssp_worker_holds_out_for_the_version_its_push_makes_then_takes_the_one_it_holds(comm, case):
    """Issue 33/34: streaming with `patience` 0.5 (`loops.Worker.holds_out`), a worker whose gradient took 1 s (its
    own clock, set by hand) does not compute round 1 on version 0, which it holds, for 0.5 s after its push: it
    takes version 1 if the server publishes it meanwhile ("fresh"), else version 0 once the 0.5 s are over ("held").
    The delivery carries the stamp's `closer` (the worker whose push completed the round: `Worker.closes`)."""
    if comm.Get_size() < 2:
        pytest.skip("a mailbox needs a server and at least one worker")
    policy = ssp(1, stream=True, patience=0.5)
    numel, workers = 6, comm.Get_size() - 1
    with WindowMailbox(comm, numel, dtype=torch.float64, sends=policy.sent()) as box:
        if box.is_server:
            box.publish(torch.zeros(numel, dtype=torch.float64), Stamp(0, False))
            comm.Barrier()  # every worker pushed round 0 and found nothing it may take yet
            if case == "fresh":
                taken = [box.recv(timeout=30.0) for _ in range(workers)]
                assert all(a is not None and a.clock == 0 for a in taken), taken
                box.publish(torch.ones(numel, dtype=torch.float64), Stamp(1, False, 0.0, workers - 1))
            comm.Barrier()  # every worker took a version for round 1
            box.publish(torch.ones(numel, dtype=torch.float64), Stamp(2, True))
            box.close(timeout=30.0)
        else:
            clock = [0.0]
            worker = Worker(box.worker, policy, now=lambda: clock[0])
            params = torch.empty(numel, dtype=torch.float64)
            assert pull(worker, box, params).version == 0
            clock[0] = 1.0  # the gradient took a second: it holds out until 1.5
            push(worker, box, torch.ones(numel, dtype=torch.float64), pull_next=True)
            first = box.try_read(params, worker.ready)
            comm.Barrier()
            clock[0] = 1.4 if case == "fresh" else 1.6
            end, stamp = time.monotonic() + 10.0, None
            while stamp is None and time.monotonic() < end:  # bounded: a failure must not hang the others
                stamp = box.try_read(params, worker.ready)
            if stamp is not None:
                worker.begin(stamp)
            comm.Barrier()
            done = box.read(params, lambda s: s.done)  # the version held would serve round 2 again: wait for `done`
            assert first is None, first  # version 0 was held, and 1 s x 0.5 not over
            assert stamp is not None and stamp.version == (1 if case == "fresh" else 0), stamp
            assert stamp.closer == (comm.Get_size() - 2 if case == "fresh" else -1), stamp
            assert float(params[0]) == (1.0 if case == "fresh" else 0.0)
            assert done.done


def test_a_worker_that_saw_done_in_the_window_does_not_wait_for_its_delivery(comm):
    """PSP's partial pull reads a slow shard's window without waiting (`ShardedMailbox.read`); seeing `done` there
    stores FINISHED, so that shard's `close` may end before its `done` delivery went out. The worker's next read of
    that shard, after a push, looked only at its inbox and waited for ever (tests/mpi/test_shards.py's partial pull
    hung under load). Here no `done` is delivered at all: every later read must still return it."""
    if comm.Get_size() < 2:
        pytest.skip("a mailbox needs a server and at least one worker")
    policy = bsp()
    numel = 6
    seen: list[Stamp | None] = []
    with WindowMailbox(comm, numel, dtype=torch.float64, sends=policy.sent()) as box:
        if box.is_server:
            assert box.outbox is not None
            box.publish(torch.zeros(numel, dtype=torch.float64), Stamp(0, False))
            comm.Barrier()  # every worker took version 0 and pushed
            box.outbox.live.clear()  # as after a `close` that ended first: `done` is sent to no worker
            box.publish(torch.ones(numel, dtype=torch.float64), Stamp(1, True))
            comm.Barrier()
            box.close(timeout=30.0)
        else:
            worker, params = Worker(box.worker, policy), torch.empty(numel, dtype=torch.float64)
            assert pull(worker, box, params).version == 0
            push(worker, box, torch.ones(numel, dtype=torch.float64), pull_next=True)
            comm.Barrier()
            comm.Barrier()
            seen.append(box.try_read(params, lambda s: True, window=True))
            end = time.monotonic() + 5.0
            stamp = None
            while stamp is None and time.monotonic() < end:  # a bounded wait: a failure must not hang the others
                stamp = box.try_read(params, worker.ready)
            seen.append(stamp)
    if not box.is_server:
        assert all(s is not None and s.done and s.version == 1 for s in seen), seen


def test_a_streaming_worker_is_sent_few_versions_it_has_not_received_and_a_lost_one_only_done(comm):
    """SSP streams every version, but a small delivery's send completes once MPI buffered it, received or not: one
    delivery each publish to a worker that stopped took all of the server's shared-memory cells (MPICH: 64), and
    then no send to any worker went out (tests/integration/test_torch_lost.py [ssp] stalled at round 54). A worker
    is sent at most `ahead` deliveries beyond those its last push says it received, and one the server lost is
    sent `done` only; `done` still reaches every worker."""
    if comm.Get_size() < 2:
        pytest.skip("a mailbox needs a server and at least one worker")
    policy = ssp(3, stream=True)
    sent = policy.sent()
    assert sent is not None and sent.streams and sent.ahead == 4
    numel, workers = 6, comm.Get_size() - 1
    counts: list[list[int]] = []
    delivered: list[int] = []
    left: list[Arrival] | None = None
    newest = -1
    with WindowMailbox(comm, numel, dtype=torch.float64, sends=sent) as box:
        if box.is_server:
            out = box.outbox
            assert out is not None

            def publish(version: int, done: bool = False) -> None:
                box.publish(torch.full((numel,), float(version), dtype=torch.float64), Stamp(version, done))
                end = time.monotonic() + 30.0
                while out.flying and time.monotonic() < end:  # every send that can complete has
                    out.pump()
                    time.sleep(0.001)

            publish(0)
            comm.Barrier()  # every worker took version 0 and computes (receives nothing more) until the next barrier
            for version in range(1, 12):
                publish(version)
            counts.append(list(out.deliveries))
            comm.Barrier()
            box.lose(0)
            # Each push says its worker received one delivery: one more may go, the newest (11, or 12 to the worker
            # whose push was taken last, freed only at the next publish).
            for _ in range(workers):
                box.recv(timeout=30.0)
            publish(12)
            counts.append(list(out.deliveries))
            delivered = list(out.delivered)  # the last version sent to each worker before `done`
            publish(13, done=True)
            left = box.close(timeout=30.0)
        else:
            worker, params = Worker(box.worker, policy), torch.empty(numel, dtype=torch.float64)
            pull(worker, box, params)
            comm.Barrier()
            comm.Barrier()
            push(worker, box, torch.ones(numel, dtype=torch.float64))
            while not (stamp := box.read(params, lambda s: True)).done:
                newest = max(newest, stamp.version)
    # Asserted after the collective frees: a failure here must fail the test, not leave the other ranks waiting.
    if box.is_server:
        assert counts[0] == [sent.ahead] * workers, counts  # versions 0-3, not 0-11
        assert counts[1] == [sent.ahead] + [sent.ahead + 1] * (workers - 1), counts
        # The lost worker was sent versions 0-3, then `done`; the others the newest once their push came.
        assert delivered[0] == sent.ahead - 1 and all(v in (11, 12) for v in delivered[1:]), delivered
        assert left == [], left
    else:
        # What a worker reads: deliveries that complete in the same test as `done` are skipped for it (`done`
        # supersedes), so its newest read may be older than the last version it was sent (or none, -1), never newer.
        assert newest <= (sent.ahead - 1 if box.worker == 0 else 12), newest


def test_close_names_a_worker_that_never_stops(comm):
    if comm.Get_size() < 2:
        pytest.skip("a mailbox needs a server and at least one worker")
    raised: TimeoutError | None = None
    with WindowMailbox(comm, 4, dtype=torch.float64) as box:
        if box.is_server:
            box.publish(torch.zeros(4, dtype=torch.float64), Stamp(1, done=True))
            try:
                box.close(timeout=0.2)
            except TimeoutError as exc:
                raised = exc
            comm.send(None, dest=1)  # only now may worker 0 (rank 1) read the done stamp and stop
        elif box.worker == 0:
            comm.recv(source=0)
        if not box.is_server:
            assert box.read(torch.empty(4, dtype=torch.float64), lambda s: True).done
        comm.Barrier()
    # Asserted after the collective frees: a failure here must fail the test, not leave the other ranks waiting.
    if box.is_server:
        assert raised is not None, "close() returned although worker 0 never stopped"
        assert re.search(r"worker 0 \(rank \d+\) did not stop within deadline=0.2s", str(raised)), str(raised)


def test_close_does_not_take_again_what_recv_returned(comm):
    """The server frees a slot it read at its next `recv`; `close()` frees the last one first, so a gradient the
    server already accepted is not handed back a second time (it was traced twice: pushed 204 for 203 sent)."""
    if comm.Get_size() < 2:
        pytest.skip("a mailbox needs a server and at least one worker")
    with WindowMailbox(comm, 4, dtype=torch.float64) as box:
        if box.is_server:
            got = None
            while got is None:
                got = box.recv(timeout=1.0)
            comm.recv(source=1)  # worker 0 has left
            box.publish(torch.zeros(4, dtype=torch.float64), Stamp(1, done=True))
            left = box.close(timeout=60)
            assert got.worker == 0 and [a.worker for a in left if a.worker == 0] == []
        else:
            if box.worker == 0:
                box.send(Arrival(0, 0, torch.ones(4, dtype=torch.float64), 0))
            box.leave()
            if box.worker == 0:
                comm.send(None, dest=0)
        comm.Barrier()
