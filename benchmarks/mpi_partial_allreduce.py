"""The k-of-n partial allreduce at full quorum (k = n, what `sync=bsp` and backup b = 0 reduce through) against
`MPI_Allreduce` of the same buffer, in one run, sides alternated rep by rep:

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_partial_allreduce.py [--numel 1048576] [--reps 200]

Baseline: mpi4py `Allreduce` in place on a float32 numpy buffer, then the division by n (the mean every replica
applies). Partial: `PartialAllreduce.__call__(grad, quorum=n, round=t)` (`collsync/runtime/mpi_partial.py`): a
ticket, a Put of the contribution to the host's window; once all are in, each rank sums one 1/n block of the n
slots in rank order and publishes it, and every rank Gets the whole mean. Also timed: quorum n - 1 (one backup,
the fastest n - 1 counted), for scale. Each rep starts with a `Barrier` so both sides start from ranks in step;
the time is the slowest rank's. Correctness: the partial mean equals the allreduce mean to float32 rounding (a sum
in another order).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from collsync.runtime.mpi_partial import PartialAllreduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mpi_partial_allreduce.json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        raise SystemExit("run with 2 or more ranks: mpiexec -n 4 ...")
    rng = np.random.default_rng(rank)
    grad = torch.from_numpy(rng.standard_normal(args.numel).astype(np.float32))
    buf = np.empty(args.numel, dtype=np.float32)
    times: dict[str, list[float]] = {"allreduce": [], "partial_n": [], "partial_n_minus_1": []}
    worst = 0.0
    with PartialAllreduce(comm, args.numel, dtype=torch.float32, depth=4) as pa:
        t_round = 0
        for _ in range(args.reps):
            comm.Barrier()
            t = time.perf_counter()
            np.copyto(buf, grad.numpy())
            comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], op=MPI.SUM)
            buf /= n
            times["allreduce"].append(time.perf_counter() - t)
            for name, quorum in (("partial_n", n), ("partial_n_minus_1", n - 1)):
                comm.Barrier()
                t = time.perf_counter()
                result = pa(grad, quorum, t_round)
                times[name].append(time.perf_counter() - t)
                t_round += 1
                if quorum == n:
                    worst = max(worst, float(np.abs(result.mean.numpy() - buf).max()))
    # The slowest rank's time per rep (a collective ends when its last rank does).
    slowest = {k: np.max(comm.allgather(np.array(v)), axis=0).tolist() for k, v in times.items()}
    worst = comm.allreduce(worst, op=MPI.MAX)
    scale = float(np.abs(buf).max())
    if worst > 1e-5 * max(1.0, scale):
        raise SystemExit(f"partial mean differs from the allreduce mean by {worst:g}")
    if rank == 0:
        med = {k: statistics.median(v) for k, v in slowest.items()}
        # Per-rep ratios (each partial rep against the allreduce rep beside it), then their median: robust to the
        # load moving between reps.
        per_rep = {
            k: statistics.median(p / a for p, a in zip(slowest[k], slowest["allreduce"], strict=True))
            for k in ("partial_n", "partial_n_minus_1")
        }
        result = {
            "command": f"mpiexec -n {n} python benchmarks/mpi_partial_allreduce.py --numel {args.numel} "
            f"--reps {args.reps}",
            "mpi": MPI.Get_library_version().splitlines()[0],
            "ranks": n,
            "numel": args.numel,
            "median_ms": {k: 1e3 * v for k, v in med.items()},
            "ratio_to_allreduce": {k: med[k] / med["allreduce"] for k in ("partial_n", "partial_n_minus_1")},
            "median_per_rep_ratio": per_rep,
            "max_abs_diff": worst,
            "target": "partial_n <= 1.10",
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
