"""The k-of-n partial allreduce at full quorum (k = n, what `sync=bsp` and backup b = 0 reduce through) against
`MPI_Allreduce` of the same buffer, in one run, the sides' order shuffled rep by rep (the same on every rank):

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_partial_allreduce.py [--numel 1048576] [--reps 200]

Baseline: mpi4py `Allreduce` in place on a float32 numpy buffer, then the division by n (the mean every replica
applies). Partial: `PartialAllreduce.__call__(grad, quorum=n, round=t, out=out)`
(`collsync/runtime/mpi_partial.py`): at full quorum one allreduce on a duplicate communicator (blocking here, as no
`timeout` is set; with one, an `MPI_Iallreduce` waited for up to it), the gradient copied into `out` first as the
baseline copies it into its buffer. Also timed: the baseline's `Allreduce` by hand on a torch tensor's buffer over a
duplicate communicator (the full-quorum path without its bookkeeping), the partial allreduce without `out` (a new 4
MiB mean per round, what `rounds.run_partial` does), and quorum n - 1 (one backup, the fastest n - 1 counted:
one bit-per-rank ticket on the host's word, then the direct exchange: each contributor summing one block of the
contributors' vectors in rank order, sent to it by messages, and the blocks of the mean sent back, one contributor
copying the mean into the host's ring for the others), for scale; quorum n - 1 again on a second `PartialAllreduce`
made countable (`Windows.count`: every one-sided call and message counted as it is made), which prices the counting
itself (the uncounted one calls its mpi4py windows directly); and quorum n - 1 on the host-summed path
(`protocol="host"`: every contribution Put into the host's window, each contributor Getting its block of them all
and Putting its block of the mean there, every rank Getting the mean). Each rep starts with a `Barrier` so the
sides start from ranks in step; the time is the slowest rank's. After the timing, `--count-rounds` rounds of each
partial side run on countable objects and the JSON gives, per rank, the remote one-sided operations and messages (by
kind), the blocking round trips (`Flush` calls and waits for a phase of messages) and the bytes moved per round
(`rma_per_round`), for the host-summed path too. Correctness: the partial mean equals the allreduce
mean to float32 rounding (MPI may sum in another order on the duplicate communicator)."""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from collsync.runtime.mpi_partial import PartialAllreduce
from collsync.runtime.mpi_windows import RmaCounts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--count-rounds", type=int, default=20, help="rounds per side counted after the timing")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mpi_partial_allreduce.json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        raise SystemExit("run with 2 or more ranks: mpiexec -n 4 ...")
    rng = np.random.default_rng(rank)
    grad = torch.from_numpy(rng.standard_normal(args.numel).astype(np.float32))
    buf = np.empty(args.numel, dtype=np.float32)
    out = torch.empty(args.numel, dtype=torch.float32)
    by_hand = torch.empty(args.numel, dtype=torch.float32)
    dup = comm.Dup()
    rounds = itertools.count()  # the partial allreduce's round numbers, in the order its sides run

    def allreduce() -> None:
        np.copyto(buf, grad.numpy())
        comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], op=MPI.SUM)
        np.divide(buf, n, out=buf)

    def allreduce_torch() -> None:
        by_hand.copy_(grad)
        dup.Allreduce(MPI.IN_PLACE, [by_hand.numpy(), MPI.FLOAT], op=MPI.SUM)
        by_hand.div_(n)

    def partial(quorum: int, into: torch.Tensor | None) -> Callable[[], object]:
        return lambda: pa(grad, quorum, next(rounds), out=into)

    counted_rounds, host_rounds, host_counted_rounds = itertools.count(), itertools.count(), itertools.count()
    with (
        # The direct exchange by name: the default ("auto") takes the host's windows where the ranks share a host.
        PartialAllreduce(comm, args.numel, dtype=torch.float32, depth=4, protocol="direct") as pa,
        PartialAllreduce(comm, args.numel, dtype=torch.float32, depth=4, protocol="direct") as pc,
        PartialAllreduce(comm, args.numel, dtype=torch.float32, depth=4, protocol="host") as ph,
        PartialAllreduce(comm, args.numel, dtype=torch.float32, depth=4, protocol="host") as phc,
    ):
        counts, host_counts = pc.count(RmaCounts()), phc.count(RmaCounts())
        sides: dict[str, Callable[[], object]] = {
            "allreduce": allreduce,
            "allreduce_torch": allreduce_torch,
            "partial_n": partial(n, out),
            "partial_n_alloc": partial(n, None),
            "partial_n_minus_1": partial(n - 1, out),
            "partial_n_minus_1_counted": lambda: pc(grad, n - 1, next(counted_rounds), out=out),
            "partial_n_minus_1_host": lambda: ph(grad, n - 1, next(host_rounds), out=out),
        }
        times: dict[str, list[float]] = {name: [] for name in sides}
        shuffle = random.Random(0)
        for _ in range(args.reps):
            # The sides' order is shuffled rep by rep, the same on every rank (one seeded generator): a rotation kept
            # each side after the same other one (partial_n_minus_1 after partial_n_alloc's fresh 4 MiB mean) in
            # all reps but one of each cycle.
            order = list(sides)
            shuffle.shuffle(order)
            for name in order:
                comm.Barrier()
                t = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - t)
        # Checked once, after the timing: a check between the sides would warm `buf` (and allocate) for the next.
        worst = float(np.abs(pa(grad, n, next(rounds)).mean.numpy() - buf).max())
        rma = {
            f"quorum {q}": per_round(pc, counts, q, counted_rounds, grad, out, args.count_rounds) for q in (n, n - 1)
        }
        rma[f"quorum {n - 1}, host-summed"] = per_round(
            phc, host_counts, n - 1, host_counted_rounds, grad, out, args.count_rounds
        )
    dup.Free()
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
            for k in times
            if k != "allreduce"
        }
        result = {
            "command": f"mpiexec -n {n} python benchmarks/mpi_partial_allreduce.py --numel {args.numel} "
            f"--reps {args.reps}",
            "mpi": MPI.Get_library_version().splitlines()[0],
            "ranks": n,
            "numel": args.numel,
            "median_ms": {k: 1e3 * v for k, v in med.items()},
            "ratio_to_allreduce": {k: med[k] / med["allreduce"] for k in times if k != "allreduce"},
            "median_per_rep_ratio": per_rep,
            "max_abs_diff": worst,
            "rma_per_round": rma,
            "target": "partial_n <= 1.10",
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))


