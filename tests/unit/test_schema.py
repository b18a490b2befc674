"""`collsync.schema`: the shipped configs pass it unchanged; values that only look wrong are converted in place; a
bad value is refused under the key the user typed."""

from __future__ import annotations

import copy
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

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


# --- values of the wrong kind: a scalar for a mapping, a mapping for a number, a list where a scalar goes -----------

WRONG_KINDS = {"a mapping": {"a": 1}, "a list": [1, 2], "a string": "foo"}
GROUP_OPTIONS = [(g, o) for g, o in OPTIONS if g not in ("method", "experiment")]  # those two set other groups


def _admits(hint: Any, value: Any) -> bool:
    """Whether an annotation admits a value of this kind at all (the schema then checks the value itself)."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for member in members:
        origin = typing.get_origin(member) or member
        if member is Any:
            return True
        if isinstance(value, dict) and (
            is_dataclass(member) or (isinstance(origin, type) and issubclass(origin, Mapping))
        ):
            return True
        if isinstance(value, list) and origin in (list, tuple, Sequence):
            return True
        if isinstance(value, str) and (member is str or (origin is Literal and value in typing.get_args(member))):
            return True
    return False


def _refuses_wrong_kinds(base: DictConfig, path: str, hint: Any) -> None:
    """`path` set to each wrong kind of value in a copy of `base`: refused in one line that starts with the key."""
    for kind, value in WRONG_KINDS.items():
        if _admits(hint, value):
            continue
        cfg = copy.deepcopy(base)
        with read_write(cfg), open_dict(cfg):
            OmegaConf.update(cfg, path, value, merge=False)
        with pytest.raises(schema.ConfigError, match=rf"^{re.escape(path)}="):
            schema.check(cfg)
            pytest.fail(f"{path}={value!r} ({kind}) was taken")


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_key_refuses_a_value_of_the_wrong_kind_by_name(group: str, option: str) -> None:
    extra = ["data.path=somewhere"] if group == "data" and option in NEEDS_PATH else []
    base = composed(f"{group}={option}", *extra)
    hints = typing.get_type_hints(get_object(base[group]._target_))
    keys = [str(k) for k in base[group] if not str(k).startswith("_")]
    for key in keys:
        _refuses_wrong_kinds(base, f"{group}.{key}", hints.get(key, Any))
    # The group itself given a scalar, where one option's mapping goes.
    _refuses_wrong_kinds(base, group, DictConfig)


def test_every_top_level_key_refuses_a_value_of_the_wrong_kind_by_name() -> None:
    base = composed()
    hints = typing.get_type_hints(schema.RunConfig)
    for field in fields(schema.RunConfig):
        if field.name in base:
            _refuses_wrong_kinds(base, field.name, hints[field.name])
    _refuses_wrong_kinds(base, "checkpoint", DictConfig)  # a mapping of conf/config.yaml, typed or not


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # The case: a string where the config holds a mapping (Hydra merges it in without a word).
        (["checkpoint=foo"], r"^checkpoint='foo' is not a mapping: checkpoint takes keys \(checkpoint\.every=\.\.\., "),
        (["++checkpoint=5"], r"^checkpoint=5 is not a mapping"),
        (
            ["~optimizer"],
            r"^optimizer: no option is chosen \(~optimizer removes it\): choose one, e\.g\. optimizer=mom",
        ),
        (["~data"], r"^data: no option is chosen .* e\.g\. data=digits$"),
        (["optimizer.lr={a:1}"], r"^optimizer\.lr=\{'a': 1\} is not a number$"),
        (["runtime.workers=[1]"], r"^runtime\.workers=\[1\] is not a whole number$"),
        (["seed={a:1}"], r"^seed=\{'a': 1\} is not a whole number$"),
    ],
)
def test_group_level_values_of_the_wrong_kind_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(schema.ConfigError, match=message):
        schema.check(composed(*overrides))


def test_a_group_given_several_options_is_refused_where_hydra_says_so() -> None:
    # Hydra merges optimizer=[sgd,adam] into one node and records no choice for the group; the CLI passes the choices.
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["optimizer=[sgd,adam]"], return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    with pytest.raises(schema.ConfigError, match=r"^optimizer: takes one option, not a list of them \(several in turn"):
        schema.check(cfg, choices)
    single = composed("optimizer=adam")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        hydra_cfg = compose(config_name="config", overrides=["optimizer=adam"], return_hydra_config=True)
    assert schema.check(single, dict(hydra_cfg.hydra.runtime.choices)).steps == single.steps


def test_a_dataclass_typed_key_takes_a_mapping_only() -> None:
    @dataclass(frozen=True)
    class Every:
        updates: int | None = None

    assert schema._convert({"updates": 3}, Every | None, "every") == {"updates": 3}
    assert schema._convert(None, Every | None, "every") is None
    with pytest.raises(
        schema.ConfigError, match=r"^every='x' is not a mapping: every takes keys \(every\.updates=\.\.\.\)$"
    ):
        schema._convert("x", Every | None, "every")
