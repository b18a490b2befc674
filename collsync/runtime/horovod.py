"""Horovod as the full-sync transport (`backend="horovod"`): its allreduce moves the fused gradient buffer.

Optional: Horovod 0.28.1 built by `scripts/setup_horovod.sh`. Imported only when asked for; a missing Horovod is
one clear line, not an ImportError deep in a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

from typing import Any

import torch


def _hvd() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ValueError(
            f"backend='horovod' needs Horovod built for torch (bash scripts/setup_horovod.sh): {exc}"
        ) from None
    return hvd


def init(comm: MPI.Comm) -> None:
    """Start Horovod on the workers' communicator (the same ranks, in the same order, as collsync's)."""
    _hvd().init(comm=comm)


def allreduce_(tensor: torch.Tensor, op: int, prescale: float, postscale: float) -> torch.Tensor:
    """In place: Horovod's Average (0) or Sum (1) of `tensor`, with its pre/post scale factors."""
    hvd = _hvd()
    hvd.allreduce_(tensor, op=hvd.Average if op == 0 else hvd.Sum, prescale_factor=prescale, postscale_factor=postscale)
    return tensor  # Horovod's in-place op returns this same tensor
