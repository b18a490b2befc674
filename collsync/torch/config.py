"""Sync modes for `collsync.torch` by name, with the same option names and checks as the Hydra groups.

`sync_config("backup", backups=1)` reads `conf/sync/backup.yaml`, overrides its keys and instantiates its factory,
exactly what `collsync-train sync=backup sync.backups=1` does; an option the mode does not have is refused naming
it. `from_config(cfg)` takes a composed collsync config (a user's own `@hydra.main` over collsync's `conf/`), so
sweeps over `sync=...` work in a user's script as in `collsync-train`.

The parameter server applies collsync's rule, built from the user's optimizer (`server_rule`): torch's SGD (with
momentum, Nesterov, weight decay) and Adam map one to one to `collsync.rules.sgd / momentum / nesterov / adam`;
anything else is refused at construction with a line naming it (pass `rule=` a collsync rule instead).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, cast

from collsync.margin import check_margin
from collsync.policy import SyncPolicy
from collsync.suggest import did_you_mean

MODES = ("bsp", "backup", "async", "ssp", "psp", "bfasgd", "specsync")
PENALTIES = ("none", "staleness_aware", "staleness_aware_step", "gap_aware", "gap_aware_round")
# Modes that have no serverless form: their updates come from a parameter server.
SERVER_MODES = ("async", "ssp", "psp", "bfasgd", "specsync")
# SSP's bound where a script does not set one: 1 here, 3 in collsync-train (conf/sync/ssp.yaml). A script's momentum
# SGD at the lr of synchronous rounds trains within a point of bsp at a bound of 1 with the look-ahead
# (`server_momentum`), not at 2 or 3 (examples/mnist.py, digits, 4 workers, 8 epochs, seeds 0-2: 0.95-0.97 at 1;
# 0.89-0.96 at 2; 0.84-0.94 at 3). collsync-train's ssp runs plain SGD at lr 0.1, made for the bound 3.
SSP_MAX_LEAD = 1


@dataclass(frozen=True)
class SyncConfig:
    """A sync mode, resolved: the policy; the penalty and the server's optimizer as config nodes (dicts with
    `_target_`, as in conf/penalty/ and conf/optimizer/; None: no penalty, and the rule made from the user's
    torch optimizer); how many server ranks (0: serverless bsp/backup); the full-sync backend; the partial
    allreduce's depth and margin (serverless backup: how long a round waits after its quorum-th gradient for the
    others, `runtime.mpi_partial`; "auto" from the measured arrivals, seconds, or None: exactly n - b gradients a
    round). Plain values only: worker 0 sends it to the server ranks."""

    policy: SyncPolicy
    penalty: dict[str, Any] | None = None
    servers: int = 0
    backend: str = "mpi"
    depth: int = 8
    rule: dict[str, Any] | None = None
    scaled_lr: bool = True
    # The options `sync_config` was given by name (None: built from a SyncPolicy or a composed config), so that
    # options beside it (DistributedOptimizer after init(sync=...)) merge with them key by key.
    given: dict[str, Any] | None = None
    margin: float | str | None = "auto"
    # Serverless backup: whether a late worker skips to the current round (`_partial_mode`); None: unless a
    # learning-rate scheduler is attached to the optimizer.
    catch_up: bool | None = None

    def __post_init__(self) -> None:
        speculation = self.policy.speculation
        if speculation is not None and speculation.scheduler != "server":
            # The script's world is fixed at init() (servers first, then workers): a scheduler rank of its own would
            # be a third role there, and the server loop polls the scheduler at no extra rank.
            raise ValueError(
                f"sync={self.name}: scheduler={speculation.scheduler!r} (a rank of its own) runs in collsync-train "
                "only; through collsync.torch the scheduler runs in server rank 0's loop (scheduler='server')"
            )
        if speculation is not None and self.servers < 1:
            raise ValueError(
                f"sync={self.name}: servers={self.servers}; SpecSync's scheduler runs on a parameter server "
                "(servers >= 1)"
            )

    @property
    def name(self) -> str:
        return self.policy.name


def _node(group: str, name: str, options: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`conf/<group>/<name>.yaml` with `options` set (each must be one of its keys) and `extra` filled where the file
    has the key: a plain dict with `_target_`, picklable, so a server rank can build the same object."""
    from omegaconf import DictConfig, OmegaConf  # lazily, as Hydra: only where a mode is built from its YAML file

    from collsync.schema import _checked, _factory

    path = files("collsync.conf").joinpath(group, f"{name}.yaml")
    if not path.is_file():
        known = sorted(
            p.name[:-5] for p in files("collsync.conf").joinpath(group).iterdir() if p.name.endswith(".yaml")
        )
        raise ValueError(f"{group}={name!r} is not one of {', '.join(known)}{did_you_mean(name, known)}")
    node = OmegaConf.load(str(path))
    assert isinstance(node, DictConfig)  # every option's file is a mapping
    defaults = node.pop("defaults", None)  # a sync mode's default optimizer (conf/sync/async.yaml): collsync-train's
    if "_target_" not in node:
        # An option that pairs another of its group with a penalty (conf/optimizer/dana_ga_round.yaml): here the
        # rule and the penalty are named one by one.
        raise ValueError(f"{group}={name!r} is collsync-train's pair {_pair(defaults)}: name them one by one here")
    for key, value in options.items():
        if key not in node or key.startswith("_"):
            keys = [k for k in node if not str(k).startswith("_")]
            raise ValueError(
                f"{group}={name}: unknown option {key}={value!r}{did_you_mean(key, map(str, keys))} "
                f"(options: {', '.join(map(str, keys))})"
            )
        node[key] = value
    # Typed as collsync-train types them (the factory's annotations): one line naming the key, not Hydra's wrapper.
    hints = _factory(str(node._target_))[1]
    for key in options:
        _checked(node, key, f"{group}={name}: {key}", hints.get(key, Any))
    for key, value in (extra or {}).items():
        if key in node:
            node[key] = value
    # An interpolation left (gap_aware's ${oc.select:optimizer.lr,0.1}) resolves to its default: no root here.
    resolved = OmegaConf.to_container(OmegaConf.create({"node": node}), resolve=True)
    assert isinstance(resolved, dict)
    return resolved["node"]


