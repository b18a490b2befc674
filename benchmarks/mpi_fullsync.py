"""Full-sync step time: collsync's serverless BSP (`runtime=allreduce`) vs a hand-written mpi4py loop, in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_fullsync.py
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_fullsync.py

Both sides compute the same gradients (same model, same batches). The baseline averages them with one Allreduce
of the flat gradient after the backward pass and applies SGD by hand. collsync runs what `runtime=allreduce` runs:
a `BucketReducer` averages the gradient in buckets with `Iallreduce` while the backward pass runs, then
`loops.run_allreduce` and `Server` apply it. Also timed, as `plain`: collsync's loop with one blocking
`MpiCollective.allreduce_mean` after the backward pass instead of the buckets.
Reported per model size: median step time ratio collsync / baseline (target <= 1.10), alternating the sides
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
from collsync.runtime.mpi_coll import DEFAULT_BUCKET_BYTES, BucketReducer, MpiCollective
from collsync.server import Server

SIZES = {"100k": [900], "5M": [2200, 2200]}


def collsync_steps(comm, data, hidden, steps: int, batch: int, bucket_bytes: int | None) -> float:
    """`bucket_bytes` None: one blocking allreduce after the backward pass instead of the bucketed reducer."""
    flat = FlatModel(mlp(data.input_shape, data.classes, hidden=hidden, seed=0))
    coll = MpiCollective(comm)
    server = Server(flat.params, sgd(lr=0.01), bsp(), coll.size, steps=steps)
    grads = Gradients(flat, Batches(data, coll.size, batch, 0))
    reducer = None if bucket_bytes is None else BucketReducer(comm, flat, bucket_bytes)
    comm.Barrier()
    t = time.perf_counter()
    if reducer is None:
        run_allreduce(server, coll, grads)
    else:
        run_allreduce(server, coll, reducer.averaged(grads), averaged=True)
    elapsed = time.perf_counter() - t
    if reducer is not None:
        reducer.remove()
    return elapsed / steps


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
    parser.add_argument("--bucket-mib", type=float, default=DEFAULT_BUCKET_BYTES / 2**20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    data = synthetic(samples=4000, features=100, classes=10, seed=0)
    result: dict[str, object] = {
        "command": f"mpiexec -n {comm.Get_size()} python benchmarks/mpi_fullsync.py --steps {args.steps} "
        f"--repeats {args.repeats} --batch {args.batch} --bucket-mib {args.bucket_mib:g}",
        "ranks": comm.Get_size(),
    }
    bucket_bytes = int(args.bucket_mib * 2**20)
    for name, hidden in SIZES.items():
        ours, plain, theirs = [], [], []
        for _ in range(args.repeats):
            ours.append(collsync_steps(comm, data, hidden, args.steps, args.batch, bucket_bytes))
            plain.append(collsync_steps(comm, data, hidden, args.steps, args.batch, None))
            theirs.append(baseline_steps(comm, data, hidden, args.steps, args.batch))
        flat = FlatModel(mlp(data.input_shape, data.classes, hidden=hidden))
        buckets = len(BucketReducer(comm, flat, bucket_bytes).buckets)
        result[name] = {
            "params": flat.numel,
            "buckets": buckets,
            "collsync_ms": 1e3 * statistics.median(ours),
            "plain_ms": 1e3 * statistics.median(plain),
            "baseline_ms": 1e3 * statistics.median(theirs),
            "ratio": statistics.median(ours) / statistics.median(theirs),
            "plain_ratio": statistics.median(plain) / statistics.median(theirs),
            "target": "<= 1.10",
        }
    if comm.Get_rank() == 0:
        path = args.out / f"mpi_fullsync_n{comm.Get_size()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
