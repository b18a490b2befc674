"""Async on the small CNN (issue 34, item 3), in the simulator: DANA and the remedies of 001_... against bsp, as
`collsync.torch` runs `examples/mnist.py --model cnn --epochs 8` (4 workers, batch 32, Horovod's lr 0.02 x 4 = 0.08
and momentum 0.9 for bsp's rounds; the servers' DANA at 0.08 / 4 = 0.02, `server_rule.server_lr`), several seeds and
three timings: `none` (every batch 1 model second: each gradient exactly 3 updates stale), `het` (001_... App. C.3's
heterogeneous gamma workers, collsync-train's default) and `rare` (5% of the messages 8 model seconds late: a
gradient about 20-30 updates stale now and then, as a rank descheduled on an oversubscribed host sends one).

The sides: bsp (momentum), DANA (001_... Alg. 6, the default), DANA-GA (Alg. 8: Gap-Aware, parameter-wise and
global, Alg. 14; and parameter-wise with eta_max = N x lr or 2N x lr, so that the Gap counts rounds of N updates and
the drift of about one round every async gradient has goes unpenalized, 001_... C.13), DANA at lr / 2, and DANA
with 001_... App. C.4's gradual warm-up (lr / N rising to lr, momentum corrected) over 2 epochs. A run counts as
collapsed below 0.70 (bsp's worst over 10 seeds is 0.85).

    python benchmarks/async_cnn.py [--seeds 10] [--epochs 8] [--sides bsp dana ...] [--timings none het rare]
    python benchmarks/async_cnn.py --stability      # the largest stable step on a quadratic, bsp against DANA
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from collsync import stragglers
from collsync.data import Batches, digits
from collsync.flat import FlatModel
from collsync.loops import Gradients
from collsync.models import cnn
from collsync.policy import SyncPolicy, asynchronous, bsp
from collsync.rules import Rule, dana, gap_aware, gradual_warmup, momentum
from collsync.server import Server
from collsync.sim import Simulator

WORKERS, BATCH, LR, MOMENTUM = 4, 32, 0.02, 0.9  # the example's per-worker lr; bsp's round takes LR x WORKERS
COLLAPSED = 0.70

TIMINGS: dict[str, Any] = {
    "none": None,
    "het": stragglers.gamma_heterogeneous(),
    "rare": stragglers.rare_delays(delay_prob=0.05, delay=8.0),
}

Side = Callable[[int], tuple[SyncPolicy, Rule, Rule | None, int]]  # epoch updates -> policy, rule, penalty, per round


def sides() -> dict[str, Side]:
    """Each side's policy, rule and penalty (None: none), and how many updates a round of 4 gradients is."""
    return {
        "bsp": lambda epoch: (bsp(), momentum(lr=LR * WORKERS, momentum=MOMENTUM), None, 1),
        "dana": lambda epoch: (asynchronous(), dana(lr=LR, momentum=MOMENTUM), None, WORKERS),
        "dana_ga": lambda epoch: (
            asynchronous(),
            dana(lr=LR, momentum=MOMENTUM),
            gap_aware(eta_max=LR, momentum=MOMENTUM),
            WORKERS,
        ),
        "dana_ga_global": lambda epoch: (
            asynchronous(),
            dana(lr=LR, momentum=MOMENTUM),
            gap_aware(eta_max=LR, momentum=MOMENTUM, granularity="global"),
            WORKERS,
        ),
        "dana_ga_tolerant": lambda epoch: (
            asynchronous(),
            dana(lr=LR, momentum=MOMENTUM),
            gap_aware(eta_max=LR * WORKERS, momentum=MOMENTUM),
            WORKERS,
        ),
        "dana_ga_tolerant_2n": lambda epoch: (
            asynchronous(),
            dana(lr=LR, momentum=MOMENTUM),
            gap_aware(eta_max=LR * 2 * WORKERS, momentum=MOMENTUM),
            WORKERS,
        ),
        "dana_lr_half": lambda epoch: (asynchronous(), dana(lr=LR / 2, momentum=MOMENTUM), None, WORKERS),
        "dana_warmup": lambda epoch: (
            asynchronous(),
            gradual_warmup(dana(lr=LR, momentum=MOMENTUM), 2 * epoch, WORKERS),
            None,
            WORKERS,
        ),
    }


