"""Straggler models: moments of the CVB gamma draws (001_... App. C.3), rare delays (003_...), frozen workers,
order-free seeded draws, validation."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from collsync import stragglers
from collsync.stragglers import (
    Stragglers,
    frozen_worker,
    gamma_heterogeneous,
    gamma_homogeneous,
    none,
    order_statistic_mean,
    rare_delays,
)

CONF = Path(__file__).resolve().parents[2] / "conf"


def _cv(x: np.ndarray) -> float:
    return float(x.std() / x.mean())


def test_constant_model():
    sampler = none(mean=2.5).sampler(3, seed=0)
    assert {sampler.compute_time(w, i) for w in range(3) for i in range(500)} == {2.5}
    assert sampler.message_delay(1, 7) == 0.0 and sampler.machine_means == [2.5] * 3
    # v_task / v_mach mean nothing for constant compute: zeros must not break it.
    assert Stragglers("constant", v_task=0.0, v_mach=0.0).sampler(2, 0).compute_time(1, 3) == 1.0


def test_homogeneous_alg12_moments():
    # q ~ G(1/v_task^2, mean v_task^2) once per run: over many seeds its mean is `mean` and its spread v_task.
    qs = np.array([gamma_homogeneous(mean=2.0, v_task=0.1).sampler(1, seed=s).machine_means[0] for s in range(400)])
    assert abs(qs.mean() - 2.0) < 0.03 and 0.08 < _cv(qs) < 0.12
    # Within a run every machine has mean q and batches spread with v_mach.
    sampler = gamma_homogeneous(mean=2.0, v_task=0.1, v_mach=0.2).sampler(4, seed=0)
    q = sampler.machine_means[0]
    assert sampler.machine_means == [q] * 4
    draws = np.array([[sampler.compute_time(w, i) for i in range(3000)] for w in range(4)])
    assert np.all(np.abs(draws.mean(1) / q - 1) < 0.02)
    assert abs(_cv(draws.ravel()) - 0.2) < 0.01


def test_heterogeneous_alg13_machine_means_spread_with_v_mach():
    sampler = gamma_heterogeneous(mean=1.0, v_mach=0.6, v_task=0.1).sampler(600, seed=1)
    means = np.array(sampler.machine_means)
    assert abs(means.mean() - 1.0) < 0.1
    assert abs(_cv(means) - 0.6) < 0.1
    assert means.max() / means.min() > 5  # some machines are slow all the time
    # Each machine's batches scatter around its own p[j] with v_task.
    for w in (int(means.argmin()), int(means.argmax())):
        draws = np.array([sampler.compute_time(w, i) for i in range(2000)])
        assert abs(draws.mean() / means[w] - 1) < 0.02 and abs(_cv(draws) - 0.1) < 0.01
    # A homogeneous model with the same V's has no such spread between machines.
    assert len(set(gamma_homogeneous(v_mach=0.6).sampler(50, seed=1).machine_means)) == 1


@pytest.mark.parametrize("model", [gamma_homogeneous(), gamma_heterogeneous(), rare_delays(delay_prob=0.3)])
def test_draws_are_pure_functions_of_seed_worker_index(model):
    a = model.sampler(8, seed=11)
    forward = [(a.compute_time(w, i), a.message_delay(w, i)) for w in range(8) for i in range(600)]
    b = model.sampler(8, seed=11)
    order = np.random.default_rng(0).permutation(8 * 600)
    shuffled = {
        int(k): (b.compute_time(int(k) // 600, int(k) % 600), b.message_delay(int(k) // 600, int(k) % 600))
        for k in order
    }
    assert forward == [shuffled[k] for k in range(8 * 600)]
    # Worker w's numbers do not depend on how many workers there are, nor on the global RNG.
    np.random.seed(123)
    state = np.random.get_state()[1].copy()
    c = model.sampler(3, seed=11)
    assert [c.compute_time(2, i) for i in range(600)] == [x for x, _ in forward[2 * 600 : 3 * 600]]
    assert np.array_equal(np.random.get_state()[1], state)
    # A different seed gives different numbers; different workers get different streams.
    d = model.sampler(8, seed=12)
    assert [d.compute_time(0, i) + d.message_delay(0, i) for i in range(600)] != [sum(x) for x in forward[:600]]
    assert forward[:600] != forward[600:1200]


def test_rare_delays_frequency():
    sampler = rare_delays(delay_prob=0.01, delay=4.0).sampler(2, seed=0)
    delays = np.array([sampler.message_delay(w, i) for w in range(2) for i in range(20_000)])
    assert set(delays.tolist()) == {0.0, 4.0}
    assert 320 < (delays == 4.0).sum() < 480  # 400 expected, sd 20
    paper = rare_delays().sampler(4, seed=1)  # 003_...: 0.16% of messages, 4 s
    late = sum(paper.message_delay(w, i) == 4.0 for w in range(4) for i in range(25_000))
    assert 110 < late < 210  # 160 expected, sd 13
    assert all(paper.compute_time(0, i) == 1.0 for i in range(100))


def test_frozen_worker():
    sampler = frozen_worker(worker=2, at=5.0).sampler(4, seed=0)
    assert not sampler.is_frozen(2, 4.99) and sampler.is_frozen(2, 5.0) and sampler.is_frozen(2, 1e9)
    assert not any(sampler.is_frozen(w, 1e9) for w in (0, 1, 3))
    combined = Stragglers("gamma_heterogeneous", v_mach=0.6, delay_prob=0.5, delay=1.0, worker=[0, 3], at=2.0)
    assert combined.worker == (0, 3) and combined.frozen == (0, 3) and hash(combined)  # a Hydra list: a tuple
    assert combined.sampler(4, seed=0).is_frozen(3, 2.0)
    with pytest.raises(ValueError, match=r"worker=2 names worker\(s\) \[2\] outside 0\.\.1"):
        frozen_worker(worker=2).sampler(2, seed=0)


def test_order_statistic_mean():
    sampler = gamma_heterogeneous().sampler(8, seed=2)
    ks = [order_statistic_mean(sampler, 8, k, 200) for k in range(1, 9)]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    times = np.array([[sampler.compute_time(w, r) for w in range(8)] for r in range(200)])
    assert ks[-1] == pytest.approx(times.max(1).mean()) and ks[0] == pytest.approx(times.min(1).mean())
    assert order_statistic_mean(none(mean=3.0).sampler(4, 0), 4, 2, 10) == 3.0
    with pytest.raises(ValueError, match=r"k=9 must be in 1\.\.8"):
        order_statistic_mean(sampler, 8, 9, 10)
    with pytest.raises(ValueError, match=r"workers=9 must be in 1\.\.8"):
        order_statistic_mean(sampler, 9, 1, 10)
    with pytest.raises(ValueError, match="rounds=0 must be >= 1"):
        order_statistic_mean(sampler, 8, 1, 0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Stragglers(compute="weird"), "compute='weird' must be one of"),
        (lambda: Stragglers(mean=0.0), "mean=0.0 must be > 0"),
        (lambda: gamma_homogeneous(v_task=0.0), "v_task=0.0 must be > 0"),
        (lambda: gamma_heterogeneous(v_mach=-0.1), "v_mach=-0.1 must be > 0"),
        (lambda: Stragglers(delay_prob=1.5), r"delay_prob=1\.5 must be in \[0, 1\]"),
        (lambda: rare_delays(delay=-4.0), "delay=-4.0 must be >= 0"),
        (lambda: Stragglers(slow_server=float("nan")), "slow_server=nan must be >= 0"),
        (lambda: frozen_worker(worker=-1), r"worker=-1 must name workers by index >= 0"),
        (lambda: frozen_worker(at=-1.0), "at=-1.0 must be >= 0"),
        (lambda: none().sampler(0, seed=0), "workers=0 must be >= 1"),
        (lambda: none().sampler(2, seed=-1), "seed=-1 must be >= 0"),
        (lambda: none().sampler(2, seed=0).compute_time(2, 0), r"worker=2 outside 0\.\.1"),
        (lambda: rare_delays().sampler(2, seed=0).message_delay(0, -1), "index=-1 must be >= 0"),
    ],
)
def test_bad_values_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("option", ["none", "gamma_homogeneous", "gamma_heterogeneous", "rare_delays", "frozen_worker"])
def test_straggler_configs_name_the_factory_kwargs(option):
    cfg = OmegaConf.load(CONF / "stragglers" / f"{option}.yaml")
    factory = getattr(stragglers, option)
    assert cfg._target_ == f"collsync.stragglers.{option}"
    params = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "_target_"}
    assert all(params[k].default == v for k, v in kwargs.items())
    assert instantiate(cfg) == factory()
