"""Full-sync step time: collsync's serverless BSP (`runtime=allreduce`) vs a hand-written mpi4py loop, in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_fullsync.py
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_fullsync.py --repeats 3
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_fullsync.py --tiny      # the CI smoke run

Every side computes the same gradients (same model, same batches) and applies SGD. The baseline, `loop`, averages
them with one blocking `Allreduce` of the flat gradient after the backward pass and applies SGD by hand. The
collsync sides run what `runtime=allreduce` runs (`loops.run_allreduce`, the `Server` applying the mean), with the
reduction made as `runtime=allreduce` would make it, under the default deadline of 600 s:

* `thread`: `BucketReducer` on its `CommThread` (the default): buckets summed by a thread that waits in MPI while
  the backward pass goes on;
* `poll`: `BucketReducer(thread=False)`: each bucket an `Iallreduce` tested from the hooks, waited with sleeps;
* `plain`: one `MpiCollective.allreduce_mean` after backward (`runtime.bucket_mib=0`), bounded by the deadline
  (an `Iallreduce` tested with sleeps);
* `blocking`: the same with no deadline (one blocking `Allreduce`).

Reported per model size: median seconds per step of each side over `--repeats` (sides alternated rep by rep), its
ratio to `loop`, and the largest difference of its final parameters from `loop`'s (the run fails above 1e-4, so a
fast but wrong side cannot win). Writes `results/mpi_fullsync_n<ranks>.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from mpi4py import MPI

from collsync.data import Batches, Dataset, synthetic
from collsync.flat import FlatModel
from collsync.loops import Gradients, run_allreduce
from collsync.models import mlp
from collsync.policy import bsp
from collsync.rules import sgd
from collsync.runtime.mpi_buckets import DEFAULT_BUCKET_BYTES, BucketReducer
from collsync.runtime.mpi_coll import MpiCollective
from collsync.server import Server

SIZES = {"100k": (900,), "5M": (2200, 2200)}
DEADLINE = 600.0  # sync.deadline's default: what runtime=allreduce waits under
LR = 0.01


def collsync_side(comm: object, data: Dataset, hidden: tuple[int, ...], steps: int, batch: int, how: str) -> Callable:
    """One rep of `how` (thread | poll | plain | blocking): returns (seconds per step, final parameters)."""

    def rep() -> tuple[float, torch.Tensor]:
        flat = FlatModel(mlp(data.input_shape, data.classes, hidden=hidden, seed=0))
        coll = MpiCollective(comm, None if how == "blocking" else DEADLINE)
        server = Server(flat.params, sgd(lr=LR), bsp(), coll.size, steps=steps)
        grads = Gradients(flat, Batches(data, coll.size, batch, 0))
        reducer = None
        if how in ("thread", "poll"):
            thread = how == "thread"
            reducer = BucketReducer(
                comm, flat.buffer, DEFAULT_BUCKET_BYTES, eager=True, deadline=DEADLINE, thread=thread
            )
        comm.Barrier()
        t = time.perf_counter()
        if reducer is None:
            run_allreduce(server, coll, grads)
        else:
            run_allreduce(server, coll, reducer.averaged(grads), averaged=True)
        elapsed = time.perf_counter() - t
        if reducer is not None:
            reducer.remove()
        return elapsed / steps, server.params.clone()

    return rep


def loop_side(comm: object, data: Dataset, hidden: tuple[int, ...], steps: int, batch: int) -> Callable:
    def rep() -> tuple[float, torch.Tensor]:
        flat = FlatModel(mlp(data.input_shape, data.classes, hidden=hidden, seed=0))
        size, rank = comm.Get_size(), comm.Get_rank()
        grads = Gradients(flat, Batches(data, size, batch, 0))
        params = flat.params.clone()
        comm.Barrier()
        t = time.perf_counter()
        for j in range(steps):
            g = grads(params, rank, j)
            comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
            params.add_(g, alpha=-LR / size)
        return (time.perf_counter() - t) / steps, params

    return rep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="2 repeats of 3 steps on a tiny model (CI smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default results/mpi_fullsync_nN.json)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    sizes = {"tiny": (8,)} if args.tiny else SIZES
    if args.tiny:
        args.steps, args.repeats = 3, 2
    data = synthetic(samples=4000, features=100, classes=10, seed=0)
    n = comm.Get_size()
    result: dict[str, object] = {
        "command": f"mpiexec -n {n} python benchmarks/mpi_fullsync.py --steps {args.steps} --repeats {args.repeats} "
        f"--batch {args.batch}" + (" --tiny" if args.tiny else ""),
        "ranks": n,
        "load_before": list(os.getloadavg()),
        "sizes": {},
    }
    for name, hidden in sizes.items():
        sides = {"loop": loop_side(comm, data, hidden, args.steps, args.batch)}
        for how in ("thread", "poll", "plain", "blocking"):
            sides[how] = collsync_side(comm, data, hidden, args.steps, args.batch, how)
        times: dict[str, list[float]] = {k: [] for k in sides}
        final: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):
            for side, rep in sides.items():
                seconds, final[side] = rep()
                times[side].append(comm.allreduce(seconds, op=MPI.MAX))  # the slowest rank sets the pace
        worst = {k: (final[k] - final["loop"]).abs().max().item() for k in sides}
        bad = {k: v for k, v in worst.items() if v > 1e-4}
        if bad:
            raise SystemExit(f"mpi_fullsync: parameters differ from the loop's: {bad}")
        med = {k: statistics.median(v) for k, v in times.items()}
        result["sizes"][name] = {  # type: ignore[index]
            "params": final["loop"].numel(),
            "ms_per_step": {k: 1e3 * v for k, v in med.items()},
            "ratio_to_loop": {k: v / med["loop"] for k, v in med.items()},
            "ratio_median_of_reps": {
                k: statistics.median(a / b for a, b in zip(v, times["loop"], strict=True)) for k, v in times.items()
            },
            "ms_each_repeat": {k: [1e3 * t for t in v] for k, v in times.items()},
            "max_param_diff": worst,
        }
        if comm.Get_rank() == 0:
            row = ", ".join(f"{k} {1e3 * v:.2f} ms ({v / med['loop']:.2f}x)" for k, v in med.items())
            print(f"-n {n}, {final['loop'].numel():,} params: {row}", flush=True)
    result["load_after"] = list(os.getloadavg())
    if comm.Get_rank() == 0:
        path = args.out or Path(__file__).parent / "results" / f"mpi_fullsync_n{n}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
