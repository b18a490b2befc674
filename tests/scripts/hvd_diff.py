"""One training script, two implementations: `--impl horovod` imports horovod.torch, `--impl collsync` imports
collsync.torch (sync=bsp). 20 steps of SGD with momentum on a float64 MLP, seeded data per rank; rank 0 saves the
final parameters of each case (`--case all`: every one, in one launch) to `--out`.
tests/integration/test_torch_launch.py compares the two."""

from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--impl", choices=["horovod", "collsync"], required=True)
parser.add_argument("--case", choices=["all", "plain", "passes", "predivide", "fp16", "sum"], default="all")
parser.add_argument("--backend", default="mpi")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--out", required=True)
args = parser.parse_args()

hvd = importlib.import_module(f"{args.impl}.torch")
if args.impl == "collsync":
    hvd.init(backend=args.backend)
else:
    hvd.init()
torch.set_default_dtype(torch.float64)
CASES = ["plain", "passes", "predivide", "fp16", "sum"]


def train(case: str) -> list[torch.Tensor]:
    torch.manual_seed(1234 + hvd.rank())  # different initial weights per rank: broadcast_parameters must fix them
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    kwargs: dict = {}
    passes = 1
    if case == "passes":
        kwargs["backward_passes_per_step"] = passes = 2
    elif case == "predivide":
        kwargs["gradient_predivide_factor"] = 2.0
    elif case == "fp16":
        kwargs["compression"] = hvd.Compression.fp16
    elif case == "sum":
        kwargs["op"] = hvd.Sum
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)
    data = torch.Generator().manual_seed(99 + hvd.rank())
    for _ in range(args.steps):
        opt.zero_grad()
        for _pass in range(passes):
            x = torch.randn(8, 12, generator=data)
            y = torch.randint(0, 3, (8,), generator=data)
            F.cross_entropy(model(x), y).backward()
        opt.step()
    if hasattr(opt, "close"):
        opt.close()  # collsync: release this optimizer before the next case builds one
    return [p.detach().clone() for p in model.parameters()]


results = {case: train(case) for case in (CASES if args.case == "all" else [args.case])}
if hvd.rank() == 0:
    torch.save(results, args.out)
