"""SSP on the small CNN (issue 34, item 3), in the simulator: bsp against ssp at bound 1 with the look-ahead momentum,
as `collsync.torch` runs `examples/mnist.py --model cnn` (4 workers, batch 32, Horovod's lr 0.02 x 4 = 0.08 and
momentum 0.9; the servers' rule `collsync.rules.lookahead` at that lr), every batch 1 model second (no stragglers:
SSP's staleness alone), several seeds. Digits by default (the example's 75/25 split of scikit-learn's digits, 20
epochs), or the first `--rows` of Fashion-MNIST's training images (all 10,000 tests) with `--data fashion`.

    python benchmarks/ssp_cnn.py [--data digits|fashion] [--seeds 5] [--epochs 20] [--rows 12000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from collsync.data import Batches, digits, fashion_mnist
from collsync.flat import FlatModel
from collsync.loops import Gradients
from collsync.models import cnn
from collsync.policy import bsp, ssp
from collsync.rules import Rule, lookahead, momentum
from collsync.server import Server
from collsync.sim import Simulator


def final_accuracy(data: Any, policy: Any, rule: Rule, steps: int, seed: int, workers: int, batch: int) -> float:
    """One simulated run's test accuracy after `steps` rounds."""
    flat = FlatModel(cnn(data.input_shape, data.classes, seed=seed))
    sim = Simulator(workers, None, seed=seed)
    server = Server(flat.params.clone(), rule, policy, workers, steps=steps, trace=sim.trace)
    sim.run(server, Gradients(flat, Batches(data, workers, batch, seed)))
    flat.load(server.params)
    with torch.no_grad():
        return float((flat.module(data.x_test).argmax(1) == data.y_test).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="digits", choices=["digits", "fashion"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=12000, help="--data fashion: the first N training images")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.08, help="the lr of a round (Horovod's lr x size())")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = digits(flatten=False)
    if args.data == "fashion":
        full = fashion_mnist(flatten=False)
        data = full._replace(x_train=full.x_train[: args.rows], y_train=full.y_train[: args.rows])
    steps = args.epochs * (len(data.y_train) // (args.workers * args.batch))
    sides = {
        "bsp": lambda: (bsp(), momentum(lr=args.lr, momentum=0.9)),
        "ssp (bound 1, look-ahead)": lambda: (ssp(max_lead=1), lookahead(lr=args.lr, momentum=0.9)),
    }
    results: dict[str, list[float]] = {name: [] for name in sides}
    started = time.perf_counter()
    for seed in range(args.seeds):  # interleaved: seed by seed, every side
        for name, make in sides.items():
            policy, rule = make()
            acc = final_accuracy(data, policy, rule, steps, seed, args.workers, args.batch)
            results[name].append(acc)
            print(f"{name}, seed {seed}: {acc:.4f}", flush=True)
    base = statistics.median(results["bsp"])
    print(f"\n{args.data}, {steps} rounds, {args.seeds} seeds ({time.perf_counter() - started:.0f} s)")
    for name, accs in results.items():
        med = statistics.median(accs)
        print(f"{name}: median {med:.4f} ({min(accs):.4f}-{max(accs):.4f}), {100 * (med - base):+.2f} points vs bsp")


if __name__ == "__main__":
    main()
