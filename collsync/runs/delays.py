"""Real runs with the simulator's stragglers (`runtime.inject_stragglers`): each gradient is held back by the
compute time and message delay the straggler model draws for it, scaled by `runtime.time_scale`."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from collsync.loops import GradFn
from collsync.runtime.mpi_specsync import SLICE_S
from collsync.stragglers import StragglerSampler


def injected(
    grads: GradFn,
    sampler: StragglerSampler,
    scale: float,
    finished: Callable[[], bool],
    check: Callable[[], None] | None = None,
    rank: int | None = None,
) -> GradFn:
    """`grads`, then a sleep of the drawn compute time and message delay (x `scale`).

    A frozen worker computes nothing more until `finished()` (training is over): the rest of the world trains on
    (backup, async) or the server's deadline names it. It still leaves cleanly, so the run folder is written.
    `check()`: SpecSync's safe point, called between slices of the sleep (it raises to abort the gradient).
    `rank`: whose draw it is, where it is not the batch's shard (serverless backup hands a late rank's batches to
    others, `rounds.Ledger`: the delay is the computing rank's, as the simulator draws it).
    """
    start = time.monotonic()

    def slow(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
        g = grads(params, worker, index)
        worker = worker if rank is None else rank
        if sampler.is_frozen(worker, (time.monotonic() - start) / scale):
            while not finished():
                time.sleep(0.05)
        delay = (sampler.compute_time(worker, index) + sampler.message_delay(worker, index)) * scale
        if check is None:
            time.sleep(delay)
            return g
        # SpecSync: the delay stands for computation, so a re-sync may abort it (`check` raises) at any slice.
        end = time.monotonic() + delay
        while (left := end - time.monotonic()) > 0:
            check()
            time.sleep(min(left, SLICE_S))
        return g

    return slow
