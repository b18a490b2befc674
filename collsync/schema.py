"""The config's schema: every key checked against the type its code declares, when the config loads.

Three sources of truth, all already in the code, so nothing is listed twice:

* the top-level keys of `conf/config.yaml` are the fields of `RunConfig` (types, and the ranges its
  `__post_init__` checks);
* each group (`optimizer`, `sync`, `data`, ...) is a node with a `_target_`, whose keyword arguments are checked
  against that factory's signature and annotations (`inspect.signature` + `typing.get_type_hints`);
* `conf/config.yaml` itself says which keys are groups (its defaults list) and which are mappings (`checkpoint`):
  each group holds exactly one option, and a mapping stays a mapping (`checkpoint=foo` is refused), checked first,
  before any key inside them is read (`check_groups`).

`check(cfg)` refuses an unknown keyword argument, a mandatory value left unset (`???`), and a value of the wrong
type, with one line naming the key as the user typed it and the value (`optimizer.lr='abc' is not a number`),
before anything is instantiated. Values that only look wrong are converted in place: a whole float where an integer
is expected (`steps=1e3`), a numeric string where a number is expected (`${oc.env:LR}`), any scalar where a string
is expected (`data.path=123`). Ranges and combinations stay with the factories, which already name their keys.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from importlib.resources import files
from typing import Any, Literal

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write


class ConfigError(ValueError):
    """A config value the code cannot take; the message is one line naming the key and the value."""


@dataclass(frozen=True)
class Checkpointing:
    """`checkpoint:` in `conf/config.yaml`: server updates and wall seconds between two checkpoints (None: never)."""

    every: int | None = None
    seconds: float | None = None  # ranges: `checkpoint.Schedule` checks them where it takes them


@dataclass(frozen=True)
class RunConfig:
    """The top-level keys of `conf/config.yaml` with their types; `__post_init__` checks their ranges.

    Every key the runs read is here, so they read this and never the raw config (`collsync.runs.parts.Parts.run`).
    """

    seed: int = 0
    steps: int = 300
    batch_size: int = 32
    eval_every: int = 25
    ema_decay: float | None = 0.99
    warmup_updates: int = 0
    linear_scaling: bool = False
    progress: bool = True
    plots: bool = True
    guard: Literal["stop", "skip", "off"] = "stop"
    guard_loss: float = 10.0
    checkpoint: Checkpointing | None = None
    resume: str | None = None

    def __post_init__(self) -> None:
        if self.seed < 0:  # the straggler draws and the data order seed numpy generators, which take seeds >= 0
            raise ConfigError(f"seed={self.seed} must be >= 0")
        for key in ("steps", "batch_size", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        if self.resume is not None and not self.resume.strip():  # `resume=`: Hydra's empty string, not null
            raise ConfigError(
                f"resume={self.resume!r} is empty: pass resume=auto (this run folder's checkpoint, if any), a run "
                f"folder or a checkpoint.pt (leave it out for a fresh start)"
            )
        if not self.guard_loss > 1.0:
            raise ConfigError(f"guard_loss={self.guard_loss} must be > 1 (a multiple of the starting test loss)")
        if isinstance(self.checkpoint, dict):
            # The config gives a mapping (`checkpoint.every=...`): its keys typed as `Checkpointing` declares them.
            hints, given = typing.get_type_hints(Checkpointing), self.checkpoint
            unknown = sorted(set(given) - set(hints))
            if unknown:
                raise ConfigError(f"checkpoint.{unknown[0]}: checkpoint has no such key (its keys: every, seconds)")
            typed = {k: _convert(v, hints[k], f"checkpoint.{k}") for k, v in given.items()}
            object.__setattr__(self, "checkpoint", Checkpointing(**typed))

    @property
    def guard_limit(self) -> float | None:
        """The divergence guard's multiple of the first test loss, or None with `guard=off`."""
        return None if self.guard == "off" else self.guard_loss

    @property
    def checkpoints(self) -> Checkpointing:
        return self.checkpoint or Checkpointing()


