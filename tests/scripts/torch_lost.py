"""A collsync.torch script under a server mode in which one worker stops itself (SIGSTOP) mid-run, for
tests/integration/test_torch_lost.py: `torch_lost.py SYNC RANK STEPS OUT`. Every process writes its pid to
OUT/pid-WORLD_RANK; `init(sync=SYNC, deadline=5)` reserves one server; worker RANK (its `rank()`) writes its pid to
OUT/stopped and stops at step 20; the others train STEPS steps, call `hvd.shutdown()` and print
`worker R: done lost=[...] hosts=[...] last=[...]` (what `opt.lost` names) and write it to OUT/done-R. The stopped
process never goes on: the test kills it. With a fifth argument `mark`, worker RANK only writes OUT/stopped at step 20
and trains on: the test cuts its host off instead (tests/cluster)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import collsync.torch as hvd

DEADLINE = 5.0


def main() -> None:
    sync, stop_rank, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    (out / f"pid-{MPI.COMM_WORLD.Get_rank()}").write_text(str(os.getpid()))  # the test sees each process end
    mode, _, variant = sync.partition("-")  # "ssp-own": ssp reading its own writes (stream=False)
    options = {"stream": False} if variant == "own" else {}
    hvd.init(sync=hvd.sync_config(mode, deadline=DEADLINE, **options), deadline=DEADLINE)
    me = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for step in range(steps):
        if step == 20 and me == stop_rank:
            (out / "stopped").write_text(str(os.getpid()))
            if sys.argv[5:] != ["mark"]:
                os.kill(os.getpid(), signal.SIGSTOP)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    hvd.shutdown()
    lost = sorted(w["rank"] for w in opt.lost)
    hosts = sorted({str(w["host"]) for w in opt.lost})
    line = f"worker {me}: done lost={lost} hosts={hosts} last={[w['last_update'] for w in opt.lost]}"
    (out / f"done-{me}").write_text(line)
    print(line, flush=True)


if __name__ == "__main__":
    main()
