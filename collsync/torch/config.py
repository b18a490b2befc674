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

from dataclasses import dataclass
from importlib.resources import files
from typing import Any, cast

import torch

from collsync.policy import SyncPolicy
from collsync.runtime.mpi_partial_windows import check_margin

MODES = ("bsp", "backup", "async", "ssp", "psp", "bfasgd", "specsync")
PENALTIES = ("none", "staleness_aware", "staleness_aware_step", "gap_aware")
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

    path = files("collsync.conf").joinpath(group, f"{name}.yaml")
    if not path.is_file():
        known = sorted(
            p.name[:-5] for p in files("collsync.conf").joinpath(group).iterdir() if p.name.endswith(".yaml")
        )
        raise ValueError(f"{group}={name!r} is not one of {', '.join(known)}")
    node = OmegaConf.load(str(path))
    assert isinstance(node, DictConfig)  # every option's file is a mapping
    node.pop("defaults", None)  # a sync mode's default optimizer (conf/sync/async.yaml) is for collsync-train
    for key, value in options.items():
        if key not in node or key.startswith("_"):
            keys = [k for k in node if not str(k).startswith("_")]
            raise ValueError(f"{group}={name}: unknown option {key}={value!r} (options: {', '.join(map(str, keys))})")
        node[key] = value
    for key, value in (extra or {}).items():
        if key in node:
            node[key] = value
    # An interpolation left (gap_aware's ${oc.select:optimizer.lr,0.1}) resolves to its default: no root here.
    resolved = OmegaConf.to_container(OmegaConf.create({"node": node}), resolve=True)
    assert isinstance(resolved, dict)
    return resolved["node"]


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


