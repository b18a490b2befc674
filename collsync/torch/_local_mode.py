"""The sync mode of a worker outside the process set its `DistributedOptimizer` reduces over: Horovod skips the
gradient reduction there (no hooks, `synchronize()` does nothing) and the user's optimizer steps on the worker's own
gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collsync.torch.speculative import Speculating


class LocalMode:
    """No synchronisation: `step()` is the user's optimizer's step (Horovod's optimizer off its process set)."""

    name = "bsp"
    spec: Speculating | None = None
    dropped = 0
    caught_up = 0
    finished = False

    def __init__(self, rank: int) -> None:
        self.rank = rank

    @property
    def version(self) -> int | None:
        return None

    @property
    def lost(self) -> list[dict[str, Any]]:
        return []

    def step(self, base: Callable[[Any], Any], closure: Any, sync: bool) -> Any:
        return base(closure)

    def synchronize(self) -> None:
        pass

    def join(self) -> int:
        """Nothing to take part in: this worker reduces with nobody. Returns its own rank."""
        return self.rank

    def close(self) -> None:
        pass
