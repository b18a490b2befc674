"""Asynchronous soak of the parameter-server mailbox on MPI windows: many pushes of a large model, random delays.

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/mpi_soak.py --pushes 20000 --numel 1000000 \\
        [--max-delay-us 200] [--seed 0] [--rule sgd|momentum] [--out benchmarks/results/mpi_soak.json]

Rank 0 runs `run_server` (ASGD: `asynchronous()`, quorum 1, `steps=--pushes` updates, a `Trace`) on a
`WindowMailbox`; every other rank runs `run_worker`. Worker w's j-th gradient is a deterministic function of
(seed, w, j): a fixed random direction of worker w scaled by a scalar drawn from (seed, w, j), so it costs one
multiply to make and can be made again on rank 0. Before each gradient a worker sleeps a random delay (uniform in
[0, max-delay], one in a hundred 20 times longer: a short stall that lets the other workers' pushes pile up), and
the server sleeps one after each update (so workers also wait on full slots). Once the server has its `steps`
updates it publishes `done`; what is still in flight is dropped.

Checked on rank 0 afterwards:

* `check_trace`: every pushed gradient is applied or dropped exactly once, updates numbered 1, 2, ..., one
  gradient each, staleness never negative;
* the pushes the server recorded, per worker, equal the gradients each worker says it sent; applied + dropped ==
  sent (from the trace and from the server's counters), and applied == steps;
* replay: a fresh `Server` fed the accepted gradients in apply order, each made again from (worker, send index) --
  one slot per worker keeps each worker's pushes in order, so the n-th push of worker w in the trace is its n-th
  gradient -- ends with parameters bitwise equal to the server's. This checks the bytes moved through the windows
  as well as the bookkeeping: a torn or misdelivered gradient would change the parameters.

Prints one line (pushes/s, MB/s pushed and pulled) and, with --out, writes the result as JSON. Exits 1 (every
rank) if a check failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from collsync.checks import TraceError, check_trace
from collsync.loops import Worker, run_server, run_worker
from collsync.policy import asynchronous
from collsync.rules import Rule, momentum, sgd
from collsync.runtime.mpi_rma import WindowMailbox
from collsync.server import Server, replay
from collsync.trace import Trace
from collsync.types import Arrival, Flat

RULES: dict[str, Callable[[], Rule]] = {
    # Small steps: 20,000 updates stay far from float32 overflow.
    "sgd": lambda: sgd(lr=1e-3),
    "momentum": lambda: momentum(lr=1e-4, momentum=0.9),
}


class SoakGradients:
    """Worker w's j-th gradient: d_w * s(w, j), d_w a fixed standard-normal vector of worker w, s(w, j) uniform in
    [-1, 1) drawn from (seed, w, j). The same on every rank and every call, and cheap: one multiply per gradient."""

    def __init__(self, numel: int, seed: int) -> None:
        self.numel, self.seed = numel, seed
        self._direction: dict[int, Flat] = {}

    def direction(self, worker: int) -> Flat:
        if worker not in self._direction:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + worker + 1)
            self._direction[worker] = torch.randn(self.numel, generator=gen, dtype=torch.float32)
        return self._direction[worker]

    def scale(self, worker: int, index: int) -> float:
        return random.Random((self.seed * 1_000_003 + worker) * 1_000_003 + index).uniform(-1.0, 1.0)

    def __call__(self, worker: int, index: int) -> Flat:
        return self.direction(worker) * self.scale(worker, index)


def start_params(numel: int, seed: int) -> Flat:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def pauser(seed: int, stream: int, max_delay_us: float) -> Callable[[], None]:
    """A seeded random pause: uniform in [0, max_delay_us] microseconds, one in a hundred 20 times longer."""
    rng = random.Random(seed * 7919 + stream)
    longest = max_delay_us * 1e-6

    def pause() -> None:
        delay = rng.random() * longest
        if rng.random() < 0.01:
            delay *= 20
        if delay > 0:
            time.sleep(delay)

    return pause


def accepted(trace: Trace, gradients: SoakGradients) -> Iterator[Arrival]:
    """The gradients the server applied, in apply order, made again from (worker, send index).

    Each push event takes the next send index of its worker; each apply (or drop) settles the oldest unsettled
    push of that worker, which must carry the same clock and version. Raises TraceError where they disagree.
    """
    unsettled: dict[int, deque[tuple[int, int, int]]] = {}
    sent: Counter[int] = Counter()

    def settle(worker: int, clock: int, version: int, what: str) -> int:
        queue = unsettled.get(worker)
        if not queue:
            raise TraceError(f"{what} of worker {worker} (clock {clock}, version {version}) that it never pushed")
        index, c, v = queue.popleft()
        if (c, v) != (clock, version):
            raise TraceError(
                f"{what} of worker {worker}: clock {clock}, version {version}, but its oldest unsettled push "
                f"(send {index}) had clock {c}, version {v}"
            )
        return index

    for e in trace.events:
        if e["ev"] == "push":
            w = e["worker"]
            unsettled.setdefault(w, deque()).append((sent[w], e["clock"], e["version"]))
            sent[w] += 1
        elif e["ev"] == "drop":
            settle(e["worker"], e["clock"], e["version"], "drop")
        elif e["ev"] == "apply":
            before = e["version"] - 1
            for w, c, s in zip(e["workers"], e["clocks"], e["staleness"], strict=True):
                index = settle(w, c, before - s, "apply")
                yield Arrival(w, before - s, gradients(w, index), c)


def soak(
    comm: Any,
    *,
    pushes: int,
    numel: int,
    max_delay_us: float = 200.0,
    seed: int = 0,
    rule: str = "sgd",
) -> dict[str, Any]:
    """Collective over `comm` (>= 2 ranks): run the soak, check it on rank 0; every rank gets the result, whose
    `errors` lists every check that failed (empty: all passed)."""
    from mpi4py import MPI

    size = comm.Get_size()
    if size < 2:
        raise ValueError(f"soak: a world of {size} rank(s) has no worker beside the server; launch at least 2 ranks")
    if pushes < 1 or numel < 1 or max_delay_us < 0:
        raise ValueError(f"soak: {pushes=} and {numel=} must be >= 1, {max_delay_us=} >= 0")
    if rule not in RULES:
        raise ValueError(f"soak: rule={rule!r} must be one of {sorted(RULES)}")
    workers = size - 1
    policy = asynchronous()
    gradients = SoakGradients(numel, seed)
    result: dict[str, Any] = {}
    with WindowMailbox(comm, numel, server_rank=0, dtype=torch.float32) as box:
        if box.is_server:
            start = start_params(numel, seed)
            trace = Trace()
            server = Server(start, RULES[rule](), policy, workers, steps=pushes, trace=trace)
            pause = pauser(seed, 0, max_delay_us)
        else:
            worker = Worker(box.worker, policy, seed=seed)
            pause = pauser(seed, box.worker + 1, max_delay_us)
            params = torch.empty(numel, dtype=torch.float32)

            def grads(read: Flat, w: int, index: int) -> Flat:
                pause()
                return gradients(w, index)

            gradients.direction(box.worker)  # made before the clock starts
        comm.Barrier()
        t0 = time.perf_counter()
        if box.is_server:
            run_server(server, box, on_update=lambda _: pause())
            sent = 0
        else:
            sent = run_worker(worker, box, grads, params)
        comm.Barrier()
        seconds = time.perf_counter() - t0
        counts = comm.gather((box.worker, sent, box.bytes_pushed, box.bytes_fetched), root=0)
    if comm.Get_rank() == 0:
        t1 = time.perf_counter()
        result = check(trace, server, start, rule, gradients, counts, workers, pushes)
        result["replay_seconds"] = time.perf_counter() - t1
        pushed_bytes = sum(c[2] for c in counts)
        fetched_bytes = sum(c[3] for c in counts)
        result.update(
            {
                "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                "ranks": size,
                "workers": workers,
                "numel": numel,
                "rule": rule,
                "seed": seed,
                "max_delay_us": max_delay_us,
                "target_pushes": pushes,
                "seconds": seconds,
                "pushes_per_s": result["sent"] / seconds,
                "push_MBps": pushed_bytes / seconds / 1e6,
                "pull_MBps": fetched_bytes / seconds / 1e6,
                "bytes_pushed": pushed_bytes,
                "bytes_fetched": fetched_bytes,
            }
        )
    # Workers wait for rank 0's checks without spinning in MPI: they would take the cores its replay runs on.
    done = comm.Ibarrier()
    while not done.Test():
        time.sleep(1e-3)
    return comm.bcast(result, root=0)


def check(
    trace: Trace,
    server: Server,
    start: Flat,
    rule: str,
    gradients: SoakGradients,
    counts: list[tuple[int, int, int, int]],
    workers: int,
    pushes: int,
) -> dict[str, Any]:
    """Rank 0's checks of a finished soak (see the module docstring); returns counts and `errors`."""
    errors: list[str] = []
    sends = [0] * workers
    for w, n, _, _ in counts:
        if w >= 0:
            sends[w] = n
    sent = sum(sends)
    try:
        totals = check_trace(trace, server.policy, workers)
    except TraceError as e:
        errors.append(str(e))
        totals = {"pushed": len(trace.of("push")), "applied": -1, "dropped": -1, "updates": -1}
    by_worker = Counter(e["worker"] for e in trace.of("push"))
    recorded = [by_worker[w] for w in range(workers)]
    if recorded != sends:
        errors.append(f"pushes recorded per worker {recorded} != gradients sent per worker {sends}")
    if totals["applied"] + totals["dropped"] != sent:
        errors.append(f"trace: applied {totals['applied']} + dropped {totals['dropped']} != sent {sent}")
    if server.applied + server.dropped != sent:
        errors.append(f"server: applied {server.applied} + dropped {server.dropped} != sent {sent}")
    if server.applied != pushes or server.version != pushes:
        errors.append(f"server applied {server.applied} gradients in {server.version} updates, wanted {pushes}")
    equal = False
    try:
        # replay only iterates over the arrivals: a generator keeps one gradient in memory at a time.
        again = replay(start, RULES[rule](), server.policy, workers, accepted(trace, gradients), steps=pushes)
        equal = torch.equal(again.params, server.params)
        if not equal:
            diff = (again.params - server.params).abs()
            errors.append(
                f"replayed parameters differ from the server's at {int((diff > 0).sum())} of {diff.numel()} "
                f"entries (max {float(diff.max()):.3g})"
            )
        if again.applied != server.applied:
            errors.append(f"replay applied {again.applied} gradients, the server {server.applied}")
    except TraceError as e:
        errors.append(f"replay: {e}")
    staleness = [s for e in trace.of("apply") for s in e["staleness"]]
    return {
        "sent": sent,
        "sent_per_worker": sends,
        "pushed": totals["pushed"],
        "applied": totals["applied"],
        "dropped": totals["dropped"],
        "updates": totals["updates"],
        "staleness_mean": sum(staleness) / max(1, len(staleness)),
        "staleness_max": max(staleness, default=0),
        "replay_equal": equal,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=20_000, help="server updates (each one pushed gradient)")
    parser.add_argument("--numel", type=int, default=1_000_000, help="float32 parameters")
    parser.add_argument("--max-delay-us", type=float, default=200.0, help="longest ordinary random pause")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rule", choices=sorted(RULES), default="sgd")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (ranks share the cores)")
    parser.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    result = soak(
        comm, pushes=args.pushes, numel=args.numel, max_delay_us=args.max_delay_us, seed=args.seed, rule=args.rule
    )
    if comm.Get_rank() == 0:
        result["command"] = (
            f"mpiexec -n {comm.Get_size()} python benchmarks/mpi_soak.py --pushes {args.pushes} --numel {args.numel}"
            f" --max-delay-us {args.max_delay_us:g} --seed {args.seed} --rule {args.rule} --threads {args.threads}"
        )
        status = "ok" if not result["errors"] else f"FAILED ({len(result['errors'])} error(s))"
        print(
            f"soak {status}: {result['sent']} pushes ({result['applied']} applied, {result['dropped']} dropped) of "
            f"{args.numel} floats by {result['workers']} workers in {result['seconds']:.1f} s: "
            f"{result['pushes_per_s']:.0f} pushes/s, push {result['push_MBps']:.0f} MB/s, "
            f"pull {result['pull_MBps']:.0f} MB/s; staleness mean {result['staleness_mean']:.2f} max "
            f"{result['staleness_max']}; replay bitwise equal: {result['replay_equal']}",
            flush=True,
        )
        for error in result["errors"]:
            print(f"  {error}", file=sys.stderr, flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
