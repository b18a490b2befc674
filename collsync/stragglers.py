"""Seeded straggler models shared by the simulator and real runs.

Compute times follow the CVB method of 001_... App. C.3 (alpha = 1 / V^2, G(shape, scale) a gamma draw):

* homogeneous (Alg. 12): q = G(a_task, mu / a_task); every batch takes G(a_mach, q / a_mach): the same mean on
  every machine, but any batch can be slow.
* heterogeneous (Alg. 13): machine j gets its own mean p[j] = G(a_mach, mu / a_mach); its batches take
  G(a_task, p[j] / a_task): some machines are slow all the time.

Message delays: with probability `delay_prob` a message is late by `delay` seconds (003_...: 0.16% of pulls
delayed by 4 s). Frozen workers stop at `frozen_at` and never send again.

Every draw is a pure function of (seed, worker, index), so simulated and real runs see the same numbers whatever
order they are asked in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_KINDS = ("constant", "gamma_homogeneous", "gamma_heterogeneous")
_BLOCK = 256


@dataclass(frozen=True)
class Stragglers:
    """A straggler model's parameters; `sampler(workers, seed)` draws from it."""

    compute: str = "constant"
    mean: float = 1.0
    v_task: float = 0.1
    v_mach: float = 0.1
    delay_prob: float = 0.0
    delay: float = 0.0
    frozen: tuple[int, ...] = field(default_factory=tuple)
    frozen_at: float = 0.0
    slow_server: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "frozen", tuple(int(w) for w in self.frozen))
        if self.compute not in _KINDS:
            raise ValueError(f"stragglers: compute={self.compute!r} must be one of {', '.join(_KINDS)}")
        if not self.mean > 0:
            raise ValueError(f"stragglers: mean={self.mean} must be > 0 seconds")
        if self.compute != "constant":
            for key in ("v_task", "v_mach"):
                if not getattr(self, key) > 0:
                    raise ValueError(f"stragglers: {key}={getattr(self, key)} must be > 0")
        if not 0.0 <= self.delay_prob <= 1.0:
            raise ValueError(f"stragglers: delay_prob={self.delay_prob} must be in [0, 1]")
        for key in ("delay", "frozen_at", "slow_server"):
            if getattr(self, key) < 0:
                raise ValueError(f"stragglers: {key}={getattr(self, key)} must be >= 0")
        if any(w < 0 for w in self.frozen):
            raise ValueError(f"stragglers: frozen={list(self.frozen)} must hold worker indices >= 0")

    def sampler(self, workers: int, seed: int) -> StragglerSampler:
        return StragglerSampler(self, workers, seed)


class StragglerSampler:
    """Draws of one model for `workers` workers under one seed; each worker has its own streams."""

    def __init__(self, model: Stragglers, workers: int, seed: int) -> None:
        self.model, self.workers, self.seed = model, workers, seed
        m = model
        a_task, a_mach = 1.0 / m.v_task**2, 1.0 / m.v_mach**2
        self._shape = np.ones(workers)
        self._scale = np.full(workers, m.mean)
        if m.compute == "gamma_homogeneous":
            q = np.random.default_rng([seed, 0xC0FFEE]).gamma(a_task, m.mean / a_task)
            self._shape[:], self._scale[:] = a_mach, q / a_mach
        elif m.compute == "gamma_heterogeneous":
            p = np.array(
                [np.random.default_rng([seed, 0xBEEF, w]).gamma(a_mach, m.mean / a_mach) for w in range(workers)]
            )
            self._shape[:], self._scale[:] = a_task, p / a_task
        self.machine_means = (self._shape * self._scale).tolist()
        self._compute: dict[tuple[int, int], np.ndarray] = {}
        self._delays: dict[tuple[int, int], np.ndarray] = {}

    def _block(self, cache: dict[tuple[int, int], np.ndarray], tag: int, worker: int, index: int) -> np.ndarray:
        key = (worker, index // _BLOCK)
        if key not in cache:
            rng = np.random.default_rng([self.seed, tag, worker, key[1]])
            if tag == 1:
                if self.model.compute == "constant":
                    cache[key] = np.full(_BLOCK, self.model.mean)
                else:
                    cache[key] = rng.gamma(self._shape[worker], self._scale[worker], size=_BLOCK)
            else:
                late = rng.random(_BLOCK) < self.model.delay_prob
                cache[key] = np.where(late, self.model.delay, 0.0)
        return cache[key]

    def compute_time(self, worker: int, index: int) -> float:
        """Seconds worker `worker` spends on its `index`-th batch."""
        return float(self._block(self._compute, 1, worker, index)[index % _BLOCK])

    def message_delay(self, worker: int, index: int) -> float:
        """Extra seconds the message carrying that batch's gradient is late."""
        if self.model.delay_prob == 0.0:
            return 0.0
        return float(self._block(self._delays, 2, worker, index)[index % _BLOCK])

    def is_frozen(self, worker: int, t: float) -> bool:
        return worker in self.model.frozen and t >= self.model.frozen_at


def order_statistic_mean(sampler: StragglerSampler, workers: int, k: int, rounds: int) -> float:
    """Mean over rounds of the k-th smallest compute time among `workers`: the ideal round time with quorum k."""
    if not 1 <= k <= workers:
        raise ValueError(f"stragglers: k={k} must be in 1..{workers}")
    times = np.array([[sampler.compute_time(w, r) for w in range(workers)] for r in range(rounds)])
    return float(np.sort(times, axis=1)[:, k - 1].mean())


def none(mean: float = 1.0) -> Stragglers:
    """Every batch takes `mean` seconds; no delays."""
    return Stragglers("constant", mean=mean)


def gamma_homogeneous(mean: float = 1.0, v_task: float = 0.1, v_mach: float = 0.1) -> Stragglers:
    """001_... Alg. 12: the same mean on every machine, gamma-distributed batch times."""
    return Stragglers("gamma_homogeneous", mean=mean, v_task=v_task, v_mach=v_mach)


def gamma_heterogeneous(mean: float = 1.0, v_mach: float = 0.6, v_task: float = 0.1) -> Stragglers:
    """001_... Alg. 13: machine means p[j] spread with V_mach; batches vary around them with V_task."""
    return Stragglers("gamma_heterogeneous", mean=mean, v_task=v_task, v_mach=v_mach)


def rare_delays(mean: float = 1.0, delay_prob: float = 0.0016, delay: float = 4.0) -> Stragglers:
    """003_...: constant compute, but 0.16% of messages arrive 4 s late."""
    return Stragglers("constant", mean=mean, delay_prob=delay_prob, delay=delay)


def frozen_worker(worker: int = 0, at: float = 10.0, mean: float = 1.0) -> Stragglers:
    """Worker `worker` stops for good at time `at` (a hung or SIGSTOPped rank)."""
    return Stragglers("constant", mean=mean, frozen=(worker,), frozen_at=at)
