"""Policies and the server, driven by hand-made arrivals (no runtime)."""

from __future__ import annotations

import pytest
import torch

from collsync.checks import TraceError, check_trace
from collsync.loops import Worker
from collsync.policy import SyncPolicy, Transmit, asynchronous, backup, ssp
from collsync.rules import fasgd, gap_aware, sgd
from collsync.rules.base import EmptyState, Rule
from collsync.server import Server, replay
from collsync.trace import Trace
from collsync.types import Arrival


def arrival(worker: int, version: int, value: float, clock: int | None = None) -> Arrival:
    return Arrival(worker, version, torch.full((3,), value, dtype=torch.float64), version if clock is None else clock)


def make(policy: SyncPolicy, workers: int, **kw) -> Server:
    return Server(torch.zeros(3, dtype=torch.float64), sgd(lr=1.0), policy, workers, trace=Trace(lambda: 0.0), **kw)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: backup(-1), "backups=-1"),
        (lambda: ssp(-2), "max_lead=-2"),
        (lambda: asynchronous(quorum=0), "quorum=0"),
        (lambda: asynchronous(timeout=-1.0), "timeout=-1.0"),
        (lambda: SyncPolicy("x", timeout=5.0, deadline=2.0), "timeout=5.0 must be < deadline=2.0"),
    ],
)
def test_policy_rejects_bad_values(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_policy_checks_against_workers():
    with pytest.raises(ValueError, match="backups=4 must be < workers=4"):
        backup(4).check(4)
    with pytest.raises(ValueError, match="quorum=5 must be <= workers=4"):
        asynchronous(quorum=5).check(4)
    with pytest.raises(ValueError, match="backups=3 must be < workers=2"):
        make(backup(3), 2)


def test_backup_round_takes_first_n_in_worker_order_and_drops_late():
    server = make(backup(1), 3)
    assert server.accept(arrival(2, 0, 3.0))
    assert server.version == 0
    assert server.accept(arrival(0, 0, 1.0))
    # Round 0 closed with workers {0, 2}: mean 2.0, lr 1 -> theta = -2.
    assert server.version == 1
    assert torch.equal(server.params, torch.full((3,), -2.0, dtype=torch.float64))
    assert not server.accept(arrival(1, 0, 100.0))
    assert server.dropped == 1
    applies = server.trace.of("apply")
    assert applies[0]["workers"] == [0, 2] and applies[0]["staleness"] == [0, 0]
    check_trace(server.trace, backup(1), 3)


def test_async_applies_each_arrival_with_its_staleness():
    server = make(asynchronous(), 2)
    server.accept(arrival(0, 0, 1.0))
    server.accept(arrival(1, 0, 2.0))
    server.accept(arrival(0, 1, 4.0))
    assert server.version == 3
    assert [e["staleness"] for e in server.trace.of("apply")] == [[0], [1], [1]]
    assert torch.equal(server.params, torch.full((3,), -7.0, dtype=torch.float64))


def test_ssp_buffers_future_rounds_and_cascades():
    server = make(ssp(2), 2)
    server.accept(arrival(0, 0, 1.0, clock=0))
    server.accept(arrival(0, 0, 1.0, clock=1))
    server.accept(arrival(0, 0, 1.0, clock=2))
    assert server.version == 0
    server.accept(arrival(1, 0, 3.0, clock=0))
    assert server.version == 1
    server.accept(arrival(1, 1, 3.0, clock=1))
    assert server.version == 2
    assert server.trace.of("apply")[1]["staleness"] == [1, 0]


def test_flush_and_drain_settle_everything():
    server = make(asynchronous(quorum=3, timeout=1.0), 3, steps=2)
    server.accept(arrival(0, 0, 1.0))
    assert not server.flush() or server.version == 1
    assert server.version == 1
    server.accept(arrival(1, 0, 1.0))
    server.accept(arrival(2, 1, 1.0))
    server.accept(arrival(0, 1, 1.0))
    assert server.done
    assert not server.accept(arrival(1, 2, 1.0))
    server.drain()
    counts = check_trace(server.trace, asynchronous(quorum=3, timeout=1.0), 3)
    assert counts == {"pushed": 5, "applied": 4, "dropped": 1, "updates": 2}


def test_check_trace_catches_a_lost_gradient():
    server = make(backup(1), 3)
    server.accept(arrival(0, 0, 1.0))
    server.accept(arrival(1, 0, 1.0))
    server.trace.record("push", worker=2, clock=0, version=0, staleness=1)
    with pytest.raises(TraceError, match="pushed 1x, settled 0x"):
        check_trace(server.trace, backup(1), 3)


def test_replay_reproduces_the_parameters():
    arrivals = [arrival(w % 2, v, float(w)) for w, v in enumerate([0, 0, 1, 2, 2])]
    server = make(asynchronous(), 2)
    for a in arrivals:
        server.accept(a)
    again = replay(torch.zeros(3, dtype=torch.float64), sgd(lr=1.0), asynchronous(), 2, arrivals)
    assert torch.equal(server.params, again.params)


def test_history_kept_only_for_rules_that_read_it_and_pruned():

    seen = []

    def update(g, s, p, ctx):
        seen.append(None if ctx.read is None else ctx.read.clone())
        return g, s

    reader = Rule(lambda p: EmptyState(), update, needs_read=True)
    server = Server(torch.zeros(3, dtype=torch.float64), sgd(lr=1.0), asynchronous(), 2, penalty=reader)
    server.accept(arrival(0, 0, 1.0))
    server.accept(arrival(1, 0, 1.0))
    server.accept(arrival(0, 1, 1.0))
    assert torch.equal(seen[1], torch.zeros(3, dtype=torch.float64))
    assert torch.equal(seen[2], torch.full((3,), -1.0, dtype=torch.float64))
    # Worker 1 may still send a gradient computed on version 0, so version 0 is kept until it moves on.
    assert 0 in server._history
    server.accept(arrival(1, 2, 1.0))
    assert sorted(server._history) == [1, 2, 3, 4]  # worker 0 last sent a gradient of version 1


def test_gap_aware_updates_record_their_gap():

    server = Server(
        torch.zeros(3, dtype=torch.float64), sgd(lr=1.0), asynchronous(), 2, penalty=gap_aware(), trace=Trace()
    )
    server.accept(arrival(0, 0, 1.0))
    server.accept(arrival(1, 0, 1.0))
    first, second = server.trace.of("apply")
    assert first["gap"] == [1.0]  # read == current parameters: no gap
    assert second["gap"][0] > 1.0  # worker 1 read version 0, the server is at version 1


def test_bfasgd_skipped_push_reapplies_the_last_gradient_and_needs_fasgd():

    policy = asynchronous(c_push=5.0, c_fetch=5.0)
    server = Server(torch.zeros(3, dtype=torch.float64), fasgd(lr=1.0), policy, 2, trace=Trace())
    assert server.stamp().signal == 0.0  # FASGD's v starts at zero
    server.accept(arrival(0, 0, 2.0))
    after_first = server.params.clone()
    server.accept(Arrival(0, 1, None, 1))
    pushes = server.trace.of("push")
    assert pushes[1].get("repeat") is True and "repeat" not in pushes[0]
    assert not torch.equal(server.params, after_first)  # the repeated gradient moved theta again
    assert server.stamp().signal > 0.0
    with pytest.raises(ValueError, match="skipped a push before it ever pushed"):
        server.accept(Arrival(1, 2, None, 2))
    with pytest.raises(ValueError, match="needs optimizer=fasgd"):
        Server(torch.zeros(3), sgd(lr=0.1), policy, 2)
    with pytest.raises(ValueError, match="c_push"):
        SyncPolicy("ssp", max_lead=1, transmit=Transmit(c_push=1.0))
    with pytest.raises(ValueError, match="c_fetch=-1"):
        asynchronous(c_fetch=-1.0)
    # The coin flips are a per-worker stream: same seed, same decisions; c = 0 always transmits.
    a, b = Worker(1, policy, seed=3, signal=1.0, steps=1), Worker(1, policy, seed=3, signal=1.0, steps=1)
    assert [a.will_push() for _ in range(50)] == [b.will_push() for _ in range(50)]
    always = Worker(0, asynchronous(c_push=0.0, c_fetch=0.0), signal=1.0, steps=1)
    assert all(always.will_push() and always.will_fetch() for _ in range(50))
