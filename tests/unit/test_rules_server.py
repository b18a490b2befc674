"""Every rule through `collsync.server.Server`: equal to its base optimizer at staleness 0, lowering a convex
quadratic under stale asynchronous gradients, and built from its Hydra config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from collsync.policy import asynchronous
from collsync.rules import (
    Rule,
    adam,
    adam_ga,
    adam_sa,
    chain,
    combine,
    dana,
    fasgd,
    gap_aware,
    gradual_warmup,
    linear_scaling,
    momentum,
    nesterov,
    sgd,
    staleness_aware,
    staleness_aware_step,
)
from collsync.server import Server
from collsync.types import Arrival, Context

CONF = Path(__file__).resolve().parents[2] / "conf"
LAYERS = [(0, 2), (2, 5)]

Pair = tuple[Rule | None, Rule]

# (penalised pair, base pair): at staleness 0 and read == theta they must give identical parameters.
EQUIVALENT: dict[str, Callable[[], tuple[Pair, Pair]]] = {
    "SA-gradient/momentum": lambda: ((staleness_aware(), momentum(0.05)), (None, momentum(0.05))),
    "SA-step/nesterov": lambda: ((None, staleness_aware_step(nesterov(0.05))), (None, nesterov(0.05))),
    "GA/nesterov": lambda: ((gap_aware(eta_max=0.05), nesterov(0.05)), (None, nesterov(0.05))),
    "GA-layer/momentum": lambda: (
        (gap_aware(granularity="layer", layers=LAYERS), momentum(0.05)),
        (None, momentum(0.05)),
    ),
    "GA-global/sgd": lambda: ((gap_aware(granularity="global"), sgd(0.1)), (None, sgd(0.1))),
    "GA-weight-decay/momentum": lambda: (
        (gap_aware(weight_decay=0.01), momentum(0.05)),
        (None, momentum(0.05, weight_decay=0.01)),
    ),
    "Adam-SA": lambda: ((None, adam_sa(0.01)), (None, adam(0.01))),
    "Adam-GA": lambda: ((None, adam_ga(0.01)), (None, adam(0.01))),
    "DANA-SA": lambda: ((staleness_aware(), dana(0.05)), (None, dana(0.05))),
    "warmup-done/momentum": lambda: ((None, gradual_warmup(momentum(0.05), 0, 4)), (None, momentum(0.05))),
    "warmup-one-worker": lambda: ((None, gradual_warmup(momentum(0.05), 3, 1)), (None, momentum(0.05))),
    "linear-scaling-d=c": lambda: ((None, linear_scaling(momentum(0.05), 1)), (None, momentum(0.05))),
}


def one_worker(pair: Pair, grads: list[torch.Tensor]) -> torch.Tensor:
    """One asynchronous worker: every gradient has staleness 0 and was computed on the current theta."""
    penalty, optimizer = pair
    server = Server(torch.linspace(-1.0, 1.0, 5), optimizer, asynchronous(), 1, penalty=penalty)
    for g in grads:
        server.accept(Arrival(0, server.version, g))
    return server.params


@pytest.mark.parametrize("name", list(EQUIVALENT))
def test_every_penalty_at_staleness_zero_is_its_base_optimizer(name):
    grads = list(torch.randn(6, 5, generator=torch.Generator().manual_seed(1)))
    penalised, base = EQUIVALENT[name]()
    assert torch.equal(one_worker(penalised, grads), one_worker(base, grads))


def test_sa_at_staleness_one_and_dana_ga_with_read_theta_equal_their_base():
    # tau = 1 is not penalised (tau clamped to >= 1); DANA-GA's Gap is 1 where the read equals theta (through the
    # server a DANA worker reads the look-ahead, so this holds only for hand-made contexts).
    grads = list(torch.randn(4, 3, generator=torch.Generator().manual_seed(2)))
    params = torch.ones(3)
    for pen, opt, base, staleness in [
        (staleness_aware(), momentum(0.05), momentum(0.05), 1),
        (gap_aware(), dana(0.05), dana(0.05), 0),
    ]:
        rule = chain(pen, opt)
        s, b = rule.init(params), base.init(params)
        for k, g in enumerate(grads):
            c = Context(k, 0, staleness, 1, params.clone())
            d1, s = rule.update(g, s, params, c)
            d2, b = base.update(g, b, params, c)
            assert torch.equal(d1, d2)


CURVATURE = torch.tensor([1.0, 0.5, 2.0, 1.5, 1.0], dtype=torch.float64)
TARGET = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=torch.float64)


def loss(theta: torch.Tensor) -> float:
    return float(0.5 * (CURVATURE * (theta - TARGET) ** 2).sum())


def stale_run(pair: Pair, workers: int = 4, arrivals: int = 200) -> Server:
    """Round-robin workers: each computes a noisy gradient on the view it read, so every gradient after the first
    round is `workers - 1` updates stale."""
    penalty, optimizer = pair
    server = Server(torch.zeros(5, dtype=torch.float64), optimizer, asynchronous(), workers, penalty=penalty)
    noise = torch.Generator().manual_seed(0)
    reads = [(0, server.view().clone()) for _ in range(workers)]
    for k in range(arrivals):
        w = k % workers
        version, theta = reads[w]
        g = CURVATURE * (theta - TARGET) + 0.1 * torch.randn(5, generator=noise, dtype=torch.float64)
        server.accept(Arrival(w, version, g))
        reads[w] = (server.version, server.view().clone())
    return server


CONVERGING: dict[str, Callable[[], Pair]] = {
    "ASGD": lambda: (None, sgd(0.1)),
    "SA-gradient": lambda: (staleness_aware(), momentum(0.05)),
    "SA-step": lambda: combine(staleness_aware_step, momentum(0.05)),
    "SASGD": lambda: (staleness_aware(), sgd(0.1)),
    "GA": lambda: (gap_aware(eta_max=0.05), nesterov(0.05)),
    "GA-layer": lambda: (gap_aware(eta_max=0.05, granularity="layer", layers=LAYERS), nesterov(0.05)),
    "GA-global": lambda: (gap_aware(eta_max=0.05, granularity="global"), nesterov(0.05)),
    "DANA": lambda: (None, dana(0.05)),
    "DANA-SA": lambda: (staleness_aware(), dana(0.05)),
    "DANA-GA": lambda: (gap_aware(eta_max=0.05), dana(0.05)),
    "Adam-SA": lambda: (None, adam_sa(0.05)),
    "Adam-GA": lambda: (None, adam_ga(0.05)),
    # eq. 7 scales the step by about std(g) * g, so alpha depends on the gradients' size (O(1) here).
    "FASGD": lambda: (None, fasgd(0.1)),
    # Warm-up does not mitigate staleness (NAG-ASGD alone diverges here), so it wraps a penalised NAG.
    "SA+warmup/nesterov": lambda: (staleness_aware(), gradual_warmup(nesterov(0.05), warmup=20, workers=4)),
    "linear-scaling": lambda: (None, linear_scaling(sgd(0.1), c=1)),
}


@pytest.mark.parametrize("name", list(CONVERGING))
def test_every_rule_lowers_a_quadratic_under_stale_gradients(name):
    start = loss(torch.zeros(5, dtype=torch.float64))
    server = stale_run(CONVERGING[name]())
    assert server.version == 200
    assert loss(server.params) < 0.1 * start


PENALTIES = sorted(p.stem for p in (CONF / "penalty").glob("*.yaml"))
# An option with a defaults list pairs another optimizer with a penalty (dana_ga_round, async's default): not a rule
# of its own (tests/unit/test_async_default.py composes it).
PAIRS = {p.stem for p in (CONF / "optimizer").glob("*.yaml") if "defaults" in OmegaConf.load(p)}
OPTIMIZERS = sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml") if p.stem not in PAIRS)


def test_the_configs_cover_every_rule():
    assert {"none", "staleness_aware", "staleness_aware_step", "gap_aware"} <= set(PENALTIES)
    assert {"sgd", "momentum", "nesterov", "rmsprop", "adam", "dana", "adam_sa", "adam_ga", "fasgd"} <= set(OPTIMIZERS)
    assert PAIRS == {"dana_ga_round"}


@pytest.mark.parametrize("penalty", PENALTIES)
def test_every_penalty_config_instantiates_with_every_optimizer_config(penalty):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfgs = [compose(overrides=[f"+penalty={penalty}", f"+optimizer={opt}"]) for opt in OPTIMIZERS]
    for cfg in cfgs:
        pen, opt = combine(instantiate(cfg.penalty), instantiate(cfg.optimizer))
        assert isinstance(pen, Rule) and isinstance(opt, Rule)
        server = Server(torch.zeros(3), opt, asynchronous(), 2, penalty=pen)
        for k in range(4):
            server.accept(Arrival(k % 2, max(server.version - 1, 0), torch.full((3,), 0.5)))
        assert server.version == 4 and torch.isfinite(server.params).all()
        if penalty.startswith("gap_aware"):  # eta_max and gamma follow the optimizer (Alg. 14: eta_max = eta_1)
            assert cfg.penalty.eta_max == cfg.optimizer.lr
            assert cfg.penalty.momentum == cfg.optimizer.get("momentum", 0.0)


@pytest.mark.parametrize(
    "path", sorted((CONF / "penalty").glob("*.yaml")) + [CONF / "optimizer" / f"{o}.yaml" for o in OPTIMIZERS]
)
def test_each_config_file_instantiates_alone(path):
    # Keys named as the factory's kwargs; interpolations fall back to defaults outside a full config.
    obj = instantiate(OmegaConf.load(path))
    assert isinstance(obj, Rule) or isinstance(combine(obj, sgd())[1], Rule)