def _pair(defaults: Any) -> str:
    """What a pairing option's defaults list chooses, as keyword arguments (`rule='dana', penalty='...'`)."""
    chosen = []
    for entry in defaults or []:
        if isinstance(entry, str) and entry != "_self_":
            chosen.append(f"rule={entry!r}")
        elif not isinstance(entry, str):
            chosen += [f"{str(k).split('@')[0].split('/')[-1]}={v!r}" for k, v in entry.items()]
    return ", ".join(chosen)


def build(node: dict[str, Any] | None) -> Any:
    """Instantiate a node made by `_node`, `server_rule` or `from_config` (None stays None). A factory's own
    ValueError (a bad value, `specsync: base='bsp' must be ...`) comes out as that one line, not Hydra's wrapper."""
    # Lazily: Hydra takes a second or more to import, and `import collsync.torch` does not need it.
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    if node is None:
        return None
    try:
        return instantiate(node)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, ValueError):
            raise ValueError(str(exc.__cause__)) from None
        raise


def factory(node: dict[str, Any] | None) -> Callable[[], Any] | None:
    """A node made by `_node`, `server_rule` or `server_penalty` as its factory with the node's arguments bound
    (Hydra's `_partial_`, plain values: `_convert_="all"`), built once here so a bad value raises on this rank.
    A `functools.partial` of a module-level function pickles by name: the server ranks that call it load neither
    Hydra nor OmegaConf (tests/unit/test_layers.py)."""
    if node is None:
        return None
    deferred = build({**node, "_partial_": True, "_convert_": "all"})
    assert isinstance(deferred, functools.partial)  # every factory is a module-level function
    # Hydra's partial is a subclass of its own that carries its bookkeeping: a plain one pickles by the factory alone.
    made = functools.partial(deferred.func, *deferred.args, **deferred.keywords)
    made()  # a factory's ValueError (a bad value) comes out on the worker that asked, not on a server rank
    return made


