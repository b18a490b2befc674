"""Serverless backup's lost batches (issue 34, item 3), in the simulator: bsp against backup (b = 1, margin auto,
catch-up) with one worker 3x slower, on Fashion-MNIST with the small CNN (or the MLP: `--model mlp`), several seeds.

With one worker always late, a backup round averages n - 1 gradients: over bsp's rounds it sees (n - 1) / n of bsp's
samples. The rows compare, at the final update, the test accuracy of: bsp over S rounds; backup over S rounds (what a
script's epoch of fixed rounds trained before `ledger.Ledger`); backup over S x n / (n - 1) rounds (the rounds an
epoch of the same samples takes). Run at the commit before the ledger, the longer backup row is "rounds added" with
fixed shards (the late worker's batches still lost, fresh ones taken instead); at or after it, the same rounds with
the late worker's batches handed to the others (each sample once an epoch). Also the model seconds each run took
to reach bsp's median final accuracy (the simulator's clock: a batch is 1 s, the slow worker's 3 s).

    python benchmarks/backup_batches.py [--model mlp] [--seeds 5] [--rows 12000] [--epochs 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch

from collsync.data import Batches, fashion_mnist
from collsync.flat import FlatModel
from collsync.loops import Gradients
from collsync.models import cnn, mlp
from collsync.policy import SyncPolicy, backup, bsp
from collsync.rules import momentum
from collsync.server import Server
from collsync.sim import Simulator
from collsync.stragglers import OneSlow


def accuracy(flat: FlatModel, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    flat.load(params)
    with torch.no_grad():
        return float((flat.module(x).argmax(1) == y).float().mean())


def run(data: Any, policy: SyncPolicy, steps: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One simulated run: the final test accuracy and the (model time, accuracy) every `args.every` updates."""
    model = (cnn if args.model == "cnn" else mlp)(data.input_shape, data.classes, seed=seed)
    flat = FlatModel(model)
    sim = Simulator(args.workers, OneSlow(args.workers, 3.0), seed=seed, margin="auto", catch_up=True)
    server = Server(flat.params.clone(), momentum(lr=args.lr), policy, args.workers, steps=steps, trace=sim.trace)
    grads = Gradients(flat, Batches(data, args.workers, args.batch, seed))
    curve: list[tuple[float, float]] = []

    def on_update(s: Server) -> None:
        if s.version % args.every == 0 or s.done:
            curve.append((sim.now, accuracy(flat, s.params, data.x_test, data.y_test)))

    sim.run(server, grads, on_update=on_update)
    return {"final": curve[-1][1], "curve": curve, "model_s": sim.now}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=12000, help="the first N training images (all 10,000 tests)")
    parser.add_argument("--tests", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=2, help="bsp's rounds: this many epochs of the rows")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core a run: on a shared machine, more threads only wait for each other
    full = fashion_mnist(flatten=False)
    data = full._replace(
        x_train=full.x_train[: args.rows],
        y_train=full.y_train[: args.rows],
        x_test=full.x_test[: args.tests],
        y_test=full.y_test[: args.tests],
    )
    n = args.workers
    bsp_steps = args.epochs * (args.rows // (n * args.batch))
    longer = math.ceil(bsp_steps * n / (n - 1))
    rows = [("bsp", bsp(), bsp_steps), ("backup, bsp's rounds", backup(1), bsp_steps)]
    rows.append(("backup, an epoch's samples", backup(1), longer))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in rows}
    began = time.monotonic()
    for seed in range(args.seeds):  # interleaved: every row's seed before the next seed
        for name, policy, steps in rows:
            results[name].append(run(data, policy, steps, seed, args))
    target = statistics.median(r["final"] for r in results["bsp"])
    print(
        f"Fashion-MNIST {args.rows} rows, {args.model}, {n} workers x batch {args.batch}, lr {args.lr}, "
        f"worker {n - 1} 3x slower, seeds 0-{args.seeds - 1} ({time.monotonic() - began:.0f} s)"
    )
    print("| run | rounds | final accuracy, median (min-max) | vs bsp (points) | model s to bsp's final, median |")
    print("|---|---|---|---|---|")
    for name, _, steps in rows:
        finals = [r["final"] for r in results[name]]
        reach = [next((t for t, a in r["curve"] if a >= target), math.inf) for r in results[name]]
        med = statistics.median(finals)
        print(
            f"| {name} | {steps} | {100 * med:.2f} ({100 * min(finals):.2f}-{100 * max(finals):.2f}) | "
            f"{100 * (med - target):+.2f} | {statistics.median(reach):.0f} |"
        )


if __name__ == "__main__":
    main()
