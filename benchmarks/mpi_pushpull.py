"""Pull/push throughput of the MPI mailbox vs raw MPI_Get / MPI_Put of the same buffer, in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_pushpull.py [--numel 1048576] [--reps 200]

Rank 0 hosts; rank 1 measures, alternating raw and mailbox operations rep by rep (the machine is noisy). Raw:
`Get`/`Put` + `Flush` on a plain window inside a `Lock_all` epoch. Mailbox:
`WindowMailbox.read` (version check + Get + seqlock re-check) and `send` (Put and header, then the flag), with
rank 0 running the server's `recv` loop. Reported: effective bytes/s ratio mailbox / raw (target >= 0.8).

Where the gap comes from: two more raw sides time the very same MPI calls on the mailbox's own memory,
`raw_get_params` (a `Get` + `Flush` of the published parameters into the pull's own buffer) and `raw_put_slot` (a
`Put` + `Flush` of the gradient into this worker's slot, while the slot is free: after the server took the last
push and before the next). Against these (`pull_ratio_own`, `push_ratio_own`) the mailbox's ratio is the cost of
its protocol alone (the atomics around the bytes); the first pair's ratio also holds where the bytes sit in the
caches (the plain raw sides move one buffer to one window that nothing else touches).

A worker's read after a push first waits until the server has dealt with that push (read your own writes). That
wait is the server's work, not the pull's: it is taken untimed before each timed pull, and reported on its own as
`ack_ms` (the server's receive of one 4 MiB gradient, from the flag to the freed slot).
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

from collsync.runtime.mpi_rma import WindowMailbox
from collsync.runtime.mpi_windows import RmaCounts
from collsync.types import Arrival, Stamp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mpi_pushpull.json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("run with exactly 2 ranks: mpiexec -n 2 ...")
    rank, n = comm.Get_rank(), args.numel
    nbytes = n * 4

    # Raw baseline and mailbox, interleaved rep by rep so that both see the same machine (it is noisy): rank 1
    # times a raw Get, a mailbox pull, a raw Put, a mailbox push; rank 0 runs the server's receive loop throughout.
    win = MPI.Win.Allocate(nbytes if rank == 0 else 0, 4, comm=comm)
    win.Lock_all()
    box = WindowMailbox(comm, n)
    raw_get, raw_put, pulls, pushes, acks = [], [], [], [], []
    get_params, put_slot = [], []
    if rank == 0:
        box.publish(torch.ones(n), Stamp(1))
        for _ in range(args.reps):
            box.recv()
        box.publish(torch.ones(n), Stamp(2, done=True))
        box.close()
    else:
        buf = np.ones(n, dtype=np.float32)
        out, grad = torch.empty(n), torch.ones(n)
        counts, counted = RmaCounts(), {"pull": [], "push": []}
        for i in range(args.reps):
            if i == args.reps - min(5, args.reps):
                box.count(counts)  # the last reps (5 at most) counted: a proxy's microseconds on 4 MiB calls
            t = time.perf_counter()
            win.Get([buf, MPI.FLOAT], 0)
            win.Flush(0)
            raw_get.append(time.perf_counter() - t)
            t = time.perf_counter()
            box.read(out, lambda s: True, fetch=False)  # the wait for the server to deal with our last push
            acks.append(time.perf_counter() - t)
            t = time.perf_counter()
            box.win_box.Get([out.numpy(), MPI.FLOAT], 0, target=box.target())  # the pull's bytes alone
            box.win_box.Flush(0)
            get_params.append(time.perf_counter() - t)
            t, before = time.perf_counter(), counts.copy()
            box.read(out, lambda s: True)
            pulls.append(time.perf_counter() - t)
            if i >= args.reps - min(5, args.reps):  # the counted reps only (the others' counts are zero)
                counted["pull"].append(counts.minus(before))
            t = time.perf_counter()
            win.Put([buf, MPI.FLOAT], 0)
            win.Flush(0)
            raw_put.append(time.perf_counter() - t)
            t = time.perf_counter()
            slot = box.target(box.worker)  # free: the server took our last push (the read above waited)
            box.win_box.Put([grad.numpy(), MPI.FLOAT], 0, target=slot)
            box.win_box.Flush(0)
            put_slot.append(time.perf_counter() - t)
            t, before = time.perf_counter(), counts.copy()
            box.send(Arrival(0, 1, grad, i))
            pushes.append(time.perf_counter() - t)
            if i >= args.reps - min(5, args.reps):
                counted["push"].append(counts.minus(before))
        box.read(out, lambda s: s.done)
    box.free()
    win.Unlock_all()
    win.Free()
    if rank == 1:
        med = statistics.median
        result = {
            "command": f"mpiexec -n 2 python benchmarks/mpi_pushpull.py --numel {n} --reps {args.reps}",
            "mpi": MPI.Get_library_version().splitlines()[0],
            "bytes": nbytes,
            "raw_get_GBps": nbytes / med(raw_get) / 1e9,
            "raw_put_GBps": nbytes / med(raw_put) / 1e9,
            "pull_GBps": nbytes / med(pulls) / 1e9,
            "push_GBps": nbytes / med(pushes) / 1e9,
        }
        result["raw_get_params_GBps"] = nbytes / med(get_params) / 1e9
        result["raw_put_slot_GBps"] = nbytes / med(put_slot) / 1e9
        result["pull_ratio"] = result["pull_GBps"] / result["raw_get_GBps"]
        result["push_ratio"] = result["push_GBps"] / result["raw_put_GBps"]
        result["pull_ratio_own"] = result["pull_GBps"] / result["raw_get_params_GBps"]
        result["push_ratio_own"] = result["push_GBps"] / result["raw_put_slot_GBps"]
        result["ack_ms"] = 1e3 * med(acks)
        # Per pull and per push on the worker (the counted reps): remote calls, blocking round trips (Flushes),
        # and the polls among them that found the server not ready yet.
        result["rma_per_op"] = {
            k: {
                "remote_ops": statistics.mean(c.remote_ops for c in v),
                "round_trips": statistics.mean(c.round_trips for c in v),
                "waits": statistics.mean(c.waits for c in v),
                "by_kind": {op: statistics.mean(c.ops[op] for c in v) for op in counts.ops},
            }
            for k, v in counted.items()
        }
        result["target"] = ">= 0.8"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
