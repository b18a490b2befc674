"""The simulated run (`runtime=sim`): every worker and the server in this process, on the simulator's seeded
virtual clock (`collsync.sim.Simulator`), with checkpoints that hold the simulator's own state."""

from __future__ import annotations

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

    with keep_on_failure(save):
        if saved is None:
            evaluate(server)
        sim.run(server, grads, on_update=evaluate, between=between)
    if bar is not None:
        bar.close()
    spec = sim.specsync_summary(flat.numel, flat.params.element_size())  # SpecSync's counts and bytes, if any
    return write_run(out_dir, sim.trace, parts.policy, server, parts.config, extra=spec or None, up_to_all=wide)
