"""The simulator's model of streamed versions (`policy.Sent.streams`, issue 33): under SSP a worker whose push is
late on the network starts its next round once its compute is done, on a version its bound allows, as the MPI
servers' deliveries let it (`ssp()`, `stream=True`), after holding out for the version its own push makes for at most
`patience` times its compute (`loops.Worker.holds_out`); under BSP, and SSP with `stream=False`, it reads its own
writes, so the late push holds its next round."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from collsync.policy import USUAL_FROM, bsp, ssp
from collsync.rules import sgd
from collsync.server import Server
from collsync.sim import Simulator
from collsync.stragglers import OneSlow, Stragglers

WORKERS, ROUNDS = 4, 30


def starts(policy, delay: float, stragglers: Stragglers | OneSlow | None = None) -> tuple[list[dict], list[dict]]:
    """(worker 0's start events, the applies) of a run where every push is `delay` seconds late (compute 1 s)."""
    stragglers = stragglers or Stragglers(delay_prob=1.0 if delay else 0.0, delay=delay)
    sim = Simulator(WORKERS, stragglers, seed=0)
    server = Server(torch.zeros(2), sgd(lr=0.1), policy, WORKERS, steps=ROUNDS, trace=sim.trace)
    sim.run(server, lambda params, worker, index: torch.ones(2))
    return [e for e in sim.trace.of("start") if e["worker"] == 0], sim.trace.of("apply")


def test_ssp_computes_on_while_its_push_is_on_its_way():
    """Every push 0.5 s late, compute 1 s: SSP (bound 1) starts each round when the last one's compute is done (a
    second apart), so its rounds take 1 s where BSP's take 1.5 s (compute, then the push's way)."""
    ssp_starts, ssp_applies = starts(ssp(1, stream=True, patience=None), 0.5)
    bsp_starts, bsp_applies = starts(bsp(), 0.5)
    gaps = [b["t"] - a["t"] for a, b in zip(ssp_starts[2:], ssp_starts[3:], strict=False)]
    assert gaps and all(g == pytest.approx(1.0) for g in gaps), gaps
    bsp_gaps = [b["t"] - a["t"] for a, b in zip(bsp_starts[2:], bsp_starts[3:], strict=False)]
    assert bsp_gaps and all(g == pytest.approx(1.5) for g in bsp_gaps), bsp_gaps
    assert ssp_applies[-1]["t"] < bsp_applies[-1]["t"] * 0.75


def test_without_delays_ssp_rounds_are_as_before():
    """No message delay: a push lands as its compute ends, so streaming changes nothing: a round a second."""
    streamed, applies = starts(ssp(1, stream=True), 0.0)
    gaps = [b["t"] - a["t"] for a, b in zip(streamed, streamed[1:], strict=False)]
    assert all(g == pytest.approx(1.0) for g in gaps), gaps
    assert len(applies) == ROUNDS


def test_ssp_reads_its_own_writes_unless_it_streams():
    """`stream` is SSP's choice, on by default (with patience 0.5): without it a late push holds the next round as
    under BSP."""
    assert ssp(1, stream=False).sent().streams is False and ssp(1).sent().streams is True  # type: ignore[union-attr]
    assert ssp(1).patience == 0.5
    own, _ = starts(ssp(1, stream=False), 0.5)
    gaps = [b["t"] - a["t"] for a, b in zip(own[2:], own[3:], strict=False)]
    assert gaps and all(g == pytest.approx(1.5) for g in gaps), gaps


def test_only_ssp_with_a_bound_may_stream():
    assert ssp(0).stream is False and ssp(0).patience is None  # bound 0 is BSP: nothing to stream
    with pytest.raises(ValueError, match="stream=True needs SSP"):
        replace(ssp(0), stream=True)


def test_with_patience_a_late_push_holds_the_next_round_that_long_at_most():
    """Every push 0.5 s late, compute 1 s, patience 0.25: a worker holds out 0.25 s for the version its push makes
    (it comes 0.5 s after its compute), then computes on the one its bound allows: rounds of 1.25 s, between
    streaming's 1 s and reading its own writes' 1.5 s, each of them a round stale."""
    held, _ = starts(ssp(1, stream=True, patience=0.25, usual=None), 0.5)
    gaps = [b["t"] - a["t"] for a, b in zip(held[2:], held[3:], strict=False)]
    assert gaps and all(g == pytest.approx(1.25) for g in gaps), gaps
    assert all(e["clock"] - e["version"] == 1 for e in held[2:]), held


def test_with_patience_the_workers_wait_for_a_slightly_slower_one_and_compute_fresh():
    """No message delay, worker 3 takes 1.2 s where the others take 1 s: streaming without patience computes every
    round of the fast workers a round stale; with patience 0.5 they hold out 0.2 s and every round is fresh."""
    stale, _ = starts(ssp(1, stream=True, patience=None), 0.0, OneSlow(WORKERS, 1.2))
    fresh, _ = starts(ssp(1, stream=True, patience=0.5), 0.0, OneSlow(WORKERS, 1.2))
    assert sum(e["clock"] - e["version"] for e in stale[1:]) >= len(stale) // 2, stale
    assert all(e["clock"] == e["version"] for e in fresh), fresh


def test_with_usual_a_lag_every_round_has_is_waited_for_and_every_round_is_fresh():
    """Every push 0.5 s late, compute 1 s, patience 0.25, `usual` 1.5 (ssp's default): the first holds give up
    (each counts as 0.5 s, twice the 0.25 s held); once `USUAL_FROM` waits are known it holds out 1.5 x 0.5 s, and
    from then on every round waits for the version its push makes: rounds of 1.5 s (compute, then the push's way),
    each fresh, where `usual=None` computes every round a round stale (the lag that made the Fashion-MNIST CNN
    diverge behind a slow link)."""
    held, _ = starts(ssp(1, stream=True, patience=0.25), 0.5)
    assert ssp(1).usual == 1.5
    learnt = USUAL_FROM + 1  # the starts before the first hold that counts the usual wait
    gaps = [b["t"] - a["t"] for a, b in zip(held[learnt:], held[learnt + 1 :], strict=False)]
    assert gaps and all(g == pytest.approx(1.5) for g in gaps), gaps
    assert all(e["clock"] == e["version"] for e in held[learnt:]), held
    stale, _ = starts(ssp(1, stream=True, patience=0.25, usual=None), 0.5)
    assert all(e["clock"] - e["version"] == 1 for e in stale[learnt:]), stale


def test_the_worker_the_rounds_wait_on_holds_out_patience_alone_and_the_others_stay_fresh():
    """Worker 3's pushes 0.5 s late (a host behind a slow link), compute 1 s, patience 0.25, `usual` 1.5: its push
    completes every round (`Stamp.closer`), so waiting the usual for the version it makes would add its push's way
    to every round (rounds of 1.5 s, as everyone waiting). Once it knows (`Worker.closes`), it holds out `patience`
    alone and computes on the version before, while the others wait for its push and compute every round fresh:
    rounds of 1.25 s, one worker's gradient a round stale instead of all of them (`usual=None`)."""
    late = OneSlow(WORKERS, 1.0, delay=0.5)
    fast, _ = starts(ssp(1, stream=True, patience=0.25), 0.0, late)
    slow = [e for e in _trace_of(ssp(1, stream=True, patience=0.25), late) if e["worker"] == WORKERS - 1]
    learnt = 2 * USUAL_FROM  # its first holds wait the usual, until it has seen that it completes the rounds
    for events in (fast, slow):
        gaps = [b["t"] - a["t"] for a, b in zip(events[learnt:], events[learnt + 1 :], strict=False)]
        assert gaps and all(g == pytest.approx(1.25) for g in gaps), gaps
    assert all(e["clock"] == e["version"] for e in fast[learnt:]), fast
    assert all(e["clock"] - e["version"] == 1 for e in slow[learnt:]), slow
    everyone, _ = starts(ssp(1, stream=True, patience=0.25, usual=None), 0.0, late)
    assert all(e["clock"] - e["version"] == 1 for e in everyone[learnt:]), everyone


def _trace_of(policy, stragglers: OneSlow) -> list[dict]:
    """Every worker's start events of a run under `stragglers`."""
    sim = Simulator(WORKERS, stragglers, seed=0)
    server = Server(torch.zeros(2), sgd(lr=0.1), policy, WORKERS, steps=ROUNDS, trace=sim.trace)
    sim.run(server, lambda params, worker, index: torch.ones(2))
    return sim.trace.of("start")


def test_an_unusual_lag_is_not_waited_for_longer_than_patience():
    """One push in twenty 3 s late, compute 1 s: the usual wait is none, so `usual` holds out no longer than
    `patience` alone on the late ones (a wait given up counts, but a few in `USUAL_OF` leave the median at 0): the
    same starts, at the same times and versions, as `usual=None`."""
    rare = Stragglers(delay_prob=0.05, delay=3.0)
    usual, _ = starts(ssp(1, stream=True, patience=0.5), 0.0, rare)
    alone, _ = starts(ssp(1, stream=True, patience=0.5, usual=None), 0.0, rare)
    assert [(e["t"], e["version"]) for e in usual] == [(e["t"], e["version"]) for e in alone]
    assert any(e["clock"] > e["version"] for e in usual), "no round went stale: the lag was never unusual"


def test_patience_is_for_streams_only():
    assert ssp(1, stream=False, patience=0.5).patience is None  # the factory drops it: nothing to hold out for
    with pytest.raises(ValueError, match="patience"):
        replace(ssp(1, stream=True), patience=-1.0)
    with pytest.raises(ValueError, match="patience"):
        replace(ssp(1, stream=False), patience=0.5)
    assert ssp(1, patience=None).usual is None and ssp(1, stream=False).usual is None  # nothing to hold out for
    with pytest.raises(ValueError, match="usual"):
        replace(ssp(1), usual=-1.0)
    with pytest.raises(ValueError, match="usual"):
        replace(ssp(1, patience=None), usual=1.5)
