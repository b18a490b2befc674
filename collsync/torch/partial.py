"""`partial_allreduce(tensor, quorum=k)`: the mean of the first k workers' tensors, and who contributed.

One `collsync.runtime.mpi_partial.PartialAllreduce` per tensor size and dtype, opened collectively on first use
and freed at `shutdown()`; rounds are numbered per size in call order, so every worker must make the same sequence
of calls (as with any collective). A worker whose round is complete already reads the result without
contributing (`contribute=False` is not needed: it happens by itself).
"""

from __future__ import annotations

from typing import Any

import torch

from collsync.runtime.mpi_coll import shutdown
from collsync.runtime.mpi_partial import PartialAllreduce
from collsync.torch._ops_base import _check
from collsync.torch._world import state

_OPEN: dict[tuple[int, torch.dtype], list[Any]] = {}


def partial_allreduce(
    tensor: torch.Tensor,
    quorum: int,
    *,
    timeout: float | None = None,
    depth: int = 8,
    margin: float | str | None = None,
) -> Any:
    """The k-of-n partial allreduce (000_..., Chen et al., backup workers): returns a `PartialResult` with `mean`
    (shaped like `tensor`), `round`, `quorum`, `contributors` and `dropped`, identical on every worker. `margin`:
    None averages exactly the first k; seconds, or "auto" (from the measured arrivals), also every tensor that
    comes within that long after the k-th (`quorum` is then how many were averaged). `timeout`, `depth` and
    `margin` hold from a size's first call.

    Raises:
        ValueError: quorum outside 1..size(), a tensor that is not float32/float64 on the CPU.
        TimeoutError: with `timeout`, a round that did not complete in time (naming what it waited for).
    """
    st = state("partial_allreduce")
    _check(tensor, "partial_allreduce")
    n = st.comm.Get_size()
    if not 1 <= quorum <= n:
        raise ValueError(f"partial_allreduce: quorum={quorum} must be in 1..{n} (the workers)")
    if tensor.dtype not in (torch.float32, torch.float64) or tensor.device.type != "cpu":
        raise ValueError(f"partial_allreduce: a float32 or float64 CPU tensor, got {tensor.dtype} on {tensor.device}")
    key = (tensor.numel(), tensor.dtype)
    if key not in _OPEN:
        pa = PartialAllreduce(st.comm, tensor.numel(), dtype=tensor.dtype, depth=depth, timeout=timeout, margin=margin)
        _OPEN[key] = [pa, 0]

        def close(key: tuple[int, torch.dtype] = key) -> None:
            shutdown(st.comm, st.deadline)  # a lost rank: RankLost naming it, not a hang
            _OPEN.pop(key)[0].free()

        st.cleanups.append(close)
    entry = _OPEN[key]
    pa, round_ = entry
    entry[1] += 1
    result = pa.try_read(quorum, round_)
    if result is None:
        result = pa(tensor.detach().reshape(-1).contiguous(), quorum, round_)
    return result._replace(mean=result.mean.view_as(tensor))
