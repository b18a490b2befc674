"""SSP on the small CNN (issue 34, item 3), in the simulator: bsp against ssp at bound 1, as `collsync.torch` runs
`examples/mnist.py --model cnn` (4 workers, batch 32, Horovod's lr 0.02 x 4 = 0.08 and momentum 0.9; the servers'
rule `collsync.rules.lookahead` at that lr), several seeds, every batch 1 model second (`none`: SSP's staleness
alone) or 001_... App. C.3's heterogeneous gamma workers (`het`). Digits by default (the example's 75/25 split of
scikit-learn's digits), or the first `--rows` of Fashion-MNIST's training images (all 10,000 tests) with `--data
fashion`.

The sides besides bsp and the default (`lookahead`) are the candidates studied for ssp's default: Nesterov's form of
the look-ahead (= Kosson et al.'s spike compensation at a delay of 1, "Pipelined backpropagation at scale", 2021),
momentum reduced for the implicit momentum of one round's staleness (Mitliagkas et al., 2016: 1 - (1 - 0.9) / (1 -
0.5) = 0.8, at the same eta / (1 - gamma)), the lr halved, and a view extrapolated with the last round's gradient
(`extrapolated`: theta - eta (c1 v + c2 g), module `--stability`). `pending` is a server-side prototype, not a rule:
the workers read the look-ahead minus eta (1 + gamma) x the round's gradients already arrived / n, the part of the
next update the server already holds (`pending_filled`: each gradient still to come counted as the last round's
mean). `lookahead_gap_aware`: the default behind Gap-Aware (001_... Alg. 4) with the Gap in rounds (eta_max = 2 lr).

    python benchmarks/ssp_cnn.py [--data digits|fashion] [--seeds 5] [--epochs 20] [--sides ...] [--timings ...]
    python benchmarks/ssp_cnn.py --stability     # the largest stable lr x h of each candidate on a quadratic
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from collsync import stragglers
from collsync.data import Batches, digits, fashion_mnist
from collsync.flat import FlatModel
from collsync.loops import Gradients
from collsync.models import cnn
from collsync.policy import SyncPolicy, bsp, ssp
from collsync.rules import LookaheadState, Rule, gap_aware, lookahead, momentum
from collsync.server import Server
from collsync.sim import Simulator
from collsync.types import Context, Flat

GAMMA = 0.9
TIMINGS: dict[str, Any] = {"none": None, "het": stragglers.gamma_heterogeneous()}


class ExtrapolatedState(NamedTuple):
    """Heavy ball's v, the last round's mean gradient g, and the step eta of the last round (0 while none was
    stale: the view is theta, as bsp's)."""

    v: torch.Tensor
    g: torch.Tensor
    eta: float


def extrapolated(lr: float, gamma: float, c1: float, c2: float) -> Rule:
    """Heavy ball, v <- gamma v + g; delta = -eta v, read at view = theta - eta (c1 v + c2 g) once a round was
    stale: the momentum part of the look-ahead plus the last round's gradient standing in for the round still
    pending (c1 = gamma, c2 = 1: theta_{k+1} with g_k ~ g_{k-1})."""

    def init(params: Flat) -> ExtrapolatedState:
        return ExtrapolatedState(torch.zeros_like(params), torch.zeros_like(params), 0.0)

    def update(grad: Flat, state: ExtrapolatedState, params: Flat, ctx: Context) -> tuple[Flat, ExtrapolatedState]:
        v = state.v * gamma + grad
        return v * -lr, ExtrapolatedState(v, grad.clone(), lr if ctx.staleness > 0 else 0.0)

    def view(params: Flat, state: ExtrapolatedState) -> Flat:
        return params if state.eta == 0 else params - state.eta * (c1 * state.v + c2 * state.g)

    return Rule(init, update, view)


class PendingServer(Server):
    """The prototype `pending`: the look-ahead minus eta (1 + gamma) x the arrived gradients of the round not yet
    applied / n (they enter v in the next update and move the parameters in it and, by gamma, in the one after).
    `FilledServer` (`pending_filled`) counts each gradient still to come as the last round's mean."""

    fill = False

    def _step(self, mean: Flat, batch: list[Any], stats: dict[str, list[float]] | None = None) -> None:
        self.last_mean = mean.clone()  # before the in-place optimizer writes its delta over it
        super()._step(mean, batch, stats)

    def view(self) -> Flat:
        base = super().view()
        arrived = [a.grad for a in self.pending.get(self.version, []) if a.grad is not None]
        state = self.opt_state
        if not isinstance(state, LookaheadState) or state.eta == 0:
            return base
        total = torch.zeros_like(base)
        for grad in arrived:
            total += grad
        if self.fill and hasattr(self, "last_mean"):  # from the second round on
            total += (self.workers - len(arrived)) * self.last_mean
        return base - (state.eta * (1 + GAMMA) / self.workers) * total


class FilledServer(PendingServer):
    fill = True


Side = tuple[SyncPolicy, Rule, type[Server], Rule | None]  # policy, rule, server class, penalty


def sides(lr: float) -> dict[str, Callable[[], Side]]:
    """Each side's policy, rule, server class and penalty, at the lr of a round."""

    def bound1() -> SyncPolicy:
        return ssp(max_lead=1)

    return {
        "bsp": lambda: (bsp(), momentum(lr=lr, momentum=GAMMA), Server, None),
        "lookahead": lambda: (bound1(), lookahead(lr=lr, momentum=GAMMA), Server, None),
        "lookahead_nesterov": lambda: (bound1(), lookahead(lr=lr, momentum=GAMMA, nesterov=True), Server, None),
        "lookahead_m0.8": lambda: (bound1(), lookahead(lr=lr * (1 - 0.8) / (1 - GAMMA), momentum=0.8), Server, None),
        "lookahead_lr_half": lambda: (bound1(), lookahead(lr=lr / 2, momentum=GAMMA), Server, None),
        "extrapolated_0.45_0.75": lambda: (bound1(), extrapolated(lr, GAMMA, 0.45, 0.75), Server, None),
        "extrapolated_0.45_1": lambda: (bound1(), extrapolated(lr, GAMMA, 0.45, 1.0), Server, None),
        "extrapolated_0_1.5": lambda: (bound1(), extrapolated(lr, GAMMA, 0.0, 1.5), Server, None),
        "pending": lambda: (bound1(), lookahead(lr=lr, momentum=GAMMA), PendingServer, None),
        "pending_filled": lambda: (bound1(), lookahead(lr=lr, momentum=GAMMA), FilledServer, None),
        "lookahead_gap_aware": lambda: (
            bound1(),
            lookahead(lr=lr, momentum=GAMMA),
            Server,
            gap_aware(2 * lr, momentum=GAMMA),
        ),
    }


def final_accuracy(data: Any, side: Side, steps: int, seed: int, workers: int, batch: int, timing: Any) -> float:
    """One simulated run's test accuracy after `steps` rounds."""
    policy, rule, server_class, penalty = side
    flat = FlatModel(cnn(data.input_shape, data.classes, seed=seed))
    sim = Simulator(workers, timing, seed=seed)
    server = server_class(flat.params.clone(), rule, policy, workers, steps=steps, trace=sim.trace, penalty=penalty)
    sim.run(server, Gradients(flat, Batches(data, workers, batch, seed)))
    flat.load(server.params)
    with torch.no_grad():
        return float((flat.module(data.x_test).argmax(1) == data.y_test).float().mean())


class Linear(NamedTuple):
    """A candidate on the quadratic: v <- gamma v + g; x <- x - eta (a v + b g); view = x - eta (c1 v + c2 g)."""

    a: float = 1.0
    b: float = 0.0
    c1: float = 0.0
    c2: float = 0.0
    gamma: float = GAMMA
    lr: float = 1.0  # the rule's lr in units of the synchronous one


def _bounded(rule: Linear, eta_h: float, stale: float, steps: int = 3000) -> bool:
    """Whether SSP's rounds on f = h x^2 / 2 stay bounded: round k's mean gradient is h (stale x view_{k-1} + (1 -
    stale) x view_k), `stale` the share of its gradients read one version before it is applied."""
    eh = eta_h * rule.lr
    x, v, views = 1.0, 0.0, [1.0, 1.0]
    for _ in range(steps):
        g = stale * views[0] + (1 - stale) * views[1]
        v = rule.gamma * v + g
        x -= eh * (rule.a * v + rule.b * g)
        views = [views[1], x - eh * (rule.c1 * v + rule.c2 * g)]
        if abs(x) > 1e6:
            return False
    return abs(x) <= 1.0


def largest_stable(rule: Linear, stale: float) -> float:
    """The largest eta x h (eta the synchronous lr) at which the rounds stay bounded, by bisection on a log scale."""
    low, high = 1e-4, 10.0
    while high / low > 1.002:
        mid = (low * high) ** 0.5
        low, high = (mid, high) if _bounded(rule, mid, stale) else (low, mid)
    return low


def stability() -> None:
    """The candidates' largest stable lr x h at one round of staleness (`--stability`)."""
    d1, d2 = GAMMA, GAMMA + GAMMA**2  # D(1), D(2): the look-ahead before and now (collsync.rules.lookahead)
    candidates = {
        "heavy ball, no look-ahead": Linear(),
        "look-ahead D(1) (the rule before)": Linear(c1=d1),
        "look-ahead D(2) (the default)": Linear(c1=d2),
        "Nesterov / spike compensation, look-ahead gamma D(2)": Linear(a=GAMMA, b=1.0, c1=GAMMA * d2),
        "momentum 0.8 at eta x 2, look-ahead D(2)": Linear(c1=0.8 + 0.64, gamma=0.8, lr=2.0),
        "momentum 0.5 at eta x 5, look-ahead D(2)": Linear(c1=0.5 + 0.25, gamma=0.5, lr=5.0),
        "look-ahead D(2) at eta / 2": Linear(c1=d2, lr=0.5),
        "extrapolated, c1 0.45 c2 0.75": Linear(c1=0.45, c2=0.75),
        "extrapolated, c1 0.45 c2 1": Linear(c1=0.45, c2=1.0),
        "extrapolated, c1 0 c2 1.5": Linear(c2=1.5),
    }
    print(f"bsp (fresh rounds): {largest_stable(Linear(), 0.0):.3f}")
    print("candidate: largest stable lr x h with every gradient one round stale / 3 of 4 (4 equal workers)")
    for name, rule in candidates.items():
        print(f"{name}: {largest_stable(rule, 1.0):.3f} / {largest_stable(rule, 0.75):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="digits", choices=["digits", "fashion"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=12000, help="--data fashion: the first N training images")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.08, help="the lr of a round (Horovod's lr x size())")
    parser.add_argument("--sides", nargs="+", default=["bsp", "lookahead"], choices=list(sides(0.08)))
    parser.add_argument("--timings", nargs="+", default=["none"], choices=list(TIMINGS))
    parser.add_argument("--stability", action="store_true", help="only the quadratic's stability bounds")
    args = parser.parse_args()
    if args.stability:
        stability()
        return
    torch.set_num_threads(1)
    data = digits(flatten=False)
    if args.data == "fashion":
        full = fashion_mnist(flatten=False)
        data = full._replace(x_train=full.x_train[: args.rows], y_train=full.y_train[: args.rows])
    steps = args.epochs * (len(data.y_train) // (args.workers * args.batch))
    made = sides(args.lr)
    results: dict[tuple[str, str], list[float]] = {}
    started = time.perf_counter()
    for seed in range(args.seeds):  # interleaved: seed by seed, every side and timing
        for name in args.sides:
            # bsp's rounds hold the same gradients whatever the timing: one run serves every timing
            for timing in ["-"] if name == "bsp" else args.timings:
                acc = final_accuracy(data, made[name](), steps, seed, args.workers, args.batch, TIMINGS.get(timing))
                results.setdefault((name, timing), []).append(acc)
                print(f"{name} / {timing}, seed {seed}: {acc:.4f}", flush=True)
    base = statistics.median(results[("bsp", "-")]) if ("bsp", "-") in results else float("nan")
    print(f"\n{args.data}, {steps} rounds, {args.seeds} seeds ({time.perf_counter() - started:.0f} s)")
    for (name, timing), accs in results.items():
        med = statistics.median(accs)
        print(
            f"{name} / {timing}: median {med:.4f} ({min(accs):.4f}-{max(accs):.4f}), "
            f"{100 * (med - base):+.2f} points vs bsp"
        )


if __name__ == "__main__":
    main()