def sync_config(sync: Any = "bsp", **options: Any) -> SyncConfig:
    """A `SyncConfig` from a mode name and its options (`conf/sync/<name>.yaml` keys; `ssp`'s `max_lead` defaults to
    `SSP_MAX_LEAD` = 1 here), a `SyncPolicy`, or a `SyncConfig` (with options: merged with the ones it was made
    with, see `merge`).

    Besides the mode's own keys: `penalty` (a name from conf/penalty/, or None) and `penalty_options` (its keys),
    `rule` (a name from conf/optimizer/, e.g. "dana" or "fasgd", for the server instead of the one made from the
    torch optimizer) and `rule_options` (its keys), `servers` (server ranks; default 1 for async, ssp, psp, bfasgd,
    else 0), `backend` ("mpi" or "horovod"), `depth` (the partial allreduce's ring), `margin` (serverless backup:
    "auto", the default, waits after the round's n - b-th gradient for the others as long as the measured arrivals
    say nobody straggles (`backups.Margin`); a number waits that many seconds; None takes exactly the first n - b,
    000_...'s fixed b and collsync-train's `sync=backup`), `catch_up` (serverless backup: a worker late for a round
    applies every round the others completed meanwhile and skips as many of its batches, through
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
    if isinstance(sync, SyncPolicy):
        if options:
            raise ValueError(f"sync={sync.name}: options {sorted(options)} beside a SyncPolicy (set them on it)")
        policy = sync
    elif isinstance(sync, str):
        if sync not in MODES:
            raise ValueError(f"sync={sync!r} is not one of {', '.join(MODES)}")
        if sync == "ssp" and "max_lead" not in options:
            options["max_lead"] = SSP_MAX_LEAD
        policy = build(_node("sync", sync, options))
    else:
        raise TypeError(f"sync must be a mode name, a SyncPolicy or a SyncConfig, got {type(sync).__name__}")
    if servers is None:
        servers = 1 if policy.name in SERVER_MODES or not policy.rounds or policy.max_lead else 0
    if not isinstance(servers, int) or servers < 0:
        raise ValueError(f"sync={policy.name}: servers={servers!r} must be a whole number >= 0")
    if backend not in ("mpi", "horovod"):
        raise ValueError(f"sync={policy.name}: backend={backend!r} must be 'mpi' or 'horovod'")
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"sync={policy.name}: depth={depth!r} must be a whole number >= 1")
    try:
        check_margin(margin)
    except ValueError as exc:
        raise ValueError(f"sync={policy.name}: {str(exc).removeprefix('partial allreduce: ')}") from None
    if margin_given and (servers or policy.name != "backup"):
        raise ValueError(
            f"sync={policy.name}: margin={margin!r} is for serverless backup (sync='backup', servers=0), whose "
            "rounds are the k-of-n partial allreduce"
        )
    if catch_up not in (None, True, False):
        raise ValueError(f"sync={policy.name}: catch_up={catch_up!r} must be True, False or None (decide by itself)")
    if catch_up_given and (servers or policy.name != "backup"):
        raise ValueError(
            f"sync={policy.name}: catch_up={catch_up!r} is for serverless backup (sync='backup', servers=0), whose "
            "late workers skip to the current round"
        )
    penalty_node = None
    if penalty is not None:
        if penalty not in PENALTIES:
            raise ValueError(f"penalty={penalty!r} is not one of {', '.join(PENALTIES)}")
        given = sorted(penalty_options)
        penalty_node = {"name": penalty, "given": given, **_node("penalty", penalty, dict(penalty_options))}
    elif penalty_options:
        raise ValueError("penalty_options are for a penalty given by name (penalty='gap_aware', ...)")
    rule_node = None
    if rule is not None:
        if not isinstance(rule, str):
            raise TypeError(f"rule must be a name from conf/optimizer/ (e.g. 'dana'), got {type(rule).__name__}")
        rule_node = _node("optimizer", rule, dict(rule_options))
    elif rule_options:
        raise ValueError("rule_options are for a rule given by name (rule='dana', ...)")
    named = named if isinstance(sync, str) else None
    return SyncConfig(policy, penalty_node, servers, backend, depth, rule_node, scaled_lr, named, margin, catch_up)


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
    return SyncConfig(policy, penalty, servers, "mpi", runtime.depth, node("optimizer"))


def _group_value(optimizer: torch.optim.Optimizer, key: str) -> Any:
    values = {repr(g.get(key)) for g in optimizer.param_groups}
    if len(values) > 1:
        raise ValueError(
            f"{type(optimizer).__name__}: {key} differs between parameter groups ({', '.join(sorted(values))}); "
            "the parameter server applies one rule to every parameter"
        )
    return optimizer.param_groups[0].get(key)


def server_rule(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """collsync's rule for the server (as a config node), from a torch optimizer's class and hyperparameters.

    SGD(lr, momentum, nesterov, weight_decay) -> sgd / momentum / nesterov; Adam(lr, betas, eps, weight_decay) ->
    adam. Refused, with the reason: other classes, dampening, maximize, AMSGrad, decoupled weight decay (AdamW),
    hyperparameters that differ between parameter groups.
    """
    name = type(optimizer).__name__
    get = lambda key: _group_value(optimizer, key)  # noqa: E731 - a one-line accessor

    def refuse(key: str, value: Any) -> None:
        raise ValueError(f"DistributedOptimizer: the parameter server cannot apply {name} with {key}={value!r}")

    if get("maximize"):
        refuse("maximize", True)
    if type(optimizer) is torch.optim.SGD:
        if get("dampening"):
            refuse("dampening", get("dampening"))
        lr, mom, wd = float(get("lr")), float(get("momentum") or 0.0), float(get("weight_decay") or 0.0)
        if not mom:
            return {"_target_": "collsync.rules.sgd", "lr": lr, "weight_decay": wd}
        target = "collsync.rules.nesterov" if get("nesterov") else "collsync.rules.momentum"
        return {"_target_": target, "lr": lr, "momentum": mom, "weight_decay": wd}
    if type(optimizer) is torch.optim.Adam:
        if get("amsgrad"):
            refuse("amsgrad", True)
        if get("decoupled_weight_decay"):
            refuse("decoupled_weight_decay", True)
        beta1, beta2 = get("betas")
        return {
            "_target_": "collsync.rules.adam",
            "lr": float(get("lr")),
            "beta1": float(beta1),
            "beta2": float(beta2),
            "eps": float(get("eps")),
            "weight_decay": float(get("weight_decay") or 0.0),
        }
    raise ValueError(
        f"DistributedOptimizer: the parameter server has no rule for torch.optim.{name}; it maps SGD (momentum, "
        "nesterov, weight_decay) and Adam, or takes a collsync rule by name: DistributedOptimizer(..., rule='dana')"
    )


def server_lr(rule: dict[str, Any], policy: SyncPolicy, workers: int) -> dict[str, Any]:
    """The server's rule with the learning rate of a Horovod script rescaled to the gradients one update averages.

    A Horovod script scales its lr by size() for synchronous averaging (Goyal et al.'s linear scaling rule): eta =
    eta_1 x n for a mean of n gradients. The server's update averages g = `policy.quorum_for(n)` gradients (async,
    bfasgd and SpecSync over ASP: g = 1; PSP: its c; SSP's rounds: n), read up to s = `max_lead` rounds stale
    (0 but for SSP), so it applies

        eta_server = eta_script x g / n / (1 + s),

    the rule of Chen et al. (000_..., App. A: Async-Opt at gamma_0 = 0.045, Sync-Opt averaging N gradients at
    0.045 N, "so that the learning rates after computing the same number of datapoints are comparable") and of PSP's
    linear scaling by the number d of aggregated gradients (003_..., Alg. 1 line 13). One gradient at a time then
    steps as one worker alone would, which is the step Gap-Aware and DANA take as given (001_..., §5-6: no re-tuning
    of the single worker's hyperparameters). SSP's rounds take Staleness-Aware's step eta / tau (Zhang et al., 001_...
    Alg. 3) at the bound tau = 1 + s: Horovod's lr x n with momentum 0.9 on rounds up to 3 stale diverges (digits,
    4 workers: 0.38 accuracy after 10 epochs; 0.92 with the division). Where the server's rule is the look-ahead
    momentum (`collsync.rules.lookahead`, which `server_momentum` makes of a momentum SGD under SSP), the look-ahead
    takes one round of that staleness and the division is by max(1, s): the full lr at s = 1 (digits, 8 epochs:
    0.95-0.97, bsp 0.94-0.96; lr / 2 without the look-ahead 0.88-0.91), lr / 3 at s = 3 (0.91-0.92; the full lr with
    the look-ahead 0.84-0.94). Momentum and the rest are unchanged.
    """
    lead = policy.max_lead or 0
    staleness = max(1, lead) if rule.get("_target_") == LOOKAHEAD else 1 + lead
    factor = policy.quorum_for(workers) / workers / staleness
    if "lr" not in rule or factor == 1:
        return rule
    return {**rule, "lr": float(rule["lr"]) * factor}


def rule_for(optimizer: torch.optim.Optimizer, config: SyncConfig, workers: int) -> dict[str, Any]:
    """The rule the servers apply, as a config node: `config.rule` where one was named, else the torch optimizer's
    (`server_rule`), its lr rescaled (`server_lr`, unless `scaled_lr=False`) and its momentum made DANA where an
    update is one gradient (`server_momentum`). B-FASGD is refused without a named rule: its workers push and fetch
    by the signal FASGD's server publishes (002_... eq. 9), which no torch optimizer has."""
    if config.rule is not None:
        return config.rule
    policy = config.policy
    if policy.bandwidth_aware:
        raise ValueError(
            f"DistributedOptimizer(sync={policy.name!r}): B-FASGD's workers push and fetch by the signal of FASGD's "
            f"server (002_... eq. 9), which torch.optim.{type(optimizer).__name__} has not; pass rule='fasgd' (its "
            "lr is FASGD's alpha, default 10: a step of about alpha x std(g) x g / staleness), or use sync='async'"
        )
    rule = server_momentum(server_rule(optimizer), policy, workers)
    # The script's lr was scaled for size() gradients a step (Horovod's convention): see `server_lr`.
    return server_lr(rule, policy, workers) if config.scaled_lr else rule


