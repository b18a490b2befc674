"""The simulated run (`runtime=sim`): every worker and the server in this process, on the simulator's seeded
virtual clock (`collsync.sim.Simulator`), with checkpoints that hold the simulator's own state.

The summary's `sim_cost` is what the simulation itself cost in wall time (event loop, gradients, server updates),
evaluation and checkpoints left out: the figure that says how a study's runs grow with the number of workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from collsync.data import Batches
from collsync.evaluate import Evaluator
from collsync.flat import FlatModel
from collsync.loops import Gradients
from collsync.rundir import write_run
from collsync.runs.parts import Parts, check_fit, keep_on_failure, make_server, progress
from collsync.runs.resume import keeper, restore, resumed, state
from collsync.sim import Simulator, backup_rounds
from collsync.sim_specsync import specsync_summary


def run_simulated(parts: Parts, flat: FlatModel, out_dir: Path) -> dict[str, Any]:
    """Train in the simulator; write the run folder and return the summary."""
    run, workers = parts.run, parts.runtime.workers
    check_fit(parts, workers)
    kept = keeper(parts, out_dir)
    saved = resumed(kept, parts)
    runtime = parts.runtime
    sim = Simulator(workers, parts.stragglers, run.seed, runtime.margin, runtime.catch_up is not False)
    server = make_server(parts, flat, workers, sim.trace)
    grads = Gradients(flat, Batches(parts.data, workers, run.batch_size, run.seed))
    bar = progress(run.steps, run.progress)
    evaluate = Evaluator(flat, parts.data, sim.trace, run.eval_every, bar, guard_loss=run.guard_limit)
    if saved is not None:
        sim.load_state_dict(saved["driver"], parts.policy)
        restore(saved, kept, server, sim.trace, evaluate, shift_clock=False)

    wide = runtime.margin is not None and backup_rounds(parts.policy)  # a round may take every worker's gradient

    def between() -> None:
        kept.step(server.version, lambda: state(server, sim.trace, evaluate, driver=sim.state_dict()))

    def save(why: str) -> None:
        write_run(out_dir, sim.trace, parts.policy, server, parts.config, extra={"incomplete": why}, up_to_all=wide)

    aside = _Aside()
    first, computed = server.version, len(sim.trace.of("start"))  # a resumed run counts this process's part only
    with keep_on_failure(save):
        if saved is None:
            evaluate(server)
        start = time.perf_counter()
        sim.run(server, grads, on_update=aside.timed(evaluate), between=aside.timed(between))
        spent = time.perf_counter() - start
    if bar is not None:
        bar.close()
    extra = specsync_summary(sim, flat.numel, flat.params.element_size())  # SpecSync's counts and bytes, if any
    gradients = len(sim.trace.of("start")) - computed
    extra["sim_cost"] = sim_cost(spent - aside.seconds, aside.seconds, server.version - first, gradients)
    return write_run(out_dir, sim.trace, parts.policy, server, parts.config, extra=extra, up_to_all=wide)


def sim_cost(wall_s: float, aside_s: float, updates: int, gradients: int) -> dict[str, float | None]:
    """The simulator's own wall time (`wall_s`), in all and per update and per gradient computed, beside the time
    spent evaluating and checkpointing (`aside_s`). A round policy computes about n gradients per update, a stream
    policy one: per gradient is the figure that should stay flat as n grows."""
    return {
        "wall_s": wall_s,
        "aside_wall_s": aside_s,
        "per_update_ms": 1e3 * wall_s / updates if updates else None,
        "per_gradient_ms": 1e3 * wall_s / gradients if gradients else None,
    }


class _Aside:
    """Wall seconds spent in the callbacks a simulation calls (evaluation, checkpoints), to leave them out of the
    simulator's own cost."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, call: Callable[..., None]) -> Callable[..., None]:
        def timed_call(*args: Any) -> None:
            start = time.perf_counter()
            try:
                call(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed_call