def final_accuracy(data: Any, side: Side, rounds: int, seed: int, timing: Any) -> float:
    """One simulated run's test accuracy after `rounds` rounds' worth of gradients."""
    per_epoch = len(data.y_train) // (WORKERS * BATCH)
    policy, rule, penalty, per_round = side(per_epoch * WORKERS)
    flat = FlatModel(cnn(data.input_shape, data.classes, seed=seed))
    sim = Simulator(WORKERS, timing, seed=seed)
    extra = {} if penalty is None else {"penalty": penalty}
    server = Server(flat.params.clone(), rule, policy, WORKERS, steps=rounds * per_round, trace=sim.trace, **extra)
    sim.run(server, Gradients(flat, Batches(data, WORKERS, BATCH, seed)))
    flat.load(server.params)
    with torch.no_grad():
        return float((flat.module(data.x_test).argmax(1) == data.y_test).float().mean())


def _grows(step: Callable[[float], float], steps: int = 4000) -> bool:
    """Whether the iteration `step`, started at x = 1, leaves |x| <= 1 after `steps` updates (bounded: stable)."""
    x = 1.0
    for _ in range(steps):
        x = step(x)
        if abs(x) > 1e6:
            return True
    return abs(x) > 1.0


def heavy_ball(eta_h: float, gamma: float = MOMENTUM) -> Callable[[float], float]:
    """bsp's round on f = h x^2 / 2: v <- gamma v + h x; x <- x - eta v (one fresh mean gradient a round)."""
    v = [0.0]

    def step(x: float) -> float:
        v[0] = gamma * v[0] + x
        return x - eta_h * v[0]

    return step


def dana_round_robin(eta_h: float, workers: int, gamma: float = MOMENTUM) -> Callable[[float], float]:
    """DANA (001_... Alg. 6) on f = h x^2 / 2 with `workers` taking turns: worker i's gradient was computed on the
    look-ahead x - eta gamma sum_j v_j it read at its last update, workers - 1 updates ago."""
    v = [0.0] * workers
    reads = [1.0] * workers
    turn = [0]

    def step(x: float) -> float:
        i = turn[0] % workers
        turn[0] += 1
        v[i] = gamma * v[i] + reads[i]
        x = x - eta_h * v[i]
        reads[i] = x - eta_h * gamma * sum(v)
        return x

    return step


def largest_stable(make: Callable[[float], Callable[[float], float]]) -> float:
    """The largest eta x h (to 3 digits) at which `make(eta_h)` stays bounded, by bisection on a log scale."""
    low, high = 1e-4, 10.0
    while high / low > 1.001:
        mid = (low * high) ** 0.5
        low, high = (low, mid) if _grows(make(mid)) else (mid, high)
    return low


def stability() -> None:
    """Why async leaves less room than bsp at the same lr per sample, on a quadratic (`--stability`)."""
    print(f"bsp (heavy ball, momentum {MOMENTUM}): largest stable lr x h of a round {largest_stable(heavy_ball):.3f}")
    for n in (1, 2, 4, 8, 16):
        one = largest_stable(functools.partial(dana_round_robin, workers=n))
        print(f"DANA, {n} workers in turn: largest stable lr x h of an update {one:.4f}, x {n} workers = {n * one:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, ..., first-seed + seeds - 1")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--sides", nargs="+", default=list(sides()), choices=list(sides()))
    parser.add_argument("--timings", nargs="+", default=list(TIMINGS), choices=list(TIMINGS))
    parser.add_argument("--stability", action="store_true", help="only the quadratic's stability bounds")
    args = parser.parse_args()
    if args.stability:
        stability()
        return
    torch.set_num_threads(1)
    data = digits(flatten=False)
    rounds = args.epochs * (len(data.y_train) // (WORKERS * BATCH))
    results: dict[tuple[str, str], list[float]] = {}
    started = time.perf_counter()
    for seed in range(
        args.first_seed, args.first_seed + args.seeds
    ):  # interleaved: seed by seed, every side and timing
        for name in args.sides:
            # bsp's rounds hold the same gradients whatever the timing: one run serves every timing
            for timing in ["-"] if name == "bsp" else args.timings:
                acc = final_accuracy(data, sides()[name], rounds, seed, TIMINGS.get(timing))
                results.setdefault((name, timing), []).append(acc)
                print(f"{name} / {timing}, seed {seed}: {acc:.4f}", flush=True)
    base = statistics.median(results[("bsp", "-")]) if ("bsp", "-") in results else float("nan")
    print(f"\ndigits CNN, {rounds} rounds, {args.seeds} seeds ({time.perf_counter() - started:.0f} s)")
    for (name, timing), accs in results.items():
        med, low = statistics.median(accs), sum(a < COLLAPSED for a in accs)
        print(
            f"{name} / {timing}: median {med:.4f} ({min(accs):.4f}-{max(accs):.4f}), "
            f"{100 * (med - base):+.2f} points vs bsp, {low} of {len(accs)} below {COLLAPSED}"
        )


if __name__ == "__main__":
    main()
