"""A Horovod-style script in which one worker exits mid-training: `python torch_exit.py SYNC HOW [STATUS]`.

Worker 1 ends its script at step 5 with STATUS (default 3), HOW being `sys.exit` or `raise` (`raise SystemExit`);
the others go on into their next collective. The job must end within seconds with that status, naming the rank
(tests/integration/test_torch_failure.py runs it at the default deadline). With STATUS 0 worker 1 leaves early and
the others would wait for it: the test does not use that."""

from __future__ import annotations

import sys

import torch

import collsync.torch as hvd


def main() -> None:
    sync, how = sys.argv[1], sys.argv[2]
    status = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    hvd.init(sync=sync)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(400):
        if hvd.rank() == 1 and step == 5:
            if how == "raise":
                raise SystemExit(status)
            sys.exit(status)
        opt.zero_grad()
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
    print(f"done {hvd.rank()}", flush=True)


if __name__ == "__main__":
    main()
