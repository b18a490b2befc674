"""A Horovod-style script in which one worker fails mid-training: `python torch_raise.py SYNC [RANK] [STEP] [HOW]`.

Worker RANK (default 1) ends its script at step STEP (default 5), HOW being `error` (default: it raises
`RuntimeError`), `exit` (`sys.exit(3)`) or `raise` (`raise SystemExit(3)`); the others go on into their next
collective or round. The job must end within seconds, naming the rank, with status 1 (an error) or 3, whatever the
deadline (tests/integration/test_torch_failure.py runs it at the default one). Without the failure every worker
trains 400 steps and prints "done"."""

from __future__ import annotations

import sys

import torch

import collsync.torch as hvd

EXIT_STATUS = 3


def fail(failing: int, step: int, how: str) -> None:
    if how == "exit":
        sys.exit(EXIT_STATUS)
    if how == "raise":
        raise SystemExit(EXIT_STATUS)
    raise RuntimeError(f"worker {failing} fails at step {step}")


def main() -> None:
    sync = sys.argv[1]
    failing = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    at = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    how = sys.argv[4] if len(sys.argv) > 4 else "error"
    hvd.init(sync=sync)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(400):
        if hvd.rank() == failing and step == at:
            fail(failing, step, how)
        opt.zero_grad()
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
    print(f"done {hvd.rank()}", flush=True)


if __name__ == "__main__":
    main()
