"""Every option of every config group composes with the rest and instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from collsync.cli import CONF_DIR
from collsync.rules import Rule, combine

GROUPS = sorted(p.name for p in Path(CONF_DIR).iterdir() if p.is_dir() and list(p.glob("*.yaml")))
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((Path(CONF_DIR) / g).glob("*.yaml"))]
# Options that need a file the user already has: they must compose, and fail on instantiation naming the key.
NEEDS_PATH = {("data", "npz"), ("data", "mnist"), ("data", "cifar10")}


def test_the_groups_the_design_names_exist():
    assert {"runtime", "sync", "penalty", "optimizer", "model", "data", "stragglers"} <= set(GROUPS)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(group, option):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"{group}={option}"])
    if (group, option) in NEEDS_PATH:
        with pytest.raises(Exception, match="path"):
            instantiate(cfg[group])
        return
    if group in ("method", "experiment"):  # global packages: they choose the penalty and the optimizer together
        penalty, optimizer = combine(instantiate(cfg.penalty), instantiate(cfg.optimizer))
        assert isinstance(penalty, Rule) and isinstance(optimizer, Rule)
        return
    obj = instantiate(cfg[group])
    assert obj is not None
    if group == "model":
        model = obj(input_shape=(1, 8, 8) if option == "cnn" else (64,), classes=10, seed=0)
        assert sum(p.numel() for p in model.parameters()) > 0
