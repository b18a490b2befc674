"""PSP-SGD (003_... Alg. 1) and SSP with a timeout: the policy, the server's collection, the simulator's clock and
the shard split, checked on hand-made arrivals and small simulated runs."""

from __future__ import annotations

import pytest
import torch

from collsync.checks import check_trace
from collsync.policy import SyncPolicy, asynchronous, backup, bsp, psp, push_quorum, ssp
from collsync.rules import sgd
from collsync.runtime.mpi_shards import shard_bounds
from collsync.server import Server
from collsync.stragglers import frozen_worker, slow_server
from collsync.trace import Trace
from collsync.types import Arrival
from tests.sim.helpers import simulate


def arrival(worker: int, version: int, value: float) -> Arrival:
    return Arrival(worker, version, torch.full((2,), value, dtype=torch.float64), version)


def make(policy: SyncPolicy, workers: int, steps: int = 10) -> Server:
    return Server(torch.zeros(2, dtype=torch.float64), sgd(lr=1.0), policy, workers, steps=steps, trace=Trace())


def test_psp_defaults_are_the_papers_push_28_of_32_pull_90_percent():
    policy = psp()
    assert policy.quorum_for(32) == 28  # ceil(0.875 x 32): the paper's setting
    assert policy.quorum_for(4) == 4  # ceil(3.5): every worker (policy.push_quorum says why not floor)
    assert policy.quorum_for(3) == 3  # ceil(2.625)
    assert policy.quorum_for(1) == 1
    assert policy.pull_fraction == 0.9 and policy.timeout is None and policy.pull_timeout is None
    assert psp(pushes=5).quorum_for(32) == 5  # an explicit c wins over the fraction
    assert psp(push_fraction=None).quorum_for(7) == 7  # neither: every worker


