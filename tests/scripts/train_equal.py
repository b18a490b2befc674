"""The run `collsync-train <overrides>` makes, written as a user's own script through collsync.torch and
`from_config`: same model, data, batches, seed and server rule. Worker 0 saves the final flat parameters to
`--out`. tests/integration/test_torch_launch.py compares them with collsync-train's params.pt."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import collsync.torch as hvd
from collsync.cli import CONF_DIR
from collsync.data import Batches
from collsync.train import build

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("overrides", nargs="*")
args = parser.parse_args()
with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
    cfg = compose("config", overrides=args.overrides)
config = hvd.from_config(cfg)
hvd.init(sync=config)
torch.manual_seed(int(cfg.seed))
parts = build(cfg)
model = parts.model
batches = Batches(parts.data, hvd.size(), int(cfg.batch_size), int(cfg.seed))
opt = torch.optim.SGD(model.parameters(), lr=0.1)  # a placeholder: the server applies the config's rule
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), sync=config)
for step in range(int(cfg.steps)):
    x, y = batches.batch(hvd.rank(), step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
if hvd.rank() == 0:
    torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), args.out)
