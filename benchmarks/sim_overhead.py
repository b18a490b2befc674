"""Simulator overhead: the simulator vs a plain single-process loop doing the same gradient computations.

Both sides compute the same gradients (same model, same batches, same count) and apply the same momentum rule; the
plain loop has no event queue, no server bookkeeping, no trace. Timed alternately, several repeats, one process:
the ratio of medians is what is reported (target: <= 1.15).

    python benchmarks/sim_overhead.py [--workers 8] [--steps 300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from collsync.data import Batches, digits
from collsync.flat import FlatModel
from collsync.loops import Gradients
from collsync.models import mlp
from collsync.policy import backup
from collsync.rules import momentum
from collsync.server import Server
from collsync.sim import Simulator
from collsync.stragglers import gamma_heterogeneous
from collsync.types import Context


def simulated(data, workers: int, steps: int, batch: int) -> tuple[float, int]:
    flat = FlatModel(mlp(input_shape=data.input_shape, classes=data.classes, hidden=[64], seed=0))
    sim = Simulator(workers, gamma_heterogeneous(), 0)
    server = Server(flat.params, momentum(lr=0.05), backup(1), workers, steps=steps, ema_decay=0.99, trace=sim.trace)
    grads = Gradients(flat, Batches(data, workers, batch, 0))
    start = time.perf_counter()
    sim.run(server, grads)
    return time.perf_counter() - start, len(sim.trace.of("start"))


def plain(data, workers: int, count: int, batch: int) -> float:
    flat = FlatModel(mlp(input_shape=data.input_shape, classes=data.classes, hidden=[64], seed=0))
    grads = Gradients(flat, Batches(data, workers, batch, 0))
    rule = momentum(lr=0.05)
    params = flat.params.clone()
    state = rule.init(params)
    start = time.perf_counter()
    for i in range(count):
        g = grads(params, i % workers, i // workers)
        delta, state = rule.update(g, state, params, Context(step=i, worker=0, staleness=0))
        params.add_(delta)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sim_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = digits()
    sims, plains, count = [], [], 0
    for _ in range(args.repeats):
        t, count = simulated(data, args.workers, args.steps, args.batch)
        sims.append(t)
        plains.append(plain(data, args.workers, count, args.batch))
    ratio = statistics.median(sims) / statistics.median(plains)
    result = {
        "command": f"python benchmarks/sim_overhead.py --workers {args.workers} --steps {args.steps} "
        f"--batch {args.batch} --repeats {args.repeats}",
        "gradients": count,
        "simulator_s_median": statistics.median(sims),
        "plain_loop_s_median": statistics.median(plains),
        "ratio": ratio,
        "target": "<= 1.15",
        "meets_target": ratio <= 1.15,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
