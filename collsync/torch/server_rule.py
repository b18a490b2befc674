"""The rule a `collsync.torch` script's servers apply, as a config node, from the user's torch optimizer: its class
and hyperparameters translated (`server_rule`), its lr rescaled to the gradients one update averages
(`server_lr`), its momentum made DANA or the look-ahead momentum where updates are one gradient or stale rounds
(`server_momentum`), and the penalty fitted to it (`server_penalty`; under async, where none is given, DANA-GA
with the Gap in rounds, `penalty_for`); `rule_for` puts them together. Worker 0 sends the nodes to the server
ranks, which build them (`config.build`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from collsync.policy import SyncPolicy

if TYPE_CHECKING:
    from collsync.torch.config import SyncConfig


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
    momentum (`collsync.rules.lookahead`, which `server_momentum` makes of a momentum SGD under SSP), the rule divides
    each round's step by max(1, its staleness) itself and the lr is left at n / n: the full lr at s = 1 (digits, 8
    epochs: 0.95-0.97, bsp 0.94-0.96; lr / 2 without the look-ahead 0.88-0.91), about lr / 3 at s = 3 (0.91-0.92; the
    full lr with the look-ahead 0.84-0.94). Momentum and the rest are unchanged.
    """
    lead = policy.max_lead or 0
    staleness = 1 if rule.get("_target_") == LOOKAHEAD else 1 + lead
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
DANA = "collsync.rules.dana"


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
    It is collsync-train's default optimizer for async too (conf/sync/async.yaml), and as there the Gap-Aware
    penalty counted in rounds comes with it unless a penalty is given (`penalty_for`). The lr, momentum and weight
    decay are the torch optimizer's (lr after `server_lr`); B-FASGD's fetch skipping (`transmit`) needs its own rule
    and is left alone, as is any mode whose updates average several gradients (DANA's v_i is one worker's).

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
    return {"_target_": DANA, **node}


# async's penalty where the script names none and the servers made DANA of its momentum SGD: collsync-train's
# default pair (conf/optimizer/dana_ga_round.yaml), so both fronts build the same rule.
ASYNC_PENALTY = "gap_aware_round"
GAP_PENALTIES = ("gap_aware", ASYNC_PENALTY)


def penalty_for(config: SyncConfig, rule: dict[str, Any]) -> dict[str, Any] | None:
    """The penalty the servers apply with `rule` (as `rule_for` made it), as a config node (None: none).

    The penalty the script gave (`sync_config(penalty=...)`, `penalty="none"` included), fitted to the rule by
    `server_penalty`. Where it gave none, the mode is async (or SpecSync over ASP, async with re-syncs) and the
    servers made DANA of the torch optimizer
    (`server_momentum`; not a rule named by `rule=`, which is collsync-train's `optimizer=`), DANA-GA (001_...
    Alg. 8) with the Gap counted in rounds of N = workers updates, `conf/penalty/gap_aware_round.yaml`:

        G = |theta_k - theta_read| / C + 1,    C = N eta_max sqrt(m_hat) + eps,    eta_max = the server's lr,

    i.e. Alg. 14 at eta_max = N x the per-gradient lr (`server_lr`): the lr of the script's synchronous rounds.
    collsync-train's `sync=async` composes the same pair, so both fronts build the same rule. SpecSync over ASP got
    plain DANA before: on the Fashion-MNIST CNN with one worker 3x slower it ended 0.8 points below Horovod (median of
    5), with the Gap 1.0 above (3 repeats; 8 runs of seeds 0-4 at 0.839-0.856), other scenarios within their spread
    (benchmarks/README.md, "SpecSync with async's Gap").
    """
    from collsync.torch.config import _penalty_node  # lazily: config imports this module

    penalty = config.penalty
    # DANA is made only where every update is one gradient (`server_momentum`): async and SpecSync over ASP.
    if penalty is None and config.rule is None and rule.get("_target_") == DANA:
        penalty = _penalty_node(ASYNC_PENALTY, {})
    return server_penalty(penalty, rule)


def server_penalty(penalty: dict[str, Any] | None, rule: dict[str, Any]) -> dict[str, Any] | None:
    """The penalty node with Gap-Aware's eta_max and momentum taken from the server's rule, as
    conf/penalty/gap_aware.yaml (and gap_aware_round.yaml) take them from `optimizer.lr` / `optimizer.momentum`,
    unless set explicitly."""
    if penalty is None:
        return None
    node = {k: v for k, v in penalty.items() if k != "name"}
    if penalty.get("name") in GAP_PENALTIES:
        given = penalty.get("given", ())
        if "eta_max" not in given and "lr" in rule:
            node["eta_max"] = rule["lr"]
        if "momentum" not in given:
            node["momentum"] = rule.get("momentum", rule.get("beta1", 0.0))
    node.pop("given", None)
    return node
