"""Gap-Aware (GA): divide a stale gradient by its Gap (001_... §5, Alg. 4, eqs. 12-13; C from Alg. 14, App. C.6).

The Gap measures staleness by distance instead of delay: the number of updates of average size it takes to travel
from the parameters the worker read to the server's current ones,

    G = |theta_k - theta_read| / C + 1,        C = eta_max * sqrt(m_hat) + eps                 (eq. 13, Alg. 14)

and the *gradient* is divided by G before the optimizer (so momentum holds penalised gradients: no
under-penalising, 001_... §4.1). Three granularities (§5.3): `parameter` (eq. 13, the paper's default), `layer`
(eq. 12: one G per layer from L2 norms) and `global` (Definition 1: one G from the L2 norm of the whole vector).

theta_read comes from the server, which keeps the parameters (the *view*) each worker read, as 001_... App. D.1
does (one copy per worker on the master), and passes them as `ctx.read` because this rule sets `needs_read`.
Under DANA the view is the look-ahead estimate, which is exactly the theta_i of DANA-GA (001_... Alg. 8).

`unit="round"` counts the Gap in rounds of N = `ctx.workers` updates instead of single updates,
C = N eta_max sqrt(m_hat) + eps: Alg. 14 with eta_max = N x lr. Every asynchronous gradient is about N - 1 updates
stale, a drift 001_... C.13 says "should be allowed to go un-penalized"; only drift beyond about a round is
divided down. It is async's default penalty with DANA (conf/optimizer/dana_ga_round.yaml; benchmarks/README.md,
"Async on the CNN").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from collsync.rules.base import Rule, check_decay, check_positive, check_unit, decayed, zeros_like
from collsync.types import Context, Flat

GRANULARITIES = ("parameter", "layer", "global")
UNITS = ("update", "round")

Spans = list[tuple[int, int]]


class GapAwareState(NamedTuple):
    """Alg. 14's update step v <- gamma v + g (per parameter), its biased second moment m (per parameter; per layer
    for `layer`, of ||v_p||^2; a single entry of ||v||^2 for `global`) and the number of gradients seen (the k of
    the bias correction 1 - beta^k)."""

    v: torch.Tensor
    m: torch.Tensor
    k: int
    gap: float = 1.0  # mean Gap G of the last gradient penalised: a diagnostic for 001_... Fig. 4, not state


def gap_aware(
    eta_max: float = 0.1,
    beta: float = 0.999,
    eps: float = 1e-8,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    granularity: str = "parameter",
    layers: Spans | None = None,
    unit: str = "update",
) -> Rule:
    """Gap-Aware penalty (001_... Alg. 4): g' = (g + lambda theta) / G, chained before the optimizer.

    C follows Alg. 14 on every arrival, *before* the Gap is measured (so the first gradient already has a C):

        v <- gamma v + g;   m <- beta m + (1 - beta) v^2;   m_hat = m / (1 - beta^k);   C = eta_max sqrt(m_hat) + eps

    `eta_max` is Alg. 14's eta_max ("usually eta_1": the optimizer's base learning rate), `beta` its beta_1 (0.999 in
    the paper; renamed so it cannot be mistaken for Adam's beta1 in `adam_ga`), `eps` its epsilon (1e-8) and
    `momentum` its gamma, the optimizer's momentum coefficient. Alg. 14 keeps its own v of *unpenalised* gradients,
    so this rule does too, whatever the optimizer downstream. For `layer` and `global`, v^2 and |theta_k -
    theta_read| become squared and plain L2 norms over each layer (C_p = eta_max sqrt(E||v_p||^2) + eps estimates
    Definition 1's eta_max E||grad f||).

    `weight_decay` (lambda) is added to the gradient *before* it is penalised, as App. C.5 prescribes; leave the
    optimizer's own `weight_decay` at 0 then. `layers` lists (start, stop) of each layer in the flat vector (e.g.
    from `FlatModel.layers`) and is used only by `granularity="layer"`; without it the whole vector is one layer,
    which makes `layer` the same as `global`.

    `unit` is what one Gap counts: "update" (Alg. 14 as printed, C the size of one update) or "round", the size of
    N = `ctx.workers` updates, C = N eta_max sqrt(m_hat) + eps (the module docstring): the number of workers is the
    server's, so every front (simulator, collsync-train over MPI, collsync.torch) measures it the same way.
    """
    return gap_rule(
        "gap_aware",
        eta_max=eta_max,
        beta=beta,
        eps=eps,
        momentum=momentum,
        weight_decay=weight_decay,
        granularity=granularity,
        layers=layers,
        unit=unit,
    )


def gap_rule(
    name: str,
    *,
    eta_max: float,
    beta: float,
    eps: float,
    momentum: float,
    weight_decay: float,
    granularity: str,
    layers: Spans | None,
    eps_key: str = "eps",
    unit: str = "update",
) -> Rule:
    """`gap_aware` under another name (errors name `name` and `eps_key`): Adam-GA measures its Gap with it."""
    check_positive(name, "eta_max", eta_max)
    check_unit(name, "beta", beta)
    check_positive(name, eps_key, eps)
    check_unit(name, "momentum", momentum)
    check_decay(name, weight_decay)
    if granularity not in GRANULARITIES:
        raise ValueError(f"{name}: {granularity=} must be one of {GRANULARITIES}")
    if unit not in UNITS:
        raise ValueError(f"{name}: {unit=} must be one of {UNITS}")
    spans = _check_spans(name, layers) if layers is not None and granularity == "layer" else None

    def groups(d: int) -> Spans:
        if spans is None:
            return [(0, d)]
        if spans[-1][1] != d:
            raise ValueError(f"{name}: layers end at {spans[-1][1]} but the parameters have {d} entries")
        return spans

    def init(params: Flat) -> GapAwareState:
        m = zeros_like(params) if granularity == "parameter" else params.new_zeros(len(groups(params.numel())))
        return GapAwareState(zeros_like(params), m, 0)

    def update(grad: Flat, state: GapAwareState, params: Flat, ctx: Context) -> tuple[Flat, GapAwareState]:
        if ctx.read is None:
            raise ValueError(
                f"{name}: ctx.read is None; the server fills it for rules with needs_read=True, and for an optimizer "
                "only when an update holds one gradient (sync=async, quorum 1)"
            )
        g = decayed(grad, params, weight_decay)
        count = state.k + 1
        v = state.v * momentum + g
        correction = 1 - beta**count
        # C's step size: one update's (Alg. 14), or a round's of every worker's update.
        eta = eta_max * ctx.workers if unit == "round" else eta_max
        diff = params - ctx.read
        if granularity == "parameter":
            m = state.m * beta + (1 - beta) * v * v
            c = torch.sqrt(m / correction) * eta + eps
            gap = diff.abs() / c + 1
        else:
            spans_d = groups(params.numel())
            m = state.m * beta + (1 - beta) * _sums(v * v, spans_d)
            c = torch.sqrt(m / correction) * eta + eps
            gap = _spread(torch.sqrt(_sums(diff * diff, spans_d)) / c + 1, spans_d)
        # At theta_read == theta_k the Gap is exactly 1 and g / 1 == g: a fresh gradient passes unchanged.
        return g / gap, GapAwareState(v, m, count, float(gap.mean()))

    return Rule(init, update, needs_read=True, stats=gap_stats)


def gap_stats(state: GapAwareState) -> dict[str, float]:
    """The mean Gap G of the last gradient penalised (001_... Fig. 4 plots it against the delay)."""
    return {"gap": state.gap}


def _check_spans(name: str, layers: Spans) -> Spans:
    spans = [(int(start), int(stop)) for start, stop in layers]
    if not spans:
        raise ValueError(f"{name}: layers must list at least one (start, stop)")
    expected = 0
    for start, stop in spans:
        if start != expected or stop <= start:
            raise ValueError(f"{name}: layers must tile the vector in order; got {(start, stop)} after {expected}")
        expected = stop
    return spans


def _sums(x: torch.Tensor, spans: Spans) -> torch.Tensor:
    """Per-layer sums, in a fixed order (deterministic on every device, unlike index_add_ on CUDA)."""
    if len(spans) == 1:
        return x.sum().reshape(1)
    return torch.stack([x[start:stop].sum() for start, stop in spans])


def _spread(per_layer: torch.Tensor, spans: Spans) -> torch.Tensor:
    """One value per layer -> one value per parameter."""
    sizes = torch.tensor([stop - start for start, stop in spans], device=per_layer.device)
    return torch.repeat_interleave(per_layer, sizes)