# Hydra's own keys inside a group node, never passed to the factory as keyword arguments.
_HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


def check(cfg: DictConfig, choices: Mapping[str, Any] | None = None) -> RunConfig:
    """Check `cfg` in place (converting values as the module docstring says) and return its top-level keys.

    `choices`: Hydra's choice of option per group (`HydraConfig.get().runtime.choices`), where the caller has it: a
    group given a list of options (`optimizer=[sgd,adam]`, which Hydra merges into one node) is refused only then.
    Raises `ConfigError` (a ValueError) with one line naming the first bad key; an interpolation that cannot be
    resolved raises OmegaConf's error, which `collsync.cli` prints as one line too.
    """
    check_groups(cfg, choices)
    hints = typing.get_type_hints(RunConfig)
    # (node, key, the key as the user types it, its type), top-level keys first, then each group's.
    entries = [(cfg, f.name, f.name, hints[f.name]) for f in fields(RunConfig) if f.name in cfg]
    for group in map(str, cfg.keys()):
        if OmegaConf.is_missing(cfg, group) or OmegaConf.is_interpolation(cfg, group):
            continue
        node = cfg[group]
        if isinstance(node, DictConfig) and "_target_" in node:
            entries += [(node, key, f"{group}.{key}", hint) for key, hint in _group_keys(node, group)]
    # Literal values first: an interpolation (gap_aware's eta_max: ${oc.select:optimizer.lr,0.1}) is checked after
    # its source, so a bad value is reported under the key the user typed.
    entries.sort(key=lambda e: OmegaConf.is_interpolation(e[0], e[1]))
    values = {path: _checked(node, key, path, hint) for node, key, path, hint in entries}
    return RunConfig(**{f.name: values[f.name] for f in fields(RunConfig) if f.name in values})


def given(overrides: Sequence[str], key: str) -> str | None:
    """The value `key` was last given on the command line (`overrides`: Hydra's task overrides, `key=v`, `+key=v`
    or `++key=v`), or None: a default and a value given are the same number to the config, not to the user."""
    found = None
    for override in overrides:
        name, sep, value = override.lstrip("+").partition("=")
        if sep and name == key:
            found = value
    return found


def check_overrides(overrides: Sequence[str]) -> list[str]:
    """Combinations of command-line overrides the config cannot tell apart from its defaults: ConfigError for one
    that contradicts itself, and the warnings (one line each) for one that is legitimate but overrides a choice.

    `sync.pushes` and `sync.push_fraction` both given: psp takes `pushes` and would drop the fraction unsaid. A
    `method=` with `optimizer=` or `penalty=`: the command line's option replaces the method's (`method=sa
    optimizer=nesterov` is SA with NAG, as `benchmarks/study.py` runs it), so only a warning names what it replaced.
    """
    pushes, fraction = given(overrides, "sync.pushes"), given(overrides, "sync.push_fraction")
    if pushes not in (None, "null") and fraction not in (None, "null"):
        raise ConfigError(
            f"sync.pushes={pushes} and sync.push_fraction={fraction} both set psp's quorum: give one of them"
        )
    method = given(overrides, "method")
    if method in (None, "null"):
        return []
    warnings = []
    for group, chosen in _method_choices(method).items():
        mine = given(overrides, group)
        if mine is not None and mine != chosen:
            warnings.append(
                f"method={method} sets {group}={chosen}, and {group}={mine} on the command line replaces it: "
                f"this run trains {group}={mine}"
            )
    return warnings


