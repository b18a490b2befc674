"""A collsync.torch script in which one rank stops itself (SIGSTOP) at a chosen point, for tests/integration/
test_lost_rank.py: `lost_rank.py WHERE SYNC RANK OUT` with WHERE one of init (before `init()`), windows (before
`DistributedOptimizer`, which sets up the mode's windows or reduction thread), step (at the third step) or end (at
`shutdown()`). The stopped rank first writes its pid to OUT/stopped so that the test can end it. With a fifth
argument `signals`, every rank writes its pid to OUT/pid-RANK, turns stop signals into requests as collsync-train
does (`checkpoint.install`) and waits up to 60 s (not 3) for a lost rank."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from mpi4py import MPI  # MPI_Init first: a rank stopped before it would hold every rank's MPI_Init

import collsync.torch as hvd
from collsync import checkpoint

DEADLINE = 3.0


def main() -> None:
    where, sync, stop_rank, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    me = MPI.COMM_WORLD.Get_rank()
    deadline = DEADLINE
    if sys.argv[5:] == ["signals"]:
        checkpoint.install()
        deadline = 60.0
        (out / f"pid-{me}").write_text(str(os.getpid()))

    def stop(at: str) -> None:
        if where == at and me == stop_rank:
            (out / "stopped").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)

    stop("init")
    hvd.init(deadline=deadline)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stop("windows")
    options = {"backups": 1} if sync == "backup" else {}
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), sync=sync, deadline=deadline, **options
    )
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for step in range(20):
        if step == 3:
            stop("step")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    stop("end")
    hvd.shutdown()
    print(f"rank {me}: done", flush=True)


if __name__ == "__main__":
    main()
