"""The default configs train, and a policy's default optimizer never overrides what the user chose.

Each sync policy may pick its own default optimizer (conf/sync/*.yaml: async takes DANA with the Gap-Aware penalty
counted in rounds of N updates, DANA-GA at eta_max = N x lr; ssp the look-ahead momentum, bfasgd FASGD), because
heavy momentum on top of the implicit momentum of staleness does not train (benchmarks/README.md, "Defaults that
train"). These tests pin both halves of that: the choice itself, and that
`optimizer=`, `method=` and `penalty=` on the command line still win. Then each policy trains at its full defaults
(8 simulated workers, 300 updates) for one seed: a change of a default that stops a policy training fails here, in
about half a minute.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from collsync.cli import CONF_DIR
from collsync.train import run

MOMENTUM, DANA, SGD, FASGD, LOOKAHEAD = (
    f"collsync.rules.{name}" for name in ("momentum", "dana", "sgd", "fasgd", "lookahead")
)
NONE, STALENESS_AWARE, GAP_AWARE = (f"collsync.rules.{n}" for n in ("identity", "staleness_aware", "gap_aware"))


def config(*overrides: str) -> DictConfig:
    """The config `collsync-train OVERRIDES` composes (the same defaults list and override rules as the CLI)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    ("overrides", "optimizer", "penalty"),
    [
        ([], MOMENTUM, NONE),
        (["sync=bsp"], MOMENTUM, NONE),
        (["sync=backup"], MOMENTUM, NONE),
        (["sync=psp"], MOMENTUM, NONE),
        (["sync=async"], DANA, GAP_AWARE),  # DANA-GA, the Gap in rounds (conf/optimizer/dana_ga_round.yaml)
        (["sync=ssp"], LOOKAHEAD, NONE),
        (["sync=bfasgd"], FASGD, NONE),
    ],
    ids=["default", "bsp", "backup", "psp", "async", "ssp", "bfasgd"],
)
def test_each_policy_brings_its_default_optimizer(overrides, optimizer, penalty):
    cfg = config(*overrides)
    assert (cfg.optimizer._target_, cfg.penalty._target_) == (optimizer, penalty)
    if penalty == GAP_AWARE:
        assert (cfg.penalty.unit, cfg.penalty.eta_max) == ("round", cfg.optimizer.lr)  # eta_max = workers x lr


@pytest.mark.parametrize(
    ("overrides", "optimizer", "penalty"),
    [
        (["sync=async", "optimizer=momentum"], MOMENTUM, NONE),
        (["optimizer=momentum", "sync=async"], MOMENTUM, NONE),  # the order on the command line does not matter
        (["sync=ssp", "optimizer=nesterov"], "collsync.rules.nesterov", NONE),
        (["sync=bfasgd", "optimizer=sgd"], SGD, NONE),
        (["sync=async", "method=asgd"], MOMENTUM, NONE),  # a method is a whole algorithm: it wins over the policy
        (["sync=async", "method=sasgd"], SGD, STALENESS_AWARE),
        (["sync=ssp", "method=sa"], MOMENTUM, STALENESS_AWARE),
        (["sync=async", "method=asgd", "optimizer=adam"], "collsync.rules.adam", NONE),  # the command line wins
        (["sync=async", "penalty=gap_aware"], DANA, GAP_AWARE),  # a penalty combines with the policy's optimizer
        (["sync=async", "penalty=none"], DANA, NONE),  # plain DANA
        (["penalty=none", "sync=async"], DANA, NONE),
        (["sync=async", "optimizer=dana"], DANA, NONE),  # an optimizer named replaces the default pair
    ],
)
def test_an_explicit_choice_wins_over_the_policys_default(overrides, optimizer, penalty):
    cfg = config(*overrides)
    assert (cfg.optimizer._target_, cfg.penalty._target_) == (optimizer, penalty)


def test_keys_set_on_the_command_line_reach_the_policys_optimizer():
    cfg = config("sync=async", "optimizer.lr=0.01", "optimizer.momentum=0.5")
    assert (cfg.optimizer._target_, cfg.optimizer.lr, cfg.optimizer.momentum) == (DANA, 0.01, 0.5)
    # Gap-Aware's eta_max and momentum follow the optimizer that was chosen (interpolated from it); the default's
    # Gap counts rounds of workers updates, the one named on the command line single updates (001_... Alg. 14).
    for penalty, unit in ((), "round"), (("penalty=gap_aware",), "update"):
        cfg = config("sync=async", *penalty, "optimizer.lr=0.02", "optimizer.momentum=0.5")
        assert (cfg.penalty.eta_max, cfg.penalty.momentum, cfg.penalty.unit) == (0.02, 0.5, unit)


def test_collsync_train_command_line_wins_too(tmp_path):
    """The same through the real entry point (Hydra's own command-line parsing): `--cfg job` prints the config."""
    out = subprocess.run(
        [sys.executable, "-m", "collsync.cli", "sync=async", "optimizer=momentum", "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    optimizer = out.stdout.split("\noptimizer:\n", 1)[1]
    assert optimizer.splitlines()[0].strip() == f"_target_: {MOMENTUM}"


# The bar each policy clears at its defaults, seed 0. bfasgd's FASGD divides every step by the delay (002_... eq. 8,
# tau about 7 here) and ends at 0.73-0.78 over seeds 0-2 (benchmarks/README.md); its bar says it trains, far above
# chance (0.1), and catches a default that breaks it.
BARS = {"bsp": 0.9, "backup": 0.9, "async": 0.9, "ssp": 0.9, "psp": 0.9, "bfasgd": 0.6}


@pytest.mark.parametrize("sync", list(BARS))
def test_the_default_config_of_each_policy_trains(tmp_path: Path, sync: str):
    cfg = config(f"sync={sync}", "runtime=sim", "seed=0", "progress=false")
    assert (cfg.steps, cfg.runtime.workers) == (300, 8)  # the defaults themselves prove it, not a shorter run
    summary = run(cfg, tmp_path)
    assert summary is not None and summary.get("incomplete") is None
    assert summary["final_acc"] >= BARS[sync], summary["final_acc"]