def _method_choices(method: str) -> dict[str, str]:
    """The options `conf/method/<method>.yaml` chooses (`{"penalty": "none", "optimizer": "dana"}`), from its
    defaults list; {} for a method that is not there (Hydra has named it already)."""
    path = files("collsync.conf").joinpath("method", f"{method}.yaml")
    if not path.is_file():
        return {}
    node = OmegaConf.create(path.read_text())
    chosen: dict[str, str] = {}
    for entry in node.get("defaults", []) if isinstance(node, DictConfig) else []:
        if isinstance(entry, DictConfig):
            for k, v in entry.items():
                chosen[str(k).removeprefix("override ").strip().lstrip("/")] = str(v)
    return chosen


@functools.cache
def _primary() -> tuple[dict[str, str], dict[str, list[str]]]:
    """What `conf/config.yaml` says of its keys' kinds: its groups with their default options (`runtime: auto`, from
    the defaults list; a group that defaults to null, such as `method`, is optional), and its own mappings with
    their keys (`checkpoint: [every, seconds]`)."""
    primary = OmegaConf.create(files("collsync.conf").joinpath("config.yaml").read_text())
    assert isinstance(primary, DictConfig)  # a YAML mapping
    groups: dict[str, str] = {}
    for entry in primary.get("defaults", []):
        if isinstance(entry, DictConfig):
            groups |= {str(k): str(v) for k, v in entry.items() if v is not None and "@" not in str(k)}
    mappings = {
        str(k): [str(key) for key in v]
        for k, v in primary.items()
        if k not in ("defaults", "hydra") and isinstance(v, DictConfig)
    }
    return groups, mappings


def check_groups(cfg: DictConfig, choices: Mapping[str, Any] | None = None) -> None:
    """Each group of `conf/config.yaml` holds one option (a mapping with a `_target_`), and each of its own mappings
    is still a mapping (or null), before any key inside them is read; ConfigError naming the group or key.

    `choices` (Hydra's choice per group) tells a group given a list of options from one given a single option: the
    composed node of `optimizer=[sgd,adam]` is the options merged, and Hydra records no choice for it.
    """
    groups, mappings = _primary()
    for group, default in groups.items():
        if group not in cfg or OmegaConf.is_missing(cfg, group):
            raise ConfigError(f"{group}: no option is chosen (~{group} removes it): choose one, e.g. {group}={default}")
        if choices is not None and group not in choices:
            raise ConfigError(f"{group}: takes one option, not a list of them (several in turn: -m {group}=a,b)")
        node = cfg[group]  # resolves an interpolation (OmegaConf raises, naming the key, if it cannot)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(
                f"{group}={_show(_raw(cfg, group))} is not an option of {group}: choose one, e.g. {group}={default}"
            )
    for key, keys in mappings.items():
        if key in cfg and not OmegaConf.is_missing(cfg, key) and not isinstance(cfg[key], (DictConfig, type(None))):
            raise ConfigError(_not_mapping(key, _raw(cfg, key), keys))


def _not_mapping(path: str, value: Any, keys: list[str]) -> str:
    """The message for a scalar or a list where a mapping goes, naming the keys the mapping takes."""
    takes = f": {path} takes keys ({', '.join(f'{path}.{k}=...' for k in keys)})" if keys else ""
    return f"{path}={_show(value)} is not a mapping{takes}"


def _group_keys(node: DictConfig, group: str) -> list[tuple[str, Any]]:
    """One group's keyword arguments checked against its factory's signature: each key with its annotation."""
    target = str(node._target_)
    try:
        params, hints = _factory(target)
    except Exception as exc:  # noqa: BLE001 - any import or lookup failure is a bad _target_
        raise ConfigError(f"{group}._target_={target!r} cannot be imported ({type(exc).__name__})") from exc
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keys = [str(k) for k in node.keys() if str(k) not in _HYDRA_KEYS]
    for key in keys:
        if key not in params and not open_ended:
            takes = ", ".join(p for p in params if p not in ("input_shape", "classes")) or "nothing"
            raise ConfigError(
                f"{group}.{key}={_show(_raw(node, key))}: {group} ({target}) has no key {key!r} (its keys: {takes})"
            )
    if not OmegaConf.select(node, "_partial_", default=False):
        # A partial factory (a model, staleness_aware_step) gets the rest of its arguments from the code.
        for name, p in params.items():
            if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD and name not in keys:
                raise ConfigError(f"{group}.{name} is not set: {group} ({target}) needs it")
    return [(key, hints.get(key, Any)) for key in keys]