def per_round(
    pc: PartialAllreduce,
    counts: RmaCounts,
    quorum: int,
    rounds: itertools.count[int],
    grad: torch.Tensor,
    out: torch.Tensor,
    reps: int,
) -> dict[str, object]:
    """`reps` rounds of `quorum` on the countable `pc`, each rank's calls counted round by round (collective): per
    rank the mean over the rounds of its remote operations (and by kind), blocking round trips and bytes moved;
    `max` the largest of them over the ranks and rounds (the critical path is at most that many round trips)."""
    taken = []
    for _ in range(reps):
        pc.comm.Barrier()
        before = counts.copy()
        pc(grad, quorum, next(rounds), out=out)
        taken.append(counts.minus(before))
    mine = {
        "remote_ops": statistics.mean(c.remote_ops for c in taken),
        "round_trips": statistics.mean(c.round_trips for c in taken),
        "data_mb": statistics.mean(c.data_bytes for c in taken) / 1e6,
        "waits": statistics.mean(c.waits for c in taken),
        "tests": statistics.mean(c.tests for c in taken),
        "protocol_round_trips": statistics.mean(c.round_trips - c.waits for c in taken),
        "max_round_trips": max(c.round_trips for c in taken),
        "by_kind": {k: statistics.mean(c.ops[k] for c in taken) for k in counts.ops},
    }
    every = pc.comm.gather(mine, root=0) or []
    return {
        "per_rank": every,
        "max_round_trips": max((m["max_round_trips"] for m in every), default=0),
        "mean_round_trips": statistics.mean(m["round_trips"] for m in every) if every else 0,
        "max_protocol_round_trips": max((m["protocol_round_trips"] for m in every), default=0),
    }


if __name__ == "__main__":
    main()