MOMENTUM_RULES = ("collsync.rules.momentum", "collsync.rules.nesterov")
LOOKAHEAD = "collsync.rules.lookahead"


def server_momentum(rule: dict[str, Any], policy: SyncPolicy, workers: int) -> dict[str, Any]:
    """The server's rule with a momentum SGD made DANA where every update is one worker's gradient, and the
    look-ahead momentum where updates are SSP's rounds.

    With one gradient an update (async and SpecSync over ASP: `quorum_for(n) == 1`, no rounds), the torch
    optimizer's one momentum buffer would mix the workers' gradients, each computed on parameters several updates
    old, and average over 1 / (1 - gamma) updates where a synchronous run averages over as many rounds of n: a
    horizon n times shorter in samples, and staleness adds a momentum of its own (Mitliagkas et al., 2016). DANA
    (001_..., App. C.1, Alg. 6; Hakimi et al., "Taming momentum in a distributed asynchronous environment") keeps
    one momentum per worker and has the workers read a look-ahead of the parameters,

        v_i <- gamma v_i + g_i,    theta <- theta - eta v_i,    theta_hat = theta - eta gamma sum_j v_j,

    so each worker's momentum spans 1 / (1 - gamma) of its own gradients (the synchronous horizon) and the gradient
    is computed where the others' momentum is taking the parameters. With one worker it is Nesterov's momentum.
    Measured on examples/mnist.py (digits, 4 workers, 8 epochs, one worker 3x slower, 5 seeds): the torch
    optimizer's momentum ended at 0.921-0.951, DANA at the same lr and gamma at 0.954-0.969 (bsp: 0.949-0.960).
    It is collsync-train's default for async too (conf/sync/async.yaml). The lr, momentum and weight decay are the
    torch optimizer's (lr after `server_lr`); B-FASGD's fetch skipping (`transmit`) needs its own rule and is left
    alone, as is any mode whose updates average several gradients (DANA's v_i is one worker's).

    SSP's rounds (and SpecSync over SSP) average every worker's gradient, each read up to `max_lead` rounds stale,
    and in steady state at the bound (the leaders wait there: measured, every round's oldest read is s old). One
    momentum serves them, and `collsync.rules.lookahead` has the workers read DANA's estimate for rounds,
    theta - eta gamma (1 - gamma^d) / (1 - gamma) v with d the staleness measured (Nesterov: one gamma more), with
    the lr of `server_lr`. Measured on examples/mnist.py (4 workers, 8 epochs, max_lead 1, lr x size(), momentum
    0.9, seeds 0-2): the torch optimizer's momentum 0.85-0.91, the look-ahead 0.95-0.97 (bsp 0.94-0.96).
    """
    if rule.get("_target_") not in MOMENTUM_RULES:
        return rule
    keys = ("lr", "momentum", "weight_decay")
    node = {k: rule[k] for k in keys if k in rule}
    if policy.rounds and policy.max_lead:
        return {"_target_": LOOKAHEAD, **node, "nesterov": rule["_target_"] == "collsync.rules.nesterov"}
    one_at_a_time = not policy.rounds and policy.quorum_for(workers) == 1 and not policy.bandwidth_aware
    if not one_at_a_time:
        return rule
    return {"_target_": "collsync.rules.dana", **node}


def server_penalty(penalty: dict[str, Any] | None, rule: dict[str, Any]) -> dict[str, Any] | None:
    """The penalty node with Gap-Aware's eta_max and momentum taken from the server's rule, as
    conf/penalty/gap_aware.yaml takes them from `optimizer.lr` / `optimizer.momentum`, unless set explicitly."""
    if penalty is None:
        return None
    node = {k: v for k, v in penalty.items() if k != "name"}
    if penalty.get("name") == "gap_aware":
        given = penalty.get("given", ())
        if "eta_max" not in given and "lr" in rule:
            node["eta_max"] = rule["lr"]
        if "momentum" not in given:
            node["momentum"] = rule.get("momentum", rule.get("beta1", 0.0))
    node.pop("given", None)
    return node