@pytest.mark.parametrize(
    ("fraction", "workers", "c"),
    [(0.875, 2, 2), (0.1, 4, 1), (0.5, 4, 2), (0.75, 4, 3), (0.875, 8, 7), (0.875, 32, 28), (1.0, 4, 4), (0.5, 1, 1)],
)
def test_psp_push_fraction_rounds_up_and_takes_at_least_one(fraction, workers, c):
    assert push_quorum(fraction, workers) == c
    assert psp(push_fraction=fraction).quorum_for(workers) == c
    # Below n, a default psp goes on without a lost worker (its quorum shrinks to the live ones).
    assert psp(push_fraction=fraction).tolerates(1, workers) == (workers > 1 and c < workers)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: psp(pull_fraction=0.0), "pull_fraction=0.0 must be in"),
        (lambda: psp(push_fraction=1.5), "push_fraction=1.5 must be in"),
        (lambda: psp(pull_timeout=-1.0), "pull_timeout=-1.0 must be > 0"),
        (lambda: psp(timeout=3.0, deadline=2.0), "timeout=3.0 must be < deadline=2.0"),
        (lambda: psp(pull_timeout=2.0, deadline=2.0), "pull_timeout=2.0 must be < deadline=2.0"),
        (lambda: SyncPolicy("x", quorum=2, push_fraction=0.5), "push_fraction=0.5 and quorum"),
    ],
)
def test_psp_rejects_bad_values(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_psp_round_waits_for_everyone_up_to_the_timeout_after_c():
    # c = 2 of 3 with a timeout: at 2 the round starts its clock (collecting) but is not applied; the third
    # gradient completes it, all three averaged.
    server = make(psp(pushes=2, timeout=1.0), 3)
    assert not server.collecting()
    server.accept(arrival(0, 0, 1.0))
    assert not server.collecting() and not server.flush()  # fewer than c: a flush may not apply
    server.accept(arrival(1, 0, 2.0))
    assert server.collecting() and server.version == 0
    server.accept(arrival(2, 0, 6.0))
    assert server.version == 1
    assert torch.equal(server.params, torch.full((2,), -3.0, dtype=torch.float64))  # -(1 + 2 + 6) / 3
    assert server.trace.of("apply")[0]["workers"] == [0, 1, 2]


def test_psp_timeout_applies_the_c_that_came_and_drops_the_late_one():
    policy = psp(pushes=2, timeout=1.0)
    server = make(policy, 3)
    server.accept(arrival(2, 0, 1.0))
    server.accept(arrival(0, 0, 3.0))
    assert server.flush()  # tau1 ran out
    assert server.version == 1
    assert torch.equal(server.params, torch.full((2,), -2.0, dtype=torch.float64))
    assert not server.accept(arrival(1, 0, 50.0))  # round 0 is over: dropped
    assert server.dropped == 1
    counts = check_trace(server.trace, policy, 3)
    assert counts["applied"] == 2 and counts["dropped"] == 1


def test_psp_without_timeout_applies_at_c():
    server = make(psp(pushes=2), 3)
    server.accept(arrival(1, 0, 1.0))
    server.accept(arrival(2, 0, 1.0))
    assert server.version == 1 and not server.collecting()


def test_psp_rounds_count_only_the_workers_still_pushing():
    """Issue 33: c = 3 of 4, workers 0-2 away (waiting in another collective of their script): worker 3's round,
    which only it pushes to, is applied with its gradient alone at once (Q = min(c, n - away) = 1), and its next
    round too; back, a worker counts again (its push is the word), and the trace checks hold throughout."""
    policy = psp(pushes=3)
    server = make(policy, 4)
    for w in range(3):
        server.accept(arrival(w, 0, 1.0))
    assert server.version == 1
    server.accept(Arrival(3, 1, torch.full((2,), 4.0, dtype=torch.float64), 1))
    assert server.version == 1  # 1 of c = 3: waits
    server.pushing([0, 1, 2])
    assert server.version == 2 and server.quorum == 1 and server.trace.of("apply")[-1]["workers"] == [3]
    server.accept(Arrival(3, 2, torch.full((2,), 4.0, dtype=torch.float64), 2))
    assert server.version == 3
    server.accept(Arrival(0, 3, torch.full((2,), 1.0, dtype=torch.float64), 3))  # worker 0 steps again: back
    assert server.away == {1, 2} and server.quorum == 2 and server.version == 3
    server.pushing([])
    assert server.quorum == 3 and server.version == 3
    assert [e["workers"] for e in server.trace.of("away")] == [[0, 1, 2], [1, 2], []]
    server.stop()  # the script ends: worker 0's gradient of round 3 is dropped
    counts = check_trace(server.trace, policy, 4)
    assert counts["updates"] == 3 and counts["applied"] == 5 and counts["dropped"] == 1
    # The same updates without the `away` events break the checks: an update of 1 gradient where c = 3.
    with pytest.raises(Exception, match=r"update 2 aggregated 1 gradients, not in \[3, 3\]"):
        check_trace([e for e in server.trace.events if e["ev"] != "away"], policy, 4)


@pytest.mark.parametrize(
    "policy", [bsp(), backup(1), ssp(max_lead=0, timeout=1.0), ssp(max_lead=2)], ids=["bsp", "backup", "ssp0", "ssp"]
)
def test_only_psp_counts_the_workers_still_pushing(policy):
    """BSP, SSP (also at bound 0 with a timeout: quorum 1) and backup keep their rounds' quorum: `pushing` is PSP's."""
    server = make(policy, 3)
    before = (server.quorum, server.full)
    server.pushing([0, 1])
    assert (server.quorum, server.full) == before and not server.away and not server.trace.of("away")


def test_ssp_with_timeout_applies_a_round_without_the_frozen_worker():
    policy = ssp(max_lead=1, timeout=0.5)
    server = make(policy, 2)
    server.accept(arrival(0, 0, 2.0))
    assert server.collecting()
    assert server.flush()
    assert server.trace.of("apply")[0]["workers"] == [0]


@pytest.mark.parametrize(
    "policy",
    [ssp(max_lead=2, timeout=3.0), psp(pushes=3, timeout=3.0), psp(pushes=3)],
    ids=["ssp-timeout", "psp-timeout", "psp"],
)
def test_simulated_frozen_worker_does_not_stop_training(policy):
    # Worker 1 freezes at t = 5 s; every update after that must come without it.
    server, sim = simulate(policy, 4, steps=40, stragglers=frozen_worker(worker=1, at=5.0))
    assert server.version == 40
    check_trace(sim.trace, policy, 4)
    applies = sim.trace.of("apply")
    late = [e for e in applies if e["t"] > 5.0 + 2 * 3.0]
    assert late and all(1 not in e["workers"] for e in late)


def test_simulated_ssp_without_timeout_stops_on_a_frozen_worker():
    # Without a timeout a frozen worker holds SSP back for good: the simulator reports it instead of running on.
    with pytest.raises(Exception, match=r"frozen worker\(s\) \[1\]"):
        simulate(ssp(max_lead=2), 4, steps=40, stragglers=frozen_worker(worker=1, at=5.0))


def test_shard_bounds_cover_the_vector_in_balanced_blocks():
    for numel, shards in [(10, 1), (10, 3), (7, 7), (1000, 4), (1001, 4)]:
        bounds = shard_bounds(numel, shards)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        sizes = [stop - start for start, stop in bounds]
        assert max(sizes) - min(sizes) <= 1 and len(bounds) == shards
    with pytest.raises(ValueError, match="servers=5 must be between 1 and the 4 parameters"):
        shard_bounds(4, 5)


def test_a_slow_simulated_server_delays_every_update_by_its_time():
    # BSP, 2 workers, every batch 1 s, the server 1 s per update: update k lands at 2k - 1 instead of k.
    for seconds, expected in [(0.0, [8.0, 9.0, 10.0]), (1.0, [15.0, 17.0, 19.0])]:
        _, sim = simulate(bsp(), 2, steps=10, stragglers=slow_server(seconds=seconds))
        assert [e["t"] for e in sim.trace.of("apply")][-3:] == expected
    # Async, 3 workers: a busy server applies one gradient per second; none is lost.
    policy = asynchronous()
    _, sim = simulate(policy, 3, steps=12, stragglers=slow_server(seconds=1.0))
    assert [e["t"] for e in sim.trace.of("apply")][-3:] == [10.0, 11.0, 12.0]
    check_trace(sim.trace, policy, 3)


def test_slow_shard_must_name_a_shard():
    with pytest.raises(ValueError, match="stragglers: shard=-1"):
        slow_server(shard=-1)
