"""What `DistributedOptimizer` asks of a sync mode (`Mode`), and what the modes share.

One module per mode family implements it: `_allreduce.AllreduceMode` (bsp without servers),
`_partial_mode.PartialMode` (backup workers without servers), `_server_mode.ServerMode` (the parameter-server
shards: async, ssp, psp, bfasgd, specsync, and every mode once `init` reserved servers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from collsync.flat import ParamBuffer
from collsync.runtime.mpi_buckets import DEFAULT_BUCKET_BYTES
from collsync.torch.speculative import Speculating

# Bucket size of the reductions overlapped with backward (Horovod's fusion threshold is 64 MiB; DDP's 25 MiB: on
# CPUs a smaller bucket starts the first sum earlier). A module attribute so tests can cut one bucket per parameter.
BUCKET_BYTES = DEFAULT_BUCKET_BYTES


class Mode(Protocol):
    """A sync mode behind `DistributedOptimizer`. The attributes with values are defaults a mode may override:
    `spec` (SpecSync's worker side), `version` (the server version the model holds), `dropped` (gradients a round
    came too late for), `caught_up` (rounds applied without computing for them, having come late), `lost` (the
    workers the servers went on without) and `finished` (training ended; `step()` no longer changes the model)."""

    name: str
    spec: Speculating | None = None
    dropped: int = 0
    caught_up: int = 0
    finished: bool = False

    @property
    def version(self) -> int | None:
        return None

    @property
    def lost(self) -> list[dict[str, Any]]:
        """The workers lost (server modes, once closed: `rank`, `world_rank`, `host`, `last_update`); [] else."""
        return []

    def step(self, base: Callable[[Any], Any], closure: Any, sync: bool) -> Any:
        """One optimizer step: synchronise (when `sync`), then `base(closure)` (the user's optimizer) or the
        mode's own update; returns the closure's loss."""
        ...

    def synchronize(self) -> None:
        """Make the gradients the ones `step()` applies (Horovod's `synchronize`), where the mode has such a point."""
        ...

    def join(self) -> int:
        """Horovod's join: take part in the others' remaining reductions; the rank that joined last."""
        ...

    def close(self) -> None:
        """Release what the mode holds (hooks, threads, windows; collective)."""
        ...


def one_dtype(params: list[torch.Tensor], mode: str) -> ParamBuffer:
    """The parameters in one buffer; they must all be float32 or all float64."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point or torch.float16 in dtypes:
        raise ValueError(
            f"DistributedOptimizer(sync={mode!r}): parameters must all be float32 or all float64, got "
            f"{sorted(map(str, dtypes))}"
        )
    return ParamBuffer(params)
