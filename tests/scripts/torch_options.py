"""Options beside the mode init(sync="async") chose: DistributedOptimizer(..., penalty="gap_aware") trains on the
servers with Gap-Aware, and a value contradicting init's SyncConfig is refused naming both. Prints one line a worker."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import collsync.torch as hvd

hvd.init(sync=hvd.sync_config("async", quorum=1))
torch.manual_seed(hvd.rank())
model = torch.nn.Linear(4, 2)
sgd = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
try:
    hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), quorum=2)
except ValueError as exc:
    refused = str(exc)
opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), penalty="gap_aware")
for _ in range(5):
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    opt.step()
print(f"worker {hvd.rank()}: {opt.sync_mode} version {opt.version} refused: {refused}", flush=True)
