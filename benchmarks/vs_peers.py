"""collsync.torch against its peers on the same work, interleaved rep by rep in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/vs_peers.py
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/vs_peers.py
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/vs_peers.py --tiny     # the CI smoke run

Every side trains its own copy of the same MLP (same initial weights, same batches, plain SGD) for `--steps`
steps per rep: `loop` is the baseline (backward, one mpi4py Allreduce of the flat gradient, SGD by hand);
`collsync` is `collsync.torch.DistributedOptimizer` (sync=bsp: buckets reduced on a thread while backward runs);
`backup` is the same with sync=backup, backups=0 (the partial allreduce at full quorum: one allreduce a step);
`horovod` is `horovod.torch.DistributedOptimizer` (skipped, and said so, when Horovod is not built); `ddp` is
torch's DistributedDataParallel on gloo. Reported per model size: median ms per step (of the slowest rank) and its
ratio to `loop`, and the median over reps of each rep's ratio to the loop's rep beside it. The only assertion:
every side ends with the baseline's parameters (within float32 rounding), so a fast but wrong side cannot win.
Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import collsync.torch as cst

SIZES = {"100k": [1400], "5M": [2200, 2200]}  # hidden widths of an MLP on 8x8 digits-sized inputs (64 -> ... -> 10)


def mlp(hidden: list[int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = 64
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, 10))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="2 reps of 2 steps on the small model (CI)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = {"tiny": [8]} if args.tiny else SIZES
    if args.tiny:
        args.steps, args.reps = 2, 2
    cst.init()
    comm = MPI.COMM_WORLD  # no servers: the workers are the whole world
    rank, n = comm.Get_rank(), comm.Get_size()
    have_horovod = importlib.util.find_spec("horovod") is not None
    if have_horovod:
        import horovod.torch as hvd

        hvd.init(comm=comm)
    # DDP's rendezvous at rank 0: its host name where the ranks span hosts (127.0.0.1 there is each host's own).
    names = comm.allgather(socket.gethostname())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1" if len(set(names)) == 1 else names[0])
    os.environ["MASTER_PORT"] = str(comm.bcast(29500 + os.getpid() % 1000 if rank == 0 else None))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=n)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(args.batch, 64, generator=g) for _ in range(args.steps)]
    ys = [torch.randint(0, 10, (args.batch,), generator=g) for _ in range(args.steps)]
    results: dict = {
        "command": f"mpiexec -n {n} python benchmarks/vs_peers.py --steps {args.steps} --reps {args.reps} "
        f"--batch {args.batch}" + (" --tiny" if args.tiny else ""),
        "ranks": n,
        "horovod": have_horovod,
        "load_before": list(os.getloadavg()),
        "sizes": {},
    }
    for size, hidden in sizes.items():
        sides: dict[str, tuple[nn.Module, Callable[[], None]]] = {}

        loop_model = mlp(hidden)
        flat = torch.zeros(sum(p.numel() for p in loop_model.parameters()))

        def loop_step(model: nn.Module = loop_model, flat: torch.Tensor = flat) -> None:
            grads = [p.grad for p in model.parameters()]
            torch.cat([gr.reshape(-1) for gr in grads], out=flat)
            comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
            flat.div_(n)
            offset = 0
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(flat[offset : offset + p.numel()].view_as(p), alpha=-0.01)
                    offset += p.numel()

        sides["loop"] = (loop_model, loop_step)
        for name, sync in (("collsync", "bsp"), ("backup", "backup")):
            model = mlp(hidden)
            options = {"backups": 0} if sync == "backup" else {}
            opt = cst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), sync=sync, **options)
            sides[name] = (model, opt.step)
        if have_horovod:
            model = mlp(hidden)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
            )
            sides["horovod"] = (model, opt.step)
        ddp = nn.parallel.DistributedDataParallel(mlp(hidden))
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        sides["ddp"] = (ddp, ddp_opt.step)

        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(args.reps):
            for name, (model, step) in sides.items():
                comm.Barrier()
                start = time.perf_counter()
                for x, y in zip(xs, ys, strict=True):
                    for p in model.parameters():
                        p.grad = None
                    F.cross_entropy(model(x), y).backward()
                    step()
                times[name].append((time.perf_counter() - start) / args.steps)
        base = [p.detach() for p in sides["loop"][0].parameters()]
        for name, (model, _) in sides.items():
            for a, b in zip(model.parameters(), base, strict=True):
                torch.testing.assert_close(a.detach(), b, rtol=1e-4, atol=1e-5, msg=f"{name} != loop ({size})")
        # The slowest rank sets the pace of every rep; each rep's ratio is taken against the loop's rep beside it.
        reps = {k: [comm.allreduce(t, op=MPI.MAX) for t in v] for k, v in times.items()}
        worst = {k: statistics.median(v) for k, v in reps.items()}
        params = sum(p.numel() for p in loop_model.parameters())
        results["sizes"][size] = {
            "params": params,
            "ms_per_step": {k: 1e3 * v for k, v in worst.items()},
            "ratio_to_loop": {k: v / worst["loop"] for k, v in worst.items()},
            "ratio_median_of_reps": {
                k: statistics.median(a / b for a, b in zip(v, reps["loop"], strict=True)) for k, v in reps.items()
            },
            "ms_each_rep": {k: [1e3 * t for t in v] for k, v in reps.items()},
        }
        if rank == 0:
            row = ", ".join(f"{k} {1e3 * v:.2f} ms ({v / worst['loop']:.2f}x)" for k, v in worst.items())
            print(f"-n {n}, {params:,} params: {row}", flush=True)
    if not have_horovod and rank == 0:
        print("vs_peers: Horovod is not built here (bash scripts/setup_horovod.sh): no horovod column", flush=True)
    results["load_after"] = list(os.getloadavg())
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
