"""Full-sync step time: collsync's serverless BSP (`runtime=allreduce`) vs a hand-written mpi4py loop, in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_fullsync.py
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_fullsync.py

Both sides compute the same gradients (same model, same batches) and average them with one Allreduce of the flat
gradient; the baseline then applies SGD by hand, collsync goes through `loops.run_allreduce` and `Server`.
Reported per model size: median step time ratio collsync / baseline (target <= 1.10), alternating the two sides
over several repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from mpi4py import MPI

from collsync.data import Batches, synthetic
from collsync.flat import FlatModel
from collsync.loops import Gradients, run_allreduce
from collsync.models import mlp
from collsync.policy import bsp
from collsync.rules import sgd
from collsync.runtime.mpi_coll import MpiCollective
from collsync.server import Server

SIZES = {"100k": [900], "5M": [2200, 2200]}


def collsync_steps(comm, data, hidden, steps: int, batch: int) -> float:
    flat = FlatModel(mlp(data.input_shape, data.classes, hidden=hidden, seed=0))
    coll = MpiCollective(comm)
    server = Server(flat.params, sgd(lr=0.01), bsp(), coll.size, steps=steps)
    grads = Gradients(flat, Batches(data, coll.size, batch, 0))
    comm.Barrier()
    t = time.perf_counter()
    run_allreduce(server, coll, grads)
    return (time.perf_counter() - t) / steps


def baseline_steps(comm, data, hidden, steps: int, batch: int) -> float:
    flat = FlatModel(mlp(data.input_shape, data.classes, hidden=hidden, seed=0))
    size, rank = comm.Get_size(), comm.Get_rank()
    grads = Gradients(flat, Batches(data, size, batch, 0))
    params = flat.params.clone()
    comm.Barrier()
    t = time.perf_counter()
    for j in range(steps):
        g = grads(params, rank, j)
        comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
        params.add_(g, alpha=-0.01 / size)
    return (time.perf_counter() - t) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    data = synthetic(samples=4000, features=100, classes=10, seed=0)
    result: dict[str, object] = {
        "command": f"mpiexec -n {comm.Get_size()} python benchmarks/mpi_fullsync.py --steps {args.steps} "
        f"--repeats {args.repeats} --batch {args.batch}",
        "ranks": comm.Get_size(),
    }
    for name, hidden in SIZES.items():
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(collsync_steps(comm, data, hidden, args.steps, args.batch))
            theirs.append(baseline_steps(comm, data, hidden, args.steps, args.batch))
        numel = FlatModel(mlp(data.input_shape, data.classes, hidden=hidden)).numel
        ratio = statistics.median(ours) / statistics.median(theirs)
        result[name] = {
            "params": numel,
            "collsync_ms": 1e3 * statistics.median(ours),
            "baseline_ms": 1e3 * statistics.median(theirs),
            "ratio": ratio,
            "target": "<= 1.10",
        }
    if comm.Get_rank() == 0:
        path = args.out / f"mpi_fullsync_n{comm.Get_size()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
