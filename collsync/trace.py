"""The event trace every runtime writes in one format (JSONL), read by `metrics` and checked by `checks`.

Events (all carry `t`, seconds of simulated or wall time, and `ev`):

* `start`  worker began a gradient: worker, clock, version (the parameters it read)
* `push`   the server received a gradient: worker, clock, version
* `drop`   the server discarded a gradient: worker, clock, version, server (its version then), reason
* `apply`  the server changed the parameters: version (after), workers, clocks, staleness (one per gradient)
* `lost`   the server stopped waiting for a worker silent for the deadline: worker, rank, host, last_update (the
           last update its gradient was part of; 0: none); its later gradients are dropped (reason "lost")
* `away`   PSP: the workers now in another collective of their script (`Server.pushing`): workers (all of them)
* `eval`   test accuracy of theta (`acc`) and of its EMA (`ema_acc`), `loss`, at server `version`
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

Event = dict[str, Any]


class Trace:
    """An append-only list of events stamped by a clock (simulated time in the simulator, wall time for real).

    `clock_kind` says which, so reports never put the two on one axis: "wall" for the default clock (seconds since
    the trace was made), "simulated" when a clock is given (the simulator's virtual clock), None for a trace read
    back from a file (the file does not say; the run folder's summary.json does).
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        start = time.perf_counter()
        self.clock: Callable[[], float] = clock or (lambda: time.perf_counter() - start)
        self.clock_kind: str | None = "wall" if clock is None else "simulated"
        self.events: list[Event] = []

    def record(self, ev: str, **fields: Any) -> Event:
        event = {"t": self.clock(), "ev": ev, **fields}
        self.events.append(event)
        return event

    def resume(self, events: Iterable[Event], *, shift_clock: bool) -> None:
        """Go on from a checkpoint's events: they come first, and with `shift_clock` (a wall clock that restarted
        at zero) the clock continues from the last of them, so time never goes backwards in the trace."""
        self.events = list(events)
        if shift_clock and self.events:
            offset, clock = float(self.events[-1]["t"]), self.clock
            self.clock = lambda: offset + clock()

    def extend(self, events: Iterable[Event]) -> None:
        self.events.extend(events)

    def of(self, ev: str) -> list[Event]:
        return [e for e in self.events if e["ev"] == ev]

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for e in self.events:
                f.write(json.dumps(e) + "\n")

    @classmethod
    def read_jsonl(cls, path: str | Path) -> Trace:
        trace = cls()
        trace.clock_kind = None
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    trace.events.append(json.loads(line))
                except ValueError as exc:  # a line cut off where a killed run stopped writing, or not JSON at all
                    cut = "" if line.endswith("\n") else " (cut off: the run was killed while writing it?)"
                    raise ValueError(f"line {number} is not a JSON event{cut}: {exc}") from None
        return trace


def recorded(stats: dict[str, list[float]], opt: dict[str, float], gradients: int) -> dict[str, list[float]]:
    """The statistics an `apply` event records, each a list of one value per gradient: the penalty's `stats`, and
    the optimizer's `opt` where the update holds one gradient (its statistic is then that gradient's: Adam-GA's
    Gap). A key both report keeps the penalty's."""
    if gradients == 1:
        for key, value in opt.items():
            stats.setdefault(key, [value])
    return stats
