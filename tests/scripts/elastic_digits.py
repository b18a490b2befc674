"""An elastic training script in the style of Horovod's examples/elastic/pytorch/pytorch_mnist_elastic.py, on
scikit-learn's digits (8x8 images, 10 classes): `@hvd.elastic.run`, `hvd.elastic.TorchState` holding the model, the
optimizer, an `ElasticSampler` and the epoch, `record_batch`, `commit()`, `set_epoch` at an epoch's end, and a reset
callback rescaling the learning rate by `hvd.size()`. It runs with one import changed:

    mpiexec -n 4 python -m mpi4py tests/scripts/elastic_digits.py --impl horovod --log L
    collsync-run -n 4 --max-restarts 1 -- python -m mpi4py tests/scripts/elastic_digits.py --impl collsync --log L
    mpirun --with-ft ulfm -n 4 python -m mpi4py tests/scripts/elastic_digits.py --impl collsync --log L

Each rank appends to `L/size<N>-rank<R>.jsonl` (N, R: as it started) one line per batch it trained (epoch, the
step, the dataset indices), one per commit and one each time `train` starts (again after a rank was lost in place
under ULFM), and rank 0 writes the test accuracy to `L/accuracy-size<N>.json` at the end (N: the size then).
`--sleep` slows each step, so that a test can kill a rank mid-epoch. `--metric` averages each step's loss with the
script's own `hvd.allreduce`, as Horovod's examples average their metrics; `--die R:S:WHERE` has the rank that
started as R kill itself (SIGKILL) at step S, where the failure is first seen by a collective other than the
optimizer's: `metric` (after the step, before the loss's allreduce) or `reset` (inside the reset callback, so the
survivors see it in `sync()`'s broadcasts; S is then the step it was restored to).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's usual name
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TRAIN = 1536  # divisible by 4 and 3: the batches of a whole epoch line up on 4 ranks and on 3


class IndexedDigits(TensorDataset):
    """Digits with each sample's dataset index, so that the log can show which samples each step trained on."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return (*super().__getitem__(index), torch.tensor(index))


def data() -> tuple[IndexedDigits, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(x, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(y)[order]
    return IndexedDigits(x[:TRAIN], y[:TRAIN]), x[TRAIN:], y[TRAIN:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["collsync", "horovod"], default="collsync")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.5)
    ap.add_argument("--batches-per-commit", type=int, default=4)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--log", required=True)
    ap.add_argument("--metric", action="store_true")
    ap.add_argument("--die", action="append", default=[], help="R:S:WHERE (metric or reset), repeatable")
    args = ap.parse_args()
    deaths = {(where, int(step)): int(rank) for rank, step, where in (d.split(":") for d in args.die)}
    hvd: Any = importlib.import_module(f"{args.impl}.torch")  # the one line that differs from Horovod's script

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    log = Path(args.log)
    log.mkdir(parents=True, exist_ok=True)
    out = open(log / f"size{hvd.size()}-rank{hvd.rank()}.jsonl", "a", buffering=1)  # noqa: SIM115
    started_as = hvd.rank()

    def die_at(where: str, step: int) -> None:
        if deaths.get((where, step)) == started_as:
            os.kill(os.getpid(), signal.SIGKILL)

    train_dataset, test_x, test_y = data()
    train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=1)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    @hvd.elastic.run
    def train(state: Any) -> None:
        if hvd.rank() == 0:
            print(f"elastic_digits: start at epoch {state.epoch} step {state.step} on {hvd.size()}", flush=True)
        out.write(json.dumps({"start": state.step, "epoch": state.epoch, "size": hvd.size()}) + "\n")
        for epoch in range(state.epoch, args.epochs):
            state.model.train()
            for _, (x, y, index) in enumerate(train_loader):
                state.optimizer.zero_grad()
                loss = F.cross_entropy(state.model(x), y)
                loss.backward()
                state.optimizer.step()
                state.step += 1
                if args.metric:
                    die_at("metric", state.step)
                    hvd.allreduce(loss.detach(), name="loss")
                out.write(json.dumps({"epoch": epoch, "step": state.step, "indices": index.tolist()}) + "\n")
                state.train_sampler.record_batch(0, args.batch_size)
                if state.step % args.batches_per_commit == 0:
                    state.commit()
                    out.write(json.dumps({"commit": state.step, "epoch": epoch}) + "\n")
                time.sleep(args.sleep)
            state.epoch = epoch + 1
            state.train_sampler.set_epoch(state.epoch)  # at the end of the epoch, as Horovod says
            state.commit()  # a relaunch from here starts the next epoch
            out.write(json.dumps({"commit": state.step, "epoch": state.epoch}) + "\n")

    def on_state_reset() -> None:
        die_at("reset", state.step)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=0, step=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)

    model.eval()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    accuracy = hvd.allreduce(torch.tensor(accuracy), name="accuracy").item()
    if hvd.rank() == 0:
        (log / f"accuracy-size{hvd.size()}.json").write_text(json.dumps({"accuracy": accuracy, "step": state.step}))
        print(f"elastic_digits: accuracy {accuracy:.4f} after {state.step} steps", flush=True)
    out.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
