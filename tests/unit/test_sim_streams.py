"""The simulator's model of streamed versions (`policy.Sent.streams`, issue 33): under SSP a worker whose push is
late on the network starts its next round once its compute is done, on a version its bound allows, as the MPI
servers' deliveries let it (`ssp(stream=True)`); under BSP, and SSP by default, it reads its own writes, so the late
push holds its next round."""

from __future__ import annotations

import pytest
import torch

from collsync.policy import bsp, ssp
from collsync.rules import sgd
from collsync.server import Server
from collsync.sim import Simulator
from collsync.stragglers import Stragglers

WORKERS, ROUNDS = 4, 30


def starts(policy, delay: float) -> tuple[list[dict], list[dict]]:
    """(worker 0's start events, the applies) of a run where every push is `delay` seconds late (compute 1 s)."""
    stragglers = Stragglers(delay_prob=1.0 if delay else 0.0, delay=delay)
    sim = Simulator(WORKERS, stragglers, seed=0)
    server = Server(torch.zeros(2), sgd(lr=0.1), policy, WORKERS, steps=ROUNDS, trace=sim.trace)
    sim.run(server, lambda params, worker, index: torch.ones(2))
    return [e for e in sim.trace.of("start") if e["worker"] == 0], sim.trace.of("apply")


def test_ssp_computes_on_while_its_push_is_on_its_way():
    """Every push 0.5 s late, compute 1 s: SSP (bound 1) starts each round when the last one's compute is done (a
    second apart), so its rounds take 1 s where BSP's take 1.5 s (compute, then the push's way)."""
    ssp_starts, ssp_applies = starts(ssp(1, stream=True), 0.5)
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
    """`stream` is SSP's choice, off by default: without it a late push holds the next round as under BSP."""
    assert ssp(1).sent().streams is False and ssp(1, stream=True).sent().streams is True  # type: ignore[union-attr]
    own, _ = starts(ssp(1), 0.5)
    gaps = [b["t"] - a["t"] for a, b in zip(own[2:], own[3:], strict=False)]
    assert gaps and all(g == pytest.approx(1.5) for g in gaps), gaps


def test_only_ssp_with_a_bound_may_stream():
    with pytest.raises(ValueError, match="stream=True needs SSP"):
        ssp(0, stream=True)
