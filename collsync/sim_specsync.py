"""SpecSync's counts and bytes moved in a simulated run (004_... Fig. 13), read from the simulator's scheduler, its
workers' speculation counts and its trace: a report on a run, beside the simulator rather than inside it."""

from __future__ import annotations

from typing import Any

from collsync.sim import Simulator
from collsync.specsync import NOTIFY_BYTES, RESYNC_BYTES


def specsync_summary(sim: Simulator, numel: int, itemsize: int = 4) -> dict[str, Any]:
    """SpecSync's counts and the paper's Fig. 13 breakdown of bytes moved: pushes and pulls (as without
    SpecSync), the re-sync pulls, and the notify / re-sync messages. Empty when the policy does not speculate."""
    if sim.scheduler is None:
        return {}
    starts = sim.trace.of("start")
    pushes = sum(1 for e in sim.trace.events if e["ev"] == "push")
    restarts = sum(1 for e in starts if e.get("restart"))
    sched = sim.scheduler
    return {
        "specsync": {
            **sim.spec_stats,
            "notifies": sched.notifies,
            "resyncs": sched.resyncs,
            "abort_time": sched.abort_time,
            "abort_rate": sched.abort_rate,
            "tunings": len(sched.tunings),
            "bytes": {
                "push": pushes * numel * itemsize,
                "pull": (len(starts) - restarts) * numel * itemsize,
                "resync_pull": restarts * numel * itemsize,
                "notify": sched.notifies * NOTIFY_BYTES + sched.resyncs * RESYNC_BYTES,
            },
        }
    }
