"""A bsp `collsync.torch` script in Horovod's shape whose worker VICTIM kills itself (SIGKILL) at step AT, before
its backward pass: under ULFM (`mpirun --with-ft ulfm`) the others go on in place (tests/integration/test_ulfm.py).

    torch_shrink.py STEPS VICTIM AT

Each worker prints `started RANK` once, and at the end one line `done RANK steps=... size=... lost=[...]
params=... epoch0={"before": [...], "after": [...]}`: the steps it took, the world's size then, `opt.lost`'s ranks,
a checksum of its parameters (the survivors' must agree), and the samples it was handed in epoch 0 before and
after the loss (the test checks that the shards after it are disjoint and cover what no worker had)."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import collsync.torch as hvd

hvd.init()
steps, victim, at = (int(a) for a in sys.argv[1:4])
me = hvd.rank()
print(f"started {me}", flush=True)
torch.manual_seed(0)
data = TensorDataset(torch.randn(960, 10), torch.randint(0, 3, (960,)), torch.arange(960))
sampler = hvd.DistributedSampler(data, batch_size=8)
loader = DataLoader(data, batch_size=8, sampler=sampler)
model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), named_parameters=model.named_parameters()
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
done, epoch = 0, 0
before: list[int] = []  # epoch 0's samples handed to this worker before the loss, and after it
after: list[int] = []
while done < steps:
    sampler.set_epoch(epoch)
    for x, y, index in loader:
        if me == victim and done == at:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if epoch == 0:  # after the step: the world has shrunk by then if this step lost a worker
            (before if done <= at else after).extend(index.tolist())
        done += 1
        if done == steps:
            break
    epoch += 1
checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
print(
    f"done {me} steps={done} size={hvd.size()} lost={[x['rank'] for x in opt.lost]} params={checksum:.12g} "
    f"epoch0={json.dumps({'before': before, 'after': after})}",
    flush=True,
)