def sync_config(sync: Any = "bsp", **options: Any) -> SyncConfig:
    """A `SyncConfig` from a mode name and its options (`conf/sync/<name>.yaml` keys; `ssp`'s `max_lead` defaults to
    `SSP_MAX_LEAD` = 1 here), a `SyncPolicy`, or a `SyncConfig` (with options: merged with the ones it was made
    with, see `merge`).

    Besides the mode's own keys: `penalty` (a name from conf/penalty/, or None) and `penalty_options` (its keys),
    `rule` (a name from conf/optimizer/, e.g. "dana" or "fasgd", for the server instead of the one made from the
    torch optimizer) and `rule_options` (its keys), `servers` (server ranks; default 1 for async, ssp, psp, bfasgd,
    else 0), `backend` ("mpi" or "horovod"), `depth` (the partial allreduce's ring), `margin` (serverless backup:
    "auto", the default, waits after the round's n - b-th gradient for the others as long as the measured arrivals
    say nobody straggles (`margin.Margin`); a number waits that many seconds; None takes exactly the first n - b,
    000_...'s fixed b; collsync-train's `runtime.margin`, the same key), `catch_up` (serverless backup: a worker
    late for a round applies every round the others completed meanwhile and skips as many of its batches, through
    `collsync.torch.DistributedSampler`; None, the default, does so unless a learning-rate scheduler is attached to
    the optimizer, whose per-step schedule would then differ between replicas; True or False), `scaled_lr` (default
    True: the torch optimizer's lr is Horovod's `lr * size()`, and a server mode rescales it, see `server_lr`; False:
    the servers apply it as given).
    """
    if isinstance(sync, SyncConfig):
        return merge(sync, options) if options else sync
    named: dict[str, Any] | None = dict(options)  # before the pops: every option as the caller gave it
    penalty = options.pop("penalty", None)
    penalty_options = options.pop("penalty_options", None) or {}
    servers = options.pop("servers", None)
    backend = options.pop("backend", "mpi")
    depth = options.pop("depth", 8)
    margin_given, margin = "margin" in options, options.pop("margin", "auto")
    catch_up_given, catch_up = "catch_up" in options, options.pop("catch_up", None)
    rule = options.pop("rule", None)
    rule_options = options.pop("rule_options", None) or {}
    scaled_lr = options.pop("scaled_lr", True)
    if not isinstance(scaled_lr, bool):
        raise ValueError(f"scaled_lr={scaled_lr!r} must be True or False")
    policy = _policy(sync, options)
    if servers is None:
        servers = 1 if policy.name in SERVER_MODES or not policy.rounds or policy.max_lead else 0
    if not isinstance(servers, int) or servers < 0:
        raise ValueError(f"sync={policy.name}: servers={servers!r} must be a whole number >= 0")
    if backend not in ("mpi", "horovod"):
        raise ValueError(f"sync={policy.name}: backend={backend!r} must be 'mpi' or 'horovod'")
    serverless = not servers and policy.name == "backup"
    _check_backup(policy.name, serverless, depth, (margin, margin_given), (catch_up, catch_up_given))
    penalty_node = _penalty_node(penalty, penalty_options)
    rule_node = None
    if rule is not None:
        if not isinstance(rule, str):
            raise TypeError(f"rule must be a name from conf/optimizer/ (e.g. 'dana'), got {type(rule).__name__}")
        rule_node = _node("optimizer", rule, dict(rule_options))
    elif rule_options:
        raise ValueError("rule_options are for a rule given by name (rule='dana', ...)")
    named = named if isinstance(sync, str) else None
    return SyncConfig(policy, penalty_node, servers, backend, depth, rule_node, scaled_lr, named, margin, catch_up)


def _policy(sync: Any, options: dict[str, Any]) -> SyncPolicy:
    """The policy of `sync_config`: a `SyncPolicy` as given (no options beside it), or a mode by name built from
    its `conf/sync/<name>.yaml` with the mode's own `options` (ssp's bound defaults to `SSP_MAX_LEAD` here)."""
    if isinstance(sync, SyncPolicy):
        if options:
            raise ValueError(f"sync={sync.name}: options {sorted(options)} beside a SyncPolicy (set them on it)")
        return sync
    if not isinstance(sync, str):
        raise TypeError(f"sync must be a mode name, a SyncPolicy or a SyncConfig, got {type(sync).__name__}")
    if sync not in MODES:
        raise ValueError(f"sync={sync!r} is not one of {', '.join(MODES)}{did_you_mean(sync, MODES)}")
    if sync == "ssp" and "max_lead" not in options:
        options["max_lead"] = SSP_MAX_LEAD
    return cast(SyncPolicy, build(_node("sync", sync, options)))


