"""FASGD's step per parameter on the recipe studies' task (the small CNN on digits shifted by 1 pixel, batch 16).

    python benchmarks/fasgd_step.py

FASGD (002_... eqs. 6-8) steps alpha / (v tau) per unit of gradient, with v a moving mean of 1 / std: this feeds 50
fresh gradients at the initial parameters to `fasgd(lr=1)` and prints the spread of 1 / v, next to SASGD's
lr / tau, to show which alpha would match SASGD's step (`results/fasgd_recipe/`).
"""

from __future__ import annotations

from collsync.data import Batches, digits
from collsync.flat import FlatModel
from collsync.loops import Gradients
from collsync.models import cnn
from collsync.rules import fasgd
from collsync.types import Context


def main() -> None:
    data = digits(flatten=False, shift=1)
    flat = FlatModel(cnn(channels=[16, 32], hidden=64, input_shape=data.input_shape, classes=10, seed=0))
    grads = Gradients(flat, Batches(data, 1, 16, seed=0))
    params = flat.params.clone()
    rule = fasgd(lr=1.0)
    state = rule.init(params)
    for k in range(50):
        _, state = rule.update(grads(params, 0, k), state, params, Context(k, 0, 0, 1, None, 1))
    inv_v = 1.0 / state.v
    q = [float(inv_v.quantile(p)) for p in (0.1, 0.5, 0.9)]
    mean = float(inv_v.mean())
    print(f"1/v per parameter (alpha 1, tau 1): 10% {q[0]:.2e}  median {q[1]:.2e}  90% {q[2]:.2e}  mean {mean:.2e}")
    for alpha, tau in ((3, 15), (300, 15), (3, 4)):
        print(f"alpha {alpha}, tau {tau}: median step per unit gradient {alpha * q[1] / tau:.2e}")
    for lr, tau in ((0.1, 15), (0.1, 4)):
        print(f"SASGD lr {lr}, tau {tau}: {lr / tau:.2e}")


if __name__ == "__main__":
    main()
