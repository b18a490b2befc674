"""A collective that one worker never calls: workers 0 and 2 (of 3) call an allreduce, worker 1 does not.

    mpiexec -n 3 python tests/scripts/torch_stall.py silent      # worker 1 computes (sleeps) meanwhile
    mpiexec -n 3 python tests/scripts/torch_stall.py elsewhere   # worker 1 waits in a barrier meanwhile
    mpiexec -n 3 python tests/scripts/torch_stall.py elsewhere named   # the allreduce is named: met by name

The stall check (`collsync.torch._stall`) names worker 1 after HOROVOD_STALL_CHECK_TIME_SECONDS and ends the job
after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; tests/integration/test_torch_stall.py runs it.
"""

from __future__ import annotations

import sys
import time

import torch

import collsync.torch as hvd

hvd.init()
x = torch.ones(3)
hvd.allreduce(x)
hvd.allgather(x)
if hvd.rank() != 1:
    hvd.allreduce(x, name="third" if sys.argv[2:] == ["named"] else None)
elif sys.argv[1] == "silent":
    time.sleep(600)
else:
    hvd.barrier()
print(f"worker {hvd.rank()} went past the stall", flush=True)
