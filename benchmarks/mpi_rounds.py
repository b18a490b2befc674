"""Round trips of a worker's round through the servers (issue 33, items 1 and 3): bsp, ssp and psp rounds.

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_rounds.py [--servers 1] [--numel 262144] [--steps 60]
        [--window]

Ranks 0..M-1 serve one shard each (`runtime.mpi_shards`), the others are workers running `loops.run_worker` with
a gradient that costs `--compute` ms (the last worker `--slow` times that: the straggler every round waits for or
drops). Each worker counts its one-sided calls (`ShardedMailbox.count`, `mpi_windows.RmaCounts`) over its whole
run; reported per round (one pull and one push) and worker: round trips (every `Flush`), the protocol's own (those
not spent in a try that found the server not ready yet), the polls that waited, remote calls and the bytes moved,
and the run's wall time per update. The policies run one after the other in one launch, each `--repeats` times in
an order shuffled per repeat (the same on every rank), so that none always runs first. The shards are opened as
both fronts open them, the servers sending each worker its parameters (`runtime.mpi_sent`); `--window`: the
workers poll the windows and Get them instead (what stream policies do), for a comparison in one launch.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

from collsync.loops import Worker, run_server, run_worker
from collsync.policy import SyncPolicy, bsp, psp, ssp
from collsync.rules import sgd
from collsync.runtime.mpi_shards import ShardedMailbox, open_shards, shard_bounds
from collsync.runtime.mpi_windows import RmaCounts
from collsync.server import Server


def policies(workers: int) -> dict[str, SyncPolicy]:
    """The round policies whose rounds go through the servers: bsp (quorum n), ssp bound 1, psp quorum n - 1."""
    return {"bsp": bsp(), "ssp": ssp(1), "psp": psp(pushes=max(1, workers - 1), pull_fraction=1.0)}


def one_run(comm: MPI.Intracomm, policy: SyncPolicy, args: argparse.Namespace) -> dict[str, Any] | None:
    """One training run of `args.steps` updates; a worker's counts per round, None on a server."""
    servers, numel = args.servers, args.numel
    workers = comm.Get_size() - servers
    bounds = shard_bounds(numel, servers)
    shards = open_shards(comm, numel, servers, sends=None if args.window else policy.sent())
    rank = comm.Get_rank()
    result = None
    comm.Barrier()
    started = time.perf_counter()
    if rank < servers:
        start, stop = bounds[rank]
        server = Server(torch.zeros(stop - start), sgd(lr=0.1), policy, workers, steps=args.steps)
        run_server(server, shards[rank])
    else:
        mailbox = ShardedMailbox(shards, bounds, policy.pull_fraction, policy.pull_timeout)
        counts = mailbox.count(RmaCounts())
        target = torch.linspace(-1, 1, numel)
        slow = args.slow if mailbox.worker == workers - 1 else 1.0

        def grads(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
            jitter = random.Random(worker * 7919 + index).uniform(0.9, 1.1)
            time.sleep(args.compute * 1e-3 * slow * jitter)
            return params - target

        worker = Worker(mailbox.worker, policy, seed=1)
        run_worker(worker, mailbox, grads, torch.empty(numel))
        rounds = max(1, worker.steps)
        result = {
            "worker": mailbox.worker,
            "rounds": worker.steps,
            "round_trips": counts.round_trips / rounds,
            "protocol_round_trips": (counts.round_trips - counts.poll_trips) / rounds,
            "polls": counts.waits / rounds,
            "poll_round_trips": counts.poll_trips / rounds,
            "remote_ops": counts.remote_ops / rounds,
            "messages": (counts.ops["Isend"] + counts.ops["Irecv"]) / rounds,
            "MB": counts.data_bytes / rounds / 1e6,
        }
    elapsed = time.perf_counter() - started
    comm.Barrier()
    for shard in shards:
        shard.free()
    if result is not None:
        result["ms_per_update"] = 1e3 * elapsed / args.steps
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--numel", type=int, default=1 << 18)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--compute", type=float, default=5.0, help="ms a gradient takes")
    parser.add_argument("--slow", type=float, default=2.0, help="the last worker's gradient takes this many times")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--window", action="store_true", help="workers pull through the windows (no server-sent)")
    parser.add_argument("--only", nargs="*", default=None, help="policies to run (bsp, ssp, psp)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mpi_rounds.json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() <= args.servers:
        raise SystemExit(f"run with more than --servers={args.servers} ranks: mpiexec -n {args.servers + 2} ...")
    table = {k: v for k, v in policies(comm.Get_size() - args.servers).items() if not args.only or k in args.only}
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in table}
    shuffle = random.Random(0)
    for _ in range(args.repeats):
        order = list(table)
        shuffle.shuffle(order)
        for name in order:
            got = comm.gather(one_run(comm, table[name], args), root=0)
            if comm.Get_rank() == 0:
                runs[name].append([g for g in got if g is not None])
    if comm.Get_rank() != 0:
        return
    keys = ("round_trips", "protocol_round_trips", "polls", "poll_round_trips", "remote_ops", "messages", "MB")
    keys += ("ms_per_update",)
    summary = {
        name: {
            # Per worker (in worker order), each the median over the repeats.
            key: [statistics.median(rep[w][key] for rep in reps) for w in range(len(reps[0]))]
            for key in keys
        }
        for name, reps in runs.items()
    }
    out = {
        "command": f"mpiexec -n {comm.Get_size()} python benchmarks/mpi_rounds.py --servers {args.servers} "
        f"--numel {args.numel} --steps {args.steps} --compute {args.compute} --slow {args.slow} "
        f"--repeats {args.repeats}" + (" --window" if args.window else ""),
        "mpi": MPI.Get_library_version().splitlines()[0],
        "per_round": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"command": out["command"], "per_round": summary}, indent=2))


if __name__ == "__main__":
    main()
