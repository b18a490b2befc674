"""`collsync.schema`: the shipped configs pass it unchanged; values that only look wrong are converted in place; a
bad value is refused under the key the user typed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from collsync import schema
from collsync.cli import CONF_DIR

OPTIONS = [(p.name, f.stem) for p in sorted(Path(CONF_DIR).iterdir()) if p.is_dir() for f in sorted(p.glob("*.yaml"))]
NEEDS_PATH = {"npz", "mnist", "cifar10"}


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_shipped_option_passes_unchanged(group: str, option: str) -> None:
    extra = ["data.path=somewhere"] if group == "data" and option in NEEDS_PATH else []
    cfg = composed(f"{group}={option}", *extra)
    before = cfg.copy()
    top = schema.check(cfg)
    assert cfg == before
    assert top.steps == cfg.steps and top.guard == cfg.guard


def test_values_that_only_look_wrong_are_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LR", "0.25")
    cfg = composed("steps=1e1", "optimizer.lr=${oc.env:LR}", "data=npz", "data.path=123", "model.hidden=[8.0,4]")
    schema.check(cfg)
    assert cfg.steps == 10 and isinstance(cfg.steps, int)
    assert cfg.optimizer.lr == 0.25 and isinstance(cfg.optimizer.lr, float)
    assert cfg.data.path == "123"
    assert list(cfg.model.hidden) == [8, 4] and all(isinstance(h, int) for h in cfg.model.hidden)


def test_a_bad_source_is_named_not_the_interpolation_that_reads_it() -> None:
    # gap_aware's eta_max is ${oc.select:optimizer.lr,0.1}: the user typed optimizer.lr.
    cfg = composed("penalty=gap_aware", "optimizer.lr=abc")
    with pytest.raises(schema.ConfigError, match=r"^optimizer\.lr='abc' is not a number$"):
        schema.check(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+sync.foo=1"], r"^sync\.foo=1: sync \(collsync\.policy\.backup\) has no key 'foo' \(its keys: backups, dea"),
        (["stragglers=frozen_worker", "stragglers.worker=2.5"], r"^stragglers\.worker=2\.5 is not a whole number$"),
        (["linear_scaling=1"], r"^linear_scaling=1 is not true or false$"),
        (["model=cnn", "model.channels=[16,x]"], r"^model\.channels\[1\]='x' is not a whole number$"),
        (["penalty=gap_aware", "penalty.layers=[[0,1,2]]"], r"^penalty\.layers\[0\]=\[0, 1, 2\] must hold 2 values$"),
        (["seed=-3"], r"^seed=-3 must be >= 0$"),
        (["data=npz"], r"^data\.path=\?\?\? is not set"),
    ],
)
def test_bad_values_are_refused_by_key(overrides: list[str], message: str) -> None:
    with pytest.raises(schema.ConfigError, match=message):
        schema.check(composed(*overrides))
