"""A collsync.torch script in a server mode that saves the servers' state and resumes from it.

    mpiexec -n 3 python -m mpi4py tests/scripts/torch_resume.py --sync async --out F            # trains, saves F
    mpiexec -n 3 python -m mpi4py tests/scripts/torch_resume.py --sync async --resume F --out G  # goes on from F

The first run trains `--steps` steps and, on worker 0, saves `server_state_dict()` with `torch.save`. The second
loads it with `weights_only=True`, checks that every worker's model starts from the saved server parameters, trains
on and saves the servers' state again (its version must have gone on from the saved one).
"""

from __future__ import annotations

import argparse

import torch

import collsync.torch as hvd
from collsync.rules.lookahead import view_distance

MOMENTUM = 0.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sync", default="async")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--resume")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hvd.init(servers=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    saved = torch.load(args.resume, weights_only=True) if args.resume else None
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=MOMENTUM),
        model.named_parameters(),
        sync=args.sync,
        server_state=saved,
    )
    if saved is not None:
        # The workers' models start where the servers were when they were saved: async's momentum is DANA's
        # (server_rule.server_momentum), whose workers read the look-ahead theta - eta gamma sum_j v_j of the saved
        # state; ssp's the look-ahead over its stale rounds.
        start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        shard = saved["shards"][0]
        want = shard["params"]
        if args.sync == "async":
            _, total, eta = shard["opt_state"]
            want = want - (eta * MOMENTUM) * total
        if args.sync == "ssp":  # the look-ahead over stale rounds (rules.lookahead), by the saved staleness estimate
            v, horizon, eta = shard["opt_state"]
            assert horizon > 0, "ssp's saved staleness estimate is 0: nothing was stale"
            want = want - (eta * view_distance(MOMENTUM, horizon)) * v
        assert torch.equal(start, want), "the model did not start from the saved servers"
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(args.steps):
        x = torch.randn(16, 8, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if hvd.rank() == 0:
        state = opt.server_state_dict()
        if saved is not None:
            before, after = saved["shards"][0]["version"], state["shards"][0]["version"]
            assert after > before, f"the servers' version went from {before} to {after}"
        torch.save(state, args.out)
        print(f"saved version {state['shards'][0]['version']}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
