"""Seeded straggler models shared by the simulator and real runs.

Compute times follow the CVB method of 001_... App. C.3 (alpha = 1 / V^2, G(shape, scale) a gamma draw, so
G(alpha, mu / alpha) has mean mu and coefficient of variation V):

* homogeneous (Alg. 12): q = G(a_task, mu / a_task), drawn once per run; every batch of every machine takes
  G(a_mach, q / a_mach): the same mean on every machine, but any batch can be slow.
* heterogeneous (Alg. 13): machine j gets its own mean p[j] = G(a_mach, mu / a_mach); its batches take
  G(a_task, p[j] / a_task): some machines are slow all the time (V_mach = 0.6 in the paper).

Message delays: with probability `delay_prob` a gradient's message is late by `delay` seconds (003_...: 0.16% of
pulls delayed by 4 s). Frozen workers (`worker`) stop at time `at` and never send again. `slow_server` is extra
seconds the server of shard `shard` spends on each update before its workers see it (a slow parameter server, 003_...):
the simulator holds its server busy that long, real runs with injected stragglers sleep it (times the time scale).

Every draw is a pure function of (seed, worker, index): numpy generators seeded with [seed, stream, worker, block]
draw blocks of 256 values, cached. So simulated and real runs see the same numbers whatever order they ask in,
however many workers exist, and no global RNG is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

_KINDS = ("constant", "gamma_homogeneous", "gamma_heterogeneous")
_BLOCK = 256
# The largest seconds a batch, a message delay or a slow update may take (about 32 years): the simulated clock adds
# them up over every step, and 1e308 would overflow it to infinity (no JSON number) within two steps.
MAX_SECONDS = 1e9
# The coefficients of variation the gamma draws take (the paper's are 0.1 and 0.6).
_MIN_CV, _MAX_CV = 1e-6, 100.0
# Stream tags: fixed forever, since they decide every number a seeded run sees.
_COMPUTE, _DELAY, _HOMO_Q, _HETERO_P = 1, 2, 0xC0FFEE, 0xBEEF


@dataclass(frozen=True)
class Stragglers:
    """A straggler model's parameters; `sampler(workers, seed)` draws from it.

    `compute` is "constant" (every batch takes `mean` seconds), "gamma_homogeneous" (Alg. 12) or
    "gamma_heterogeneous" (Alg. 13); `v_task` and `v_mach` are the CVB coefficients of variation (used by the gamma
    kinds only). The other fields combine freely with any compute model. Each field is named as the config key
    that sets it (`stragglers.worker`, `stragglers.at`, `stragglers.shard`, ...); `worker` is the frozen worker (an
    int) or several of them (a sequence), None for none.
    """

    compute: str = "constant"
    mean: float = 1.0
    v_task: float = 0.1
    v_mach: float = 0.1
    delay_prob: float = 0.0
    delay: float = 0.0
    worker: int | tuple[int, ...] | None = None
    at: float = 0.0
    slow_server: float = 0.0
    shard: int = 0

    def __post_init__(self) -> None:
        # Hydra hands over a ListConfig; keep a tuple so the dataclass stays hashable.
        w = self.worker
        object.__setattr__(self, "worker", None if w is None else int(w) if isinstance(w, int) else tuple(map(int, w)))
        if self.compute not in _KINDS:
            raise ValueError(f"stragglers: compute={self.compute!r} must be one of {', '.join(_KINDS)}")
        if not (self.mean > 0 and math.isfinite(self.mean)):
            raise ValueError(f"stragglers: mean={self.mean} must be > 0 seconds")
        for key in ("mean", "delay", "slow_server"):
            if getattr(self, key) > MAX_SECONDS:
                raise ValueError(
                    f"stragglers: {key}={getattr(self, key)} must be <= {MAX_SECONDS:g} seconds (the simulated clock "
                    f"adds up every step's times)"
                )
        if self.compute != "constant":
            for key in ("v_task", "v_mach"):
                value = getattr(self, key)
                if not (value > 0 and math.isfinite(value)):
                    raise ValueError(f"stragglers: {key}={value} must be > 0 for compute={self.compute!r}")
                if not _MIN_CV <= value <= _MAX_CV:  # the gamma shape 1/v^2 would under- or overflow
                    raise ValueError(f"stragglers: {key}={value} must be in [{_MIN_CV:g}, {_MAX_CV:g}]")
        if not 0.0 <= self.delay_prob <= 1.0:
            raise ValueError(f"stragglers: delay_prob={self.delay_prob} must be in [0, 1]")
        for key in ("delay", "at", "slow_server"):
            value = getattr(self, key)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"stragglers: {key}={value} must be >= 0 seconds")
        if self.shard < 0:
            raise ValueError(f"stragglers: shard={self.shard} must be a shard index >= 0")
        if any(w < 0 for w in self.frozen):
            raise ValueError(f"stragglers: worker={self.worker} must name workers by index >= 0")

    @property
    def frozen(self) -> tuple[int, ...]:
        """The workers that freeze at time `at` (from `worker`)."""
        w = self.worker
        return () if w is None else (w,) if isinstance(w, int) else w

    def sampler(self, workers: int, seed: int) -> StragglerSampler:
        """Draws of this model for `workers` workers under `seed`."""
        return StragglerSampler(self, workers, seed)


class StragglerSampler:
    """Draws of one model for `workers` workers under one seed; each worker has its own streams.

    `machine_means[w]` is worker w's mean batch time: p[w] under Alg. 13, q under Alg. 12, `mean` when constant.
    """

    def __init__(self, model: Stragglers, workers: int, seed: int) -> None:
        if workers < 1:
            raise ValueError(f"stragglers: {workers=} must be >= 1")
        if seed < 0:
            raise ValueError(f"stragglers: {seed=} must be >= 0 (it seeds numpy's SeedSequence)")
        outside = [w for w in model.frozen if w >= workers]
        if outside:
            raise ValueError(f"stragglers: worker={model.worker} names worker(s) {outside} outside 0..{workers - 1}")
        self.model, self.workers, self.seed = model, workers, seed
        m = model
        self._shape = np.ones(workers)
        self._scale = np.full(workers, m.mean)
        if m.compute == "gamma_homogeneous":
            a_task, a_mach = 1.0 / m.v_task**2, 1.0 / m.v_mach**2
            q = np.random.default_rng([seed, _HOMO_Q]).gamma(a_task, m.mean / a_task)
            self._shape[:], self._scale[:] = a_mach, q / a_mach
        elif m.compute == "gamma_heterogeneous":
            a_task, a_mach = 1.0 / m.v_task**2, 1.0 / m.v_mach**2
            # p[w] from worker w's own stream: the same machine is as slow whatever `workers` is.
            p = np.array(
                [np.random.default_rng([seed, _HETERO_P, w]).gamma(a_mach, m.mean / a_mach) for w in range(workers)]
            )
            self._shape[:], self._scale[:] = a_task, p / a_task
        self.machine_means: list[float] = (self._shape * self._scale).tolist()
        self._compute: dict[tuple[int, int], np.ndarray] = {}
        self._delays: dict[tuple[int, int], np.ndarray] = {}

    def _check(self, worker: int, index: int) -> None:
        if not 0 <= worker < self.workers:
            raise ValueError(f"stragglers: {worker=} outside 0..{self.workers - 1}")
        if index < 0:
            raise ValueError(f"stragglers: {index=} must be >= 0")

    def _block(self, cache: dict[tuple[int, int], np.ndarray], tag: int, worker: int, index: int) -> np.ndarray:
        key = (worker, index // _BLOCK)
        block = cache.get(key)
        if block is None:
            rng = np.random.default_rng([self.seed, tag, worker, key[1]])
            if tag == _COMPUTE:
                if self.model.compute == "constant":
                    block = np.full(_BLOCK, self.model.mean)
                else:
                    block = rng.gamma(self._shape[worker], self._scale[worker], size=_BLOCK)
            else:
                late = rng.random(_BLOCK) < self.model.delay_prob
                block = np.where(late, self.model.delay, 0.0)
            cache[key] = block
        return block

    def compute_time(self, worker: int, index: int) -> float:
        """Seconds worker `worker` spends on its `index`-th batch."""
        self._check(worker, index)
        if self.model.compute == "constant":
            return float(self.model.mean)
        return float(self._block(self._compute, _COMPUTE, worker, index)[index % _BLOCK])

    def message_delay(self, worker: int, index: int) -> float:
        """Extra seconds the message carrying that batch's gradient is late: `delay` with probability `delay_prob`."""
        self._check(worker, index)
        if self.model.delay_prob == 0.0:
            return 0.0
        return float(self._block(self._delays, _DELAY, worker, index)[index % _BLOCK])

    def is_frozen(self, worker: int, t: float) -> bool:
        """Has `worker` stopped for good by time `t` (seconds since the start)?"""
        return worker in self.model.frozen and t >= self.model.at


