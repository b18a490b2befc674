"""Train a small network on handwritten digits, Horovod style, with any collsync sync mode.

    mpiexec -n 5 python examples/mnist.py --sync backup       # 5 workers, the first 4 gradients of each round
    mpiexec -n 5 python examples/mnist.py --sync async        # rank 0 serves, 4 asynchronous workers
    mpiexec -n 4 python examples/mnist.py --data fashion      # Fashion-MNIST (apt-get install dataset-fashion-mnist)
    mpiexec -n 4 python examples/mnist.py --mnist ~/data/mnist  # MNIST IDX files instead of the bundled digits

Switch to Horovod by changing the import line below to `import horovod.torch as hvd` (then only `--sync bsp`
applies). Data: scikit-learn's bundled 8x8 digits by default, Fashion-MNIST from Debian's package
dataset-fashion-mnist (`--data fashion`), or MNIST IDX files from a folder you already have; `--limit N` keeps the
first N training and N test images (a quick run). `--compute`, `--straggle` and `--every-epoch` are for
benchmarks/horovod_stragglers.py: a batch's compute time slept, stragglers injected the same way whichever import
line, and worker 0's test accuracy after each epoch. `--sampler torch` keeps torch's own DistributedSampler under
collsync too (a Horovod script with only its import line changed); the default, `hvd`, is collsync's, which in the
stream modes (async, ...) shares each epoch's batches by the workers' speed: the last line says how many batches
each worker took and how long the training loop ran.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import collsync.torch as hvd  # was: import horovod.torch as hvd

COLLSYNC = hvd.__name__.startswith("collsync")


def load(data: str, folder: str | None, seed: int, limit: int | None) -> tuple[TensorDataset, TensorDataset, int]:
    """The training and test sets as flat rows, and the number of features: `data` is digits, mnist (IDX files in
    `folder`) or fashion (Fashion-MNIST in `folder`, by default where Debian's package puts it)."""
    if data in ("mnist", "fashion"):
        from collsync.data import FASHION_MNIST_DIR, fashion_mnist, mnist

        try:
            read = fashion_mnist(folder or FASHION_MNIST_DIR) if data == "fashion" else mnist(folder or "")
        except (FileNotFoundError, ValueError) as e:  # one line, as collsync-train says it, not a traceback
            raise SystemExit(f"examples/mnist.py --data {data}: {e} (here: --mnist DIR)") from None
        x, y, xt, yt = read.x_train, read.y_train, read.x_test, read.y_test
    else:
        # scikit-learn's digits (what `sklearn.datasets.load_digits()` returns), read without importing it: 2.5 s
        # less start-up on every rank.
        from collsync.bundled import digits_arrays

        pixels, labels = digits_arrays()
        x = torch.tensor(pixels / 16.0, dtype=torch.float32)
        y = torch.tensor(labels, dtype=torch.long)
        order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
        cut = int(0.75 * len(y))
        x, y, xt, yt = x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]
    if limit is not None:  # the same first rows on every rank, whichever import line
        x, y, xt, yt = x[:limit], y[:limit], xt[:limit], yt[:limit]
    return TensorDataset(x.reshape(len(x), -1), y), TensorDataset(xt.reshape(len(xt), -1), yt), x[0].numel()