@functools.cache
def _factory(target: str) -> tuple[Mapping[str, inspect.Parameter], dict[str, Any]]:
    """A `_target_`'s parameters and their annotations (cached: the config is checked more than once per run)."""
    factory = get_object(target)
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except (NameError, TypeError):  # an annotation that does not evaluate: check the names, not the types
        hints = {}
    return inspect.signature(factory).parameters, hints


def _raw(node: DictConfig, key: str) -> Any:
    """The value as the user wrote it (an interpolation unresolved), for messages."""
    raw = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else None
    return raw.get(key) if isinstance(raw, dict) else None


def _checked(node: DictConfig, key: str, path: str, hint: Any) -> Any:
    """The value of `node[key]` converted to `hint`; written back when the conversion changed it."""
    if OmegaConf.is_missing(node, key):
        raise ConfigError(f"{path}=??? is not set: give it a value ({path}=...)")
    value = node[key]  # resolves an interpolation (OmegaConf raises, naming the key, if it cannot)
    plain = OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    converted = _convert(plain, hint, path)
    if converted is not plain and not _same(converted, plain):
        with read_write(node), open_dict(node):
            node[key] = converted
    return converted


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (8.0 in a list of ints is not the same as 8)."""
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _show(value: Any) -> str:
    """A value as the user would type it: strings quoted, null, true / false."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    return repr(value) if isinstance(value, (str, list, dict)) else str(value)


def _convert(value: Any, hint: Any, path: str) -> Any:
    """`value` as an instance of `hint`, or ConfigError naming `path` and the value."""
    if hint is Any or hint is object or hint is inspect.Parameter.empty:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        first: ConfigError | None = None
        for member in members:
            try:
                return _convert(value, member, path)
            except ConfigError as exc:
                first = first or exc
        assert first is not None
        raise first
    if origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={_show(value)} must be one of {', '.join(map(str, args))}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{path}={_show(value)} is not true or false")
    if hint is int:
        return _whole(value, path)
    if hint is float:
        return _number(value, path)
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}={_show(value)} is not a string")
    if origin in (list, tuple, collections.abc.Sequence) or hint in (list, tuple):
        return _sequence(value, origin or hint, args, path)
    if dataclasses.is_dataclass(hint) or origin in (dict, collections.abc.Mapping) or hint is dict:
        if not isinstance(value, dict):  # its keys are typed where it is taken (`RunConfig.__post_init__`)
            keys = [f.name for f in fields(hint)] if dataclasses.is_dataclass(hint) else []
            raise ConfigError(_not_mapping(path, value, keys))
        return value
    return value  # a type the config cannot spell (a tensor, a callable): the factory checks it


def _whole(value: Any, path: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{path}={_show(value)} is not a whole number")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{path}={_show(value)} is not a whole number") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise ConfigError(f"{path}={_show(value)} is not a whole number")


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{path}={_show(value)} is not a number")
    if isinstance(value, int):
        return value  # ints are valid floats to every factory; kept as typed
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(f"{path}={_show(value)} is not a number") from None
    if not isinstance(value, float):
        raise ConfigError(f"{path}={_show(value)} is not a number")
    if not math.isfinite(value):
        raise ConfigError(f"{path}={_show(value)} is not a finite number")
    return value


def _sequence(value: Any, kind: Any, args: tuple[Any, ...], path: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}={_show(value)} is not a list")
    if kind is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f"{path}={_show(value)} must hold {len(args)} values")
        items = [_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))]
    else:
        element = args[0] if args else Any
        items = [_convert(v, element, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if kind is tuple else items
