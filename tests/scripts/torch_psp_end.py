"""PSP with c = n - 1 of n workers (at least 2), torch's fixed shards and the last worker 20x slower: the others
close every round without it, its round skips ahead, and each epoch they finish their batches first and wait in
the script's allreduce while it still has batches for rounds only it pushes to. Those rounds must not wait for
them (`Server.pushing`): every worker steps through its whole shard, and each epoch's allreduce and the script's
end come. Prints one line a worker; the default deadline (no timeout, no shorter deadline)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import collsync.torch as hvd

EPOCHS, BATCHES, ROWS = 2, 6, 4

workers = MPI.COMM_WORLD.Get_size() - 1  # rank 0 serves
hvd.init(sync=hvd.sync_config("psp", pushes=max(2, workers - 1)))
torch.manual_seed(0)
data = TensorDataset(torch.randn(workers * BATCHES * ROWS, 4), torch.randint(0, 2, (workers * BATCHES * ROWS,)))
sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), seed=0, drop_last=True)
loader = DataLoader(data, batch_size=ROWS, sampler=sampler, drop_last=True)
model = torch.nn.Linear(4, 2)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
slow = hvd.rank() == hvd.size() - 1
steps, seen = 0, []
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        time.sleep(0.1 if slow else 0.005)
        opt.step()
        steps += 1
    seen.append(int(hvd.allreduce(torch.tensor(steps), op=hvd.Sum).item()))  # every worker's steps so far
print(f"worker {hvd.rank()}: {steps} steps, allreduced {seen}, finished {opt.finished}", flush=True)
