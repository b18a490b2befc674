"""Asynchronous throughput against the number of parameter-server shards: M = 1, 2, 4 servers, the same workers.

    python benchmarks/mpi_shards_scaling.py                    # 5M float32 parameters, 4 workers, M = 1, 2, 4
    python benchmarks/mpi_shards_scaling.py --tiny             # the CI smoke run (1,000 parameters, M = 1, 2)

Each launch is `mpiexec -n W+M` of this script's `--inner` mode: ranks 0..M-1 serve one block each of the flat
parameters (`runtime.mpi_shards.Shards`, `loops.run_server`, async SGD, `--updates` updates), the W workers run
`loops.run_worker` with a gradient that costs one multiply (the server side is what is measured, not backward).
The M values are alternated launch by launch over `--repeats`. Reported per M, medians over the repeats:

* updates/s (every update is one gradient applied to every block) and bytes/s (each update moves one push and one
  pull of the whole model), and their ratio to M = 1 measured in the same run;
* per-update server time: each server rank's CPU seconds (`time.thread_time`, so waiting and sleeping are left
  out) per update, the slowest shard's; and per-update worker time, CPU seconds per gradient;
* a model of a cluster with one core per rank, where the shards run in parallel and the workers too:
  updates/s = min(1 / server time per update, W / worker time per update), and its ratio to M = 1.

Here W + M ranks share the machine's cores (`oversubscribed` in the JSON says by how much), so the measured rates
are what an oversubscribed node gives; the model is what the per-update costs would give with a core each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def inner(numel: int, servers: int, updates: int) -> None:
    import torch
    from mpi4py import MPI

    from collsync.loops import Worker, run_server, run_worker
    from collsync.policy import asynchronous
    from collsync.rules import sgd
    from collsync.runtime.mpi_shards import Shards
    from collsync.server import Server

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    workers = world.Get_size() - servers
    policy = asynchronous()
    shards = Shards(world, numel, servers)
    world.Barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    if shards.serving:
        block = shards.block
        server = Server(torch.zeros(block.stop - block.start), sgd(lr=1e-3), policy, workers, steps=updates)
        run_server(server, shards.own)
        count = server.version
        final = server.params.clone()
    else:
        mailbox = shards.worker_mailbox()
        worker = Worker(mailbox.worker, policy)
        direction = torch.randn(numel, generator=torch.Generator().manual_seed(mailbox.worker))
        params = torch.zeros(numel)
        count = run_worker(worker, mailbox, lambda p, w, j: direction * 1e-3, params)
        final = None
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    shards.close()
    rows = world.gather({"serving": shards.serving, "count": count, "wall_s": wall, "cpu_s": cpu}, root=0)
    blocks = world.gather(final, root=0)
    if world.Get_rank() == 0:
        if any(b is None or not torch.isfinite(b).all() for b in blocks[:servers]):
            raise SystemExit("mpi_shards_scaling: a shard ended with non-finite parameters")
        print("RESULT " + json.dumps(rows), flush=True)


def launch(numel: int, servers: int, workers: int, updates: int) -> dict[str, float]:
    argv = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(workers + servers), sys.executable, __file__]
    argv += ["--inner", "--numel", str(numel), "--servers", str(servers), "--updates", str(updates)]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"mpi_shards_scaling: M={servers} failed:\n{proc.stderr[-2000:]}")
    rows = json.loads(lines[-1][len("RESULT ") :])
    serving = [r for r in rows if r["serving"]]
    working = [r for r in rows if not r["serving"]]
    applied = serving[0]["count"]
    span = max(r["wall_s"] for r in serving)
    bytes_per_update = 2 * 4 * numel  # one push and one pull of the whole model, float32
    server_cpu = max(r["cpu_s"] / r["count"] for r in serving)
    worker_cpu = statistics.mean(r["cpu_s"] / max(1, r["count"]) for r in working)
    return {
        "updates": applied,
        "wall_s": span,
        "updates_per_s": applied / span,
        "bytes_per_s": applied * bytes_per_update / span,
        "server_cpu_s_per_update": server_cpu,
        "worker_cpu_s_per_update": worker_cpu,
        "modelled_updates_per_s": min(1 / server_cpu, len(working) / worker_cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=5_000_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="1,000 parameters, 2 workers, M = 1, 2, 20 updates, once")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "mpi_shards_scaling.json")
    args = parser.parse_args()
    if args.inner:
        inner(args.numel, args.servers[0], args.updates)
        return
    if args.tiny:
        args.numel, args.workers, args.servers, args.updates, args.repeats = 1000, 2, [1, 2], 20, 1
    runs: dict[int, list[dict[str, float]]] = {m: [] for m in args.servers}
    load_before = list(os.getloadavg())
    for _ in range(args.repeats):
        for m in args.servers:  # alternated launch by launch: the machine's load changes under a fixed order
            runs[m].append(launch(args.numel, m, args.workers, args.updates))
    cores = os.cpu_count() or 1
    rows: dict[str, dict[str, float]] = {}
    for m, reps in runs.items():
        rows[str(m)] = {key: statistics.median(r[key] for r in reps) for key in reps[0]}
        rows[str(m)]["ranks"] = args.workers + m
        rows[str(m)]["oversubscribed"] = (args.workers + m) / cores
    first = rows[str(args.servers[0])]
    for row in rows.values():
        row["updates_per_s_vs_1"] = row["updates_per_s"] / first["updates_per_s"]
        row["modelled_vs_1"] = row["modelled_updates_per_s"] / first["modelled_updates_per_s"]
    result = {
        "command": f"python benchmarks/mpi_shards_scaling.py --numel {args.numel} --workers {args.workers} "
        f"--servers {' '.join(map(str, args.servers))} --updates {args.updates} --repeats {args.repeats}"
        + (" --tiny" if args.tiny else ""),
        "cores": cores,
        "workers": args.workers,
        "numel": args.numel,
        "load_before": load_before,
        "load_after": list(os.getloadavg()),
        "servers": rows,
        "each_launch": {str(m): reps for m, reps in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for m, row in rows.items():
        print(
            f"M={m} ({row['ranks']} ranks on {cores} cores): {row['updates_per_s']:.1f} updates/s "
            f"({row['updates_per_s_vs_1']:.2f}x), {row['bytes_per_s'] / 1e9:.2f} GB/s; server "
            f"{1e3 * row['server_cpu_s_per_update']:.2f} ms CPU/update, modelled one core per rank "
            f"{row['modelled_updates_per_s']:.1f} updates/s ({row['modelled_vs_1']:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