def build_model(name: str, features: int) -> nn.Module:
    """An MLP, or a small CNN on the square images (8x8 digits, 28x28 MNIST) unflattened."""
    if name == "mlp":
        return nn.Sequential(nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 10))
    side = int(round(features**0.5))
    return nn.Sequential(
        nn.Unflatten(1, (1, side, side)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (side // 4) ** 2, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def evaluate(model: nn.Module, test: TensorDataset) -> torch.Tensor:
    x, y = test.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", default="bsp", help="bsp | backup | async | ssp | psp (collsync only)")
    parser.add_argument("--backups", type=int, default=1, help="backup workers (--sync backup)")
    parser.add_argument(
        "--margin",
        default="auto",
        help="--sync backup: how long a round waits for the last b gradients: auto (from the measured arrivals), "
        "seconds, or none (drop b every round)",
    )
    parser.add_argument(
        "--pushes", type=int, default=None, help="--sync psp: c, the gradients a round takes (default: psp's fraction)"
    )
    parser.add_argument(
        "--stream",
        choices=["patient", "eager", "off"],
        default=None,
        help="--sync ssp: how a worker reads after its push. patient (ssp's default): every version is sent as "
        "published, and a worker holds out for the one its push makes for half its compute; eager: it never holds "
        "out (patience=None); off: it reads its own writes (stream=False)",
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02, help="per worker; scaled by size() as under Horovod")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn"], help="an MLP, or a small CNN")
    parser.add_argument(
        "--data",
        default=None,
        choices=["digits", "mnist", "fashion"],
        help="digits (bundled), mnist (IDX files in --mnist), fashion (Fashion-MNIST: Debian's package "
        "dataset-fashion-mnist, or its IDX files in --mnist); default: mnist where --mnist is given, else digits",
    )
    parser.add_argument(
        "--mnist", default=None, help="a folder with MNIST (or, --data fashion, Fashion-MNIST) IDX files"
    )
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training and N test images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute", type=float, default=0.0, help="seconds slept per batch (a larger model's)")
    parser.add_argument(
        "--straggle",
        default="none",
        choices=["none", "heavy", "slow"],
        help="heavy: 10%% of batches take 0.2 s more; slow: the last worker computes 3x as long (3 x --compute)",
    )
    parser.add_argument("--every-epoch", action="store_true", help="worker 0's test accuracy after each epoch")
    parser.add_argument(
        "--sampler",
        default="hvd",
        choices=["hvd", "torch"],
        help="under collsync: hvd (collsync.torch.DistributedSampler: in async and the other stream modes the "
        "workers share each epoch's batches by their speed) or torch (torch's own DistributedSampler, fixed shards: "
        "a Horovod script with only its import line changed); Horovod always uses torch's",
    )
    args = parser.parse_args()
    data = args.data or ("mnist" if args.mnist else "digits")
    if data == "mnist" and not args.mnist:
        parser.error("--data mnist reads the IDX files in --mnist DIR")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit {args.limit}: must be >= 1")
    if args.stream is not None and args.sync != "ssp":
        parser.error(f"--stream {args.stream}: only with --sync ssp (not --sync {args.sync})")

    options = {}
    if COLLSYNC:
        margin = None if args.margin == "none" else args.margin if args.margin == "auto" else float(args.margin)
        backup = {"backups": args.backups, "margin": margin}
        partial = {"pushes": args.pushes} if args.sync == "psp" and args.pushes is not None else {}
        stream = {"off": {"stream": False}, "eager": {"patience": None}}.get(args.stream or "patient", {})
        options = {"sync": args.sync, **(backup if args.sync == "backup" else {}), **partial}
        options.update(stream if args.sync == "ssp" else {})
        hvd.init(sync=args.sync)  # a parameter-server mode reserves rank 0 as the server here
    else:
        hvd.init()
    torch.manual_seed(args.seed)
    train, test, features = load(data, args.mnist, args.seed, args.limit)
    if COLLSYNC and args.sampler == "hvd":  # torch's sampler, or in the stream modes the batches shared by speed
        sampler = hvd.DistributedSampler(train, seed=args.seed, drop_last=True, batch_size=args.batch_size)
    else:
        sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = build_model(args.model, features)
    # Horovod's scaling for a mean of size() gradients; in the server modes collsync rescales it to the gradients
    # one update averages (collsync.torch.server_rule.server_lr: every mode trains with it unchanged), runs the momentum
    # per worker where an update is one gradient (async, as DANA) and looks ahead over SSP's stale rounds
    # (server_rule.server_momentum).
    lr = args.lr * hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), **options)

    draws = random.Random(args.seed * 7919 + hvd.rank())  # the same delays whichever import line
    slow = args.straggle == "slow" and hvd.rank() == hvd.size() - 1
    start = time.perf_counter()
    batches = 0  # this worker's steps: the same on every worker, except where the sampler shares batches by speed
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            batches += 1
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            straggle = 0.2 if args.straggle == "heavy" and draws.random() < 0.1 else 0.0
            time.sleep(args.compute * (3 if slow else 1) + straggle)
            optimizer.step()
        if hvd.rank() == 0:
            took = time.perf_counter() - start
            seen = f", test accuracy {evaluate(model, test):.4f} at {took:.3f} s" if args.every_epoch else ""
            print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}{seen}", flush=True)

    took = time.perf_counter() - start
    per_worker = hvd.allgather(torch.tensor([batches])).tolist()
    accuracy = evaluate(model, test)
    accuracy = hvd.allreduce(accuracy, op=hvd.Average)  # the workers' models differ under async modes
    counts = [float(getattr(optimizer, name, 0)) for name in ("dropped", "caught_up")]
    dropped, caught_up = hvd.allreduce(torch.tensor(counts), op=hvd.Sum).tolist()
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy.item():.4f} ({hvd.size()} workers, sync={args.sync})", flush=True)
        print(f"batches per worker: {', '.join(map(str, per_worker))} in {took:.3f} s", flush=True)
        if args.sync == "backup":
            print(f"gradients dropped: {int(dropped)}, rounds caught up: {int(caught_up)}", flush=True)


if __name__ == "__main__":
    main()
