"""A user's script with SpecSync through collsync.torch: the run `collsync-train <overrides>` makes (same model,
data, batches, seed and server rule), each worker sleeping the straggler model's draws (x `--time-scale`) as its
computation: half before the forward pass, half between forward and backward, so that a re-sync finds the step at
a forward or a backward safe point.

`--form`: how the script takes aborts. `wrapper`: `hvd.speculative(step)` re-runs the step; `closure`:
`opt.step(closure)` re-runs the closure; `plain`: a Horovod loop, `opt.aborted` says a step threw its gradient
away, and the loop draws the next batch until it has pushed its share. Each worker pushes `steps / size()`
gradients. Worker 0 writes `--out` (JSON): each worker's attempts (batch, version the attempt ran on, how far it
got), aborts and counts, the scheduler's counts, and the test accuracy.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import collsync.torch as hvd
from collsync.cli import CONF_DIR
from collsync.data import Batches
from collsync.train import build

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--form", choices=("wrapper", "closure", "plain"), default="wrapper")
parser.add_argument("--time-scale", type=float, default=0.02)
parser.add_argument("overrides", nargs="*")
args = parser.parse_args()
with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
    cfg = compose("config", overrides=args.overrides)
config = hvd.from_config(cfg)
hvd.init(sync=config)
torch.manual_seed(int(cfg.seed))
parts = build(cfg)
model = parts.model
w = hvd.rank()
batches = Batches(parts.data, hvd.size(), int(cfg.batch_size), int(cfg.seed))
sampler = parts.stragglers.sampler(hvd.size(), int(cfg.seed))
opt = torch.optim.SGD(model.parameters(), lr=0.1)  # a placeholder: the server applies the config's rule
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), sync=config)
attempts: list[dict] = []  # one per run of a step's computation: batch, version, where it got to


def compute(j: int) -> torch.Tensor:
    """Batch j's forward and backward on the model as it is, with the injected delay around the forward pass."""
    x, y = batches.batch(w, j)
    delay = (sampler.compute_time(w, j) + sampler.message_delay(w, j)) * args.time_scale
    attempt = {"batch": j, "version": opt.version, "finished": opt.finished, "reached": "forward"}
    attempts.append(attempt)
    time.sleep(delay / 2)
    loss = F.cross_entropy(model(x), y)
    attempt["reached"] = "backward"
    time.sleep(delay / 2)
    loss.backward()
    attempt["reached"] = "step"
    return loss


@hvd.speculative
def train_step(j: int) -> None:
    opt.zero_grad()
    compute(j)
    opt.step()
    attempts[-1]["reached"] = "pushed"


steps = int(cfg.steps) // hvd.size()
thrown = 0  # plain form: steps whose gradient step() threw away
j = pushed = 0  # the plain form draws the next batch after a thrown one, until `steps` gradients were pushed
while pushed < steps:
    if args.form == "wrapper":
        train_step(j)
    elif args.form == "closure":

        def closure(j: int = j) -> torch.Tensor:
            opt.zero_grad()
            return compute(j)

        opt.step(closure)
        attempts[-1]["reached"] = "pushed"
    else:
        opt.zero_grad()
        compute(j)
        opt.step()
        thrown += opt.aborted
        attempts[-1]["reached"] = "thrown" if opt.aborted else "pushed"
        pushed -= opt.aborted
    pushed += 1
    j += 1

opt.close()  # the scheduler's counts reach every worker here
x, y = parts.data.x_test, parts.data.y_test
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean()
accuracy = hvd.allreduce(accuracy, op=hvd.Average)  # each worker's model is its last pull
mine = {"attempts": attempts, "thrown": thrown, "specsync": opt.specsync, "version": opt.version}
everyone = hvd.allgather_object(mine)
if w == 0:
    with open(args.out, "w") as f:
        json.dump({"workers": everyone, "accuracy": accuracy.item(), "size": hvd.size()}, f)