def order_statistic_mean(sampler: StragglerSampler, workers: int, k: int, rounds: int) -> float:
    """Mean over rounds r < `rounds` of the k-th smallest of compute_time(w, r), w < `workers`.

    The ideal round time of synchronous training with quorum k (000_...: N + b backup workers, k = N): the round
    ends when the k-th gradient arrives. k = workers gives plain BSP.
    """
    if not 1 <= workers <= sampler.workers:
        raise ValueError(f"stragglers: {workers=} must be in 1..{sampler.workers} (the sampler's workers)")
    if not 1 <= k <= workers:
        raise ValueError(f"stragglers: {k=} must be in 1..{workers}")
    if rounds < 1:
        raise ValueError(f"stragglers: {rounds=} must be >= 1")
    times = np.array([[sampler.compute_time(w, r) for w in range(workers)] for r in range(rounds)])
    return float(np.sort(times, axis=1)[:, k - 1].mean())


def none(mean: float = 1.0) -> Stragglers:
    """Every batch takes `mean` seconds; no delays."""
    return Stragglers("constant", mean=mean)


def gamma_homogeneous(mean: float = 1.0, v_task: float = 0.1, v_mach: float = 0.1) -> Stragglers:
    """001_... Alg. 12: one q ~ G(1/v_task^2, mean v_task^2) per run; every batch takes G(1/v_mach^2, q v_mach^2)."""
    return Stragglers("gamma_homogeneous", mean=mean, v_task=v_task, v_mach=v_mach)