def _check_backup(
    name: str, serverless: bool, depth: Any, margin: tuple[Any, bool], catch_up: tuple[Any, bool]
) -> None:
    """Serverless backup's options (`depth`; `margin` and `catch_up`, each with whether it was given): valid
    values, and `margin` and `catch_up` given only for serverless backup, whose rounds are the k-of-n partial
    allreduce."""
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"sync={name}: depth={depth!r} must be a whole number >= 1")
    try:
        check_margin(margin[0])
    except ValueError as exc:
        raise ValueError(f"sync={name}: {str(exc).removeprefix('partial allreduce: ')}") from None
    if margin[1] and not serverless:
        raise ValueError(
            f"sync={name}: margin={margin[0]!r} is for serverless backup (sync='backup', servers=0), whose "
            "rounds are the k-of-n partial allreduce"
        )
    if catch_up[0] not in (None, True, False):
        raise ValueError(f"sync={name}: catch_up={catch_up[0]!r} must be True, False or None (decide by itself)")
    if catch_up[1] and not serverless:
        raise ValueError(
            f"sync={name}: catch_up={catch_up[0]!r} is for serverless backup (sync='backup', servers=0), whose "
            "late workers skip to the current round"
        )


def _penalty_node(penalty: Any, options: dict[str, Any]) -> dict[str, Any] | None:
    """The penalty's config node (`conf/penalty/<name>.yaml` with `options`), remembering the keys given."""
    if penalty is None:
        if options:
            raise ValueError("penalty_options are for a penalty given by name (penalty='gap_aware', ...)")
        return None
    if penalty not in PENALTIES:
        raise ValueError(f"penalty={penalty!r} is not one of {', '.join(PENALTIES)}{did_you_mean(penalty, PENALTIES)}")
    return {"name": penalty, "given": sorted(options), **_node("penalty", penalty, dict(options))}


def merge(config: SyncConfig, options: dict[str, Any]) -> SyncConfig:
    """`config` with more options: `DistributedOptimizer(..., penalty="gap_aware")` or `backups=2` after
    `init(sync=...)` chose the mode. A key the config was made with keeps its value: the same value again is fine,
    another is refused naming both."""
    if config.given is None:
        raise ValueError(
            f"sync={config.name}: {', '.join(sorted(options))} beside a SyncConfig made from a SyncPolicy or a "
            "composed config; set them where it is made"
        )
    for key, value in sorted(options.items()):
        if key in config.given and config.given[key] != value:
            raise ValueError(
                f"sync={config.name}: {key}={value!r} conflicts with {key}={config.given[key]!r} of the mode "
                "init(sync=...) chose"
            )
    return sync_config(config.name, **{**config.given, **options})


def from_config(cfg: Any) -> SyncConfig:
    """The sync mode of a composed collsync config (groups `sync`, `penalty`, `optimizer`, `runtime`).

    The server rule is the config's `optimizer` (and `penalty`), as in `collsync-train`; `runtime.servers` gives the
    server ranks of a server mode (`runtime=allreduce` and `runtime=partial` run bsp / backup without servers).
    """
    from omegaconf import OmegaConf  # lazily, as Hydra (see `build`)

    def node(group: str) -> dict[str, Any]:
        return cast(dict[str, Any], OmegaConf.to_container(cfg[group], resolve=True))  # a group: a mapping

    policy = build(node("sync"))
    runtime = build(node("runtime"))
    serverless = runtime.kind in ("allreduce", "partial", "sim") and policy.name in ("bsp", "backup")
    servers = 0 if serverless else runtime.servers
    given = node("penalty")
    penalty = None if given.get("_target_") == "collsync.rules.identity" else given
    # Serverless backup's keys are the runtime's (`conf/runtime/partial.yaml`), with the same meaning here.
    margin, catch_up = getattr(runtime, "margin", "auto"), getattr(runtime, "catch_up", None)
    return SyncConfig(
        policy, penalty, servers, "mpi", runtime.depth, node("optimizer"), margin=margin, catch_up=catch_up
    )
