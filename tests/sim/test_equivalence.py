"""The equivalences DESIGN.md requires of the simulator, checked bit for bit where the summation order is fixed."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from collsync.checks import check_trace
from collsync.cli import CONF_DIR
from collsync.data import Batches
from collsync.loops import Gradients
from collsync.metrics import summary
from collsync.policy import asynchronous, backup, bsp, ssp
from collsync.rules import combine, fasgd, momentum
from collsync.server import Server
from collsync.sim import Deadlock
from collsync.stragglers import Stragglers, gamma_heterogeneous
from collsync.types import Arrival, Context

from .helpers import DATA, flat_model, simulate

HETERO = gamma_heterogeneous(mean=1.0, v_mach=0.6, v_task=0.1)


@pytest.mark.parametrize("policy", [bsp(), backup(2), asynchronous(), ssp(2)], ids=lambda p: p.name)
def test_same_seed_same_bits(policy):
    a, sim_a = simulate(policy, 6, stragglers=HETERO, seed=3)
    b, sim_b = simulate(policy, 6, stragglers=HETERO, seed=3)
    assert torch.equal(a.params, b.params)
    assert torch.equal(a.ema, b.ema)
    assert sim_a.trace.events == sim_b.trace.events
    c, _ = simulate(policy, 6, stragglers=HETERO, seed=4)
    assert not torch.equal(a.params, c.params)


def test_async_one_worker_is_sequential_sgd():
    rule = momentum(lr=0.05, momentum=0.9)
    server, _ = simulate(asynchronous(), 1, steps=25, optimizer=rule, stragglers=HETERO)
    flat = flat_model(0)
    grads = Gradients(flat, Batches(DATA, 1, 8, 0))
    params = flat.params.clone()
    state = rule.init(params)
    for step in range(25):
        g = grads(params, 0, step)
        delta, state = rule.update(g, state, params, Context(step=step, worker=0, staleness=0))
        params = params + delta
    assert torch.equal(server.params, params)
    assert server.dropped == 0


def test_backup_with_no_backups_is_bsp():
    a, sim_a = simulate(bsp(), 5, stragglers=HETERO)
    b, sim_b = simulate(backup(0), 5, stragglers=HETERO)
    assert torch.equal(a.params, b.params)
    assert sim_a.trace.of("apply") == sim_b.trace.of("apply")


def test_ssp_with_zero_lead_is_bsp():
    a, sim_a = simulate(bsp(), 5, stragglers=HETERO)
    b, sim_b = simulate(ssp(0), 5, stragglers=HETERO)
    assert torch.equal(a.params, b.params)
    assert sim_a.trace.of("apply") == sim_b.trace.of("apply")


def test_bsp_n_workers_equals_one_worker_with_n_times_the_batch():
    a, _ = simulate(bsp(), 4, batch_size=5, steps=20)
    b, _ = simulate(bsp(), 1, batch_size=20, steps=20)
    torch.testing.assert_close(a.params, b.params, rtol=1e-5, atol=1e-6)
    assert not torch.equal(a.params, flat_model(0).params)


def test_backup_rounds_take_exactly_n_and_settle_every_gradient():
    server, sim = simulate(backup(2), 8, steps=40, stragglers=HETERO)
    applies = sim.trace.of("apply")
    assert len(applies) == 40
    assert all(len(e["workers"]) == 6 for e in applies)
    assert all(set(e["clocks"]) == {e["version"] - 1} for e in applies)
    counts = check_trace(sim.trace, backup(2), 8)
    assert counts["pushed"] == counts["applied"] + counts["dropped"]
    assert counts["dropped"] > 0
    # Heterogeneous machines: the slowest ones are the ones dropped most.
    means = HETERO.sampler(8, 0).machine_means
    drops = [sum(1 for e in sim.trace.of("drop") if e["worker"] == w) for w in range(8)]
    assert drops[max(range(8), key=means.__getitem__)] >= drops[min(range(8), key=means.__getitem__)]


@pytest.mark.parametrize("usual", [1.5, None])
@pytest.mark.parametrize("lead", [1, 3])
def test_ssp_never_leads_the_slowest_by_more_than_s(lead, usual):
    """The bound holds with ssp's default hold (`usual`, which waits for a lag every round has: heterogeneous
    machines have one, so the leaders wait more) and without it, where the fast workers use all the slack."""
    policy = ssp(lead, usual=usual)
    _, sim = simulate(policy, 6, steps=40, stragglers=HETERO)
    check_trace(sim.trace, policy, 6)
    # The round each worker is on = one past the last round it pushed; a start may lead the slowest by s.
    working = [0] * 6
    worst = 0
    for e in sim.trace.events:
        if e["ev"] == "push":
            working[e["worker"]] = max(working[e["worker"]], e["clock"] + 1)
        elif e["ev"] == "start":
            worst = max(worst, e["clock"] - min(working))
    assert worst <= lead
    if usual is None:
        assert worst == lead  # heterogeneous workers do use the slack
    else:
        assert worst >= 1  # and still lead where a lag is not the usual one


def test_frozen_worker_backup_trains_and_bsp_reports_it():
    frozen = Stragglers(compute="constant", worker=2, at=3.5)
    server, sim = simulate(backup(1), 4, steps=20, stragglers=frozen)
    assert server.version == 20
    assert all(2 not in e["workers"] for e in sim.trace.of("apply")[4:])
    with pytest.raises(Deadlock, match=r"frozen worker\(s\) \[2\]"):
        simulate(bsp(), 4, steps=20, stragglers=frozen)


def test_bfasgd_transmits_less_as_c_grows_and_settles_every_push():

    ratios = []
    for c in (0.0, 3000.0):
        policy = asynchronous(c_push=c, c_fetch=c)
        _, sim = simulate(policy, 4, steps=60, optimizer=fasgd(lr=10.0), stragglers=HETERO)
        check_trace(sim.trace, policy, 4)
        s = summary(sim.trace)
        ratios.append((s["push_ratio"], s["fetch_ratio"]))
    assert ratios[0] == (1.0, 1.0)
    assert ratios[1][0] < 0.9 and ratios[1][1] < 0.9


METHODS = [
    "asgd",
    "nag_asgd",
    "sa",
    "sa_step",
    "sasgd",
    "ga",
    "dana",
    "dana_sa",
    "dana_ga",
    "adam",
    "adam_sa",
    "adam_ga",
    "fasgd",
]


@pytest.mark.parametrize("method", METHODS)
def test_every_async_method_with_one_worker_is_sequential_training(method):
    """One asynchronous worker never sees a stale gradient: the simulated run equals feeding the server by hand,
    gradient after gradient, each computed on the parameters it just published."""

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"method={method}", "sync=async"])
    build = lambda: combine(instantiate(cfg.penalty), instantiate(cfg.optimizer))  # noqa: E731
    penalty, optimizer = build()
    simulated, _ = simulate(asynchronous(), 1, steps=15, optimizer=optimizer, penalty=penalty, stragglers=HETERO)

    penalty, optimizer = build()
    flat = flat_model(0)
    grads = Gradients(flat, Batches(DATA, 1, 8, 0))
    by_hand = Server(flat.params, optimizer, asynchronous(), 1, penalty=penalty, steps=15, ema_decay=0.9)
    for j in range(15):
        by_hand.accept(Arrival(0, by_hand.version, grads(by_hand.view(), 0, j), by_hand.version))
    assert torch.equal(simulated.params, by_hand.params)
    assert all(s == 0 for e in _.trace.of("apply") for s in e["staleness"])