def gamma_heterogeneous(mean: float = 1.0, v_mach: float = 0.6, v_task: float = 0.1) -> Stragglers:
    """001_... Alg. 13: machine means p[j] ~ G(1/v_mach^2, mean v_mach^2); batches take G(1/v_task^2, p[j] v_task^2)."""
    return Stragglers("gamma_heterogeneous", mean=mean, v_task=v_task, v_mach=v_mach)


def rare_delays(mean: float = 1.0, delay_prob: float = 0.0016, delay: float = 4.0) -> Stragglers:
    """003_... §4.2: constant compute, but 0.16% of messages arrive 4 s late."""
    return Stragglers("constant", mean=mean, delay_prob=delay_prob, delay=delay)


def frozen_worker(worker: int = 0, at: float = 10.0, mean: float = 1.0) -> Stragglers:
    """Worker `worker` stops for good at time `at` seconds (a hung or SIGSTOPped rank)."""
    return Stragglers("constant", mean=mean, worker=worker, at=at)


def slow_server(seconds: float = 1.0, shard: int = 0, mean: float = 1.0) -> Stragglers:
    """A slow parameter server (003_...): the server of shard `shard` spends `seconds` more on every update before
    its workers see it; every batch takes `mean` seconds."""
    return Stragglers("constant", mean=mean, slow_server=seconds, shard=shard)


class OneSlow:
    """A deterministic straggler model for the simulator: the last of `workers` takes `factor` model seconds a batch,
    the others 1, and its pushes come `delay` seconds late (a host behind a slow link; the others' none); nobody is
    frozen. The three-front agreement test and `benchmarks/backup_batches.py` use it where a sleep on the MPI side
    must match the simulated clock."""

    class model:  # noqa: N801 - the attribute the simulator reads of a straggler model
        slow_server = 0.0

    def __init__(self, workers: int, factor: float, delay: float = 0.0) -> None:
        self.last, self.factor, self.delay = workers - 1, factor, delay

    def sampler(self, workers: int, seed: int) -> Any:
        return self

    def compute_time(self, worker: int, index: int) -> float:
        return self.factor if worker == self.last else 1.0

    def message_delay(self, worker: int, index: int) -> float:
        return self.delay if worker == self.last else 0.0

    def is_frozen(self, worker: int, now: float) -> bool:
        return False
