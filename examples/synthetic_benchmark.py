"""Images per second of data-parallel training on synthetic data, printed the way Horovod's synthetic benchmark
prints them, for any collsync sync mode.

    mpiexec -n 4 python examples/synthetic_benchmark.py                 # full sync (bsp)
    mpiexec -n 5 python examples/synthetic_benchmark.py --sync async    # rank 0 serves, 4 workers

Switch to Horovod by changing the import line below to `import horovod.torch as hvd` (then `--sync` is ignored).
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import collsync.torch as hvd  # was: import horovod.torch as hvd

COLLSYNC = hvd.__name__.startswith("collsync")


def model_of(name: str) -> nn.Module:
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 1000),
        )  # fmt: skip
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.ReLU(), nn.Linear(1024, 1000))
    raise SystemExit(f"synthetic_benchmark: --model {name!r} must be cnn or mlp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="mlp or cnn (on 3x32x32 images, 1000 classes)")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--num-warmup-batches", type=int, default=2, help="batches before timing starts")
    parser.add_argument("--num-batches-per-iter", type=int, default=5, help="batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=5, help="benchmark iterations")
    parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression of the allreduce")
    parser.add_argument("--sync", default="bsp", help="bsp | backup | async | ssp | psp (collsync only)")
    args = parser.parse_args()

    if COLLSYNC:
        hvd.init(sync=args.sync)
    else:
        hvd.init()
    torch.manual_seed(0)
    model = model_of(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    options = {"sync": args.sync} if COLLSYNC else {}
    if COLLSYNC and args.sync != "bsp":
        compression = hvd.Compression.none  # compression belongs to the allreduce of full sync
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression, **options
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(args.batch_size, 3, 32, 32)
    target = torch.randint(0, 1000, (args.batch_size,))

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(s: str) -> None:
        if hvd.rank() == 0:
            print(s, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {hvd.size()}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for x in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")


if __name__ == "__main__":
    main()
