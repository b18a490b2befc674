"""SpecSync in the simulator (004_..., Alg. 2): scheduler timers and aborts on the virtual clock.

Runs are small (4 workers, a 16-unit MLP on synthetic data): the whole file takes a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from collsync.checks import TraceError, check_trace
from collsync.policy import asynchronous, specsync, ssp
from collsync.sim_specsync import specsync_summary
from collsync.stragglers import gamma_heterogeneous
from tests.sim.helpers import simulate

STRAGGLERS = gamma_heterogeneous()


def same_run(a, b) -> None:
    (server_a, sim_a), (server_b, sim_b) = a, b
    assert torch.equal(server_a.params, server_b.params)
    assert torch.equal(server_a.ema, server_b.ema)
    assert sim_a.trace.events == sim_b.trace.events


@pytest.mark.parametrize("base", ["async", "ssp"])
def test_abort_rate_above_one_never_aborts_and_is_the_base_policy_bit_for_bit(base):
    # m x ABORT_RATE > m - 1 >= any count of the others' pushes: the scheduler runs every timer and never re-syncs.
    never = specsync(
        base=base, adaptive=False, abort_time=0.5, abort_rate=1.01, **({"max_lead": 2} if base == "ssp" else {})
    )
    # SpecSync's workers pull (a re-sync reads with no push before it): its base is SSP reading its own writes.
    plain = asynchronous() if base == "async" else ssp(max_lead=2, stream=False)
    steps = 40 if base == "async" else 12  # an SSP update takes all 4 gradients
    spec = simulate(never, 4, steps=steps, stragglers=STRAGGLERS)
    assert spec[1].scheduler.notifies > 30 and spec[1].scheduler.resyncs == 0
    same_run(spec, simulate(plain, 4, steps=steps, stragglers=STRAGGLERS))


@pytest.mark.parametrize("adaptive", [False, True])
def test_one_worker_never_aborts_and_is_sequential_asgd(adaptive):
    kw = {"adaptive": True} if adaptive else {"adaptive": False, "abort_time": 0.2, "abort_rate": 1e-6}
    spec = simulate(specsync(**kw), 1, steps=20, stragglers=STRAGGLERS)
    assert spec[1].scheduler.notifies == 19 and spec[1].spec_stats["aborts"] == 0
    same_run(spec, simulate(asynchronous(), 1, steps=20, stragglers=STRAGGLERS))


def test_aborts_restart_on_fresher_parameters_and_the_trace_checks():
    policy = specsync(adaptive=False, abort_time=0.3, abort_rate=0.2)  # more than 0.8 pushes: one is enough
    server, sim = simulate(policy, 4, steps=60, stragglers=STRAGGLERS)
    aborts = sim.trace.of("abort")
    assert len(aborts) == sim.spec_stats["aborts"] > 5
    assert sum(e["wasted"] for e in aborts) == pytest.approx(sim.spec_stats["wasted_s"])
    assert all(e["wasted"] == pytest.approx(0.3) for e in aborts)  # re-syncs come when the period ends
    counts = check_trace(sim.trace, policy, 4)
    assert counts["updates"] == 60
    restarts = [e for e in sim.trace.of("start") if e.get("restart")]
    assert len(restarts) == len(aborts)
    summary = specsync_summary(sim, server.params.numel())
    assert summary["specsync"]["bytes"]["resync_pull"] == len(aborts) * server.params.numel() * 4
    assert summary["specsync"]["bytes"]["notify"] == 16 * sim.scheduler.notifies + 8 * sim.scheduler.resyncs


def test_check_trace_refuses_aborts_it_cannot_account_for():
    policy = specsync(adaptive=False, abort_time=0.3, abort_rate=0.2)
    _, sim = simulate(policy, 4, steps=30, stragglers=STRAGGLERS)
    events = sim.trace.events
    with pytest.raises(TraceError, match="does not speculate"):
        check_trace(events, asynchronous(), 4)
    k = next(i for i, e in enumerate(events) if e["ev"] == "abort")
    with pytest.raises(TraceError, match="wasted"):
        check_trace([*events[:k], {**events[k], "wasted": events[k]["wasted"] + 0.1}, *events[k + 1 :]], policy, 4)
    restart = next(i for i in range(k + 1, len(events)) if events[i]["ev"] == "start" and events[i].get("restart"))
    stale = {**events[restart], "version": events[k]["version"]}
    with pytest.raises(TraceError, match="restarted on version"):
        check_trace([*events[:restart], stale, *events[restart + 1 :]], policy, 4)


def test_naive_waiting_defers_every_pull_after_a_push():
    wait = 0.25
    _, sim = simulate(specsync(adaptive=False, wait=wait), 3, steps=30, stragglers=STRAGGLERS)
    pushes = {}
    for e in sim.trace.events:
        if e["ev"] == "push":
            pushes[e["worker"]] = e["t"]
        elif e["ev"] == "start" and e["worker"] in pushes:
            assert e["t"] == pytest.approx(pushes.pop(e["worker"]) + wait)
    assert not sim.trace.of("abort")


def test_adaptive_tunes_each_epoch_and_resumes_bit_for_bit(tmp_path: Path):
    from collsync import checkpoint
    from collsync.train import run
    from tests.integration.test_checkpoint import config, events, finished

    overrides = ["sync=specsync", "optimizer=sgd", "steps=30"]
    # The run that writes checkpoints is the uninterrupted run (writing them changes nothing: test_checkpoint.py).
    plain = run(config(*overrides, "checkpoint.every=11"), tmp_path / "first")
    assert plain["specsync"]["tunings"] > 3 and plain["specsync"]["aborts"] > 0
    saved = torch.load(tmp_path / "first" / checkpoint.NAME, weights_only=True)
    assert saved["version"] == 22
    again = run(config(*overrides, f"resume={tmp_path / 'first'}"), tmp_path / "again")
    assert torch.equal(finished(tmp_path / "again")["params"], finished(tmp_path / "first")["params"])
    assert [e for e in events(tmp_path / "again") if e["ev"] != "resume"] == events(tmp_path / "first")
    assert again["specsync"] == plain["specsync"]
