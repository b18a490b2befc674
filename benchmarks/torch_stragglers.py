"""Sync modes of collsync.torch under injected stragglers, one after another in one run.

    .venv/bin/mpiexec -n 5 .venv/bin/python benchmarks/torch_stragglers.py               # 1 server + 4 workers
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/torch_stragglers.py --serverless  # 4 workers

Every worker runs the same user loop (an MLP on synthetic batches) and, before each `step()`, sleeps the compute
time the straggler model (`collsync.stragglers.gamma_heterogeneous`, 001_... App. C.3) draws for it, times
`--scale`. With servers: `bsp` on the parameter server against `async` and `ssp`; serverless: `bsp` (allreduce)
against `backup` (backups=1, the k-of-n partial allreduce). Reported: server updates per second (a bsp round is one
update of n gradients, an async update one gradient) and gradients applied per second, and each as a ratio to bsp.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import collsync.torch as hvd
from collsync.stragglers import gamma_heterogeneous


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serverless", action="store_true")
    parser.add_argument("--steps", type=int, default=60, help="steps per worker per mode")
    parser.add_argument("--scale", type=float, default=0.01, help="seconds per model second of compute")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    modes = ["bsp", "backup"] if args.serverless else ["bsp", "async", "ssp"]
    hvd.init(servers=0 if args.serverless else 1)
    rank, n = hvd.rank(), hvd.size()
    sampler = gamma_heterogeneous().sampler(n, seed=0)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    results: dict = {"workers": n, "servers": hvd.servers(), "modes": {}}
    for mode in modes:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        options = {"backups": 1} if mode == "backup" else {}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), sync=mode, **options)
        hvd.barrier()
        start = time.perf_counter()
        steps = 0
        for i in range(args.steps):
            if getattr(opt, "finished", False):
                break
            time.sleep(sampler.compute_time(rank, i) * args.scale)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
        took = hvd.allreduce(torch.tensor(time.perf_counter() - start, dtype=torch.float64), op=hvd.Sum) / n
        applied = hvd.allreduce(torch.tensor(float(steps - opt.dropped)), op=hvd.Sum).item()
        # Updates: rounds for round policies (one per step of the slowest), one per gradient for async.
        updates = applied if mode == "async" else float(min(hvd.allgather_object(steps)))
        results["modes"][mode] = {"seconds": took.item(), "updates_per_s": updates / took.item(),
                                  "gradients_per_s": applied / took.item()}  # fmt: skip
        opt.close()
    base = results["modes"]["bsp"]
    for value in results["modes"].values():
        value["updates_vs_bsp"] = value["updates_per_s"] / base["updates_per_s"]
        value["gradients_vs_bsp"] = value["gradients_per_s"] / base["gradients_per_s"]
    if rank == 0:
        for mode, v in results["modes"].items():
            print(
                f"{mode}: {v['updates_per_s']:.1f} updates/s ({v['updates_vs_bsp']:.2f}x bsp), "
                f"{v['gradients_per_s']:.1f} gradients/s ({v['gradients_vs_bsp']:.2f}x bsp)",
                flush=True,
            )
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
