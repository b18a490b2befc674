"""Horovod's reduction ops as MPI sees them: the op constants, MPI datatypes for torch dtypes, and the user
operations that combine 16-bit floats (moved as 16-bit words, combined in float32, as Horovod does); scaling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5

_MPI_TYPES: dict[torch.dtype, str] = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
    torch.int16: "INT16_T",
    torch.int8: "INT8_T",
    torch.uint8: "UINT8_T",
    torch.float16: "UINT16_T",  # moved as raw 16-bit words, summed by _half_sum
    torch.bfloat16: "UINT16_T",  # likewise, summed by _bfloat16_sum (numpy has no bfloat16)
}

# The 16-bit floating-point types: MPI and numpy see their raw words (`words`), a user operation sums them.
HALVES = (torch.float16, torch.bfloat16)


def words(tensor: torch.Tensor) -> np.ndarray:
    """The numpy view MPI moves: the tensor itself, or a 16-bit float's raw words (no copy either way)."""
    return tensor.view(torch.int16).numpy() if tensor.dtype in HALVES else tensor.numpy()


def _mpi_type(dtype: torch.dtype, what: str) -> Any:
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    name = _MPI_TYPES.get(dtype)
    if name is None:
        raise NotImplementedError(f"{what}: dtype {dtype} is not supported")
    return getattr(MPI, name)


def _half_sum_fn(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    a = np.frombuffer(inbuf, dtype=np.float16)
    b = np.frombuffer(inoutbuf, dtype=np.float16)
    b[:] = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)


def _bfloat16_sum_fn(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    # torch reads the words as bfloat16 and rounds float32 back to nearest-even, as its own .to(bfloat16) does.
    a = torch.frombuffer(inbuf, dtype=torch.bfloat16)
    b = torch.frombuffer(inoutbuf, dtype=torch.bfloat16)
    b.copy_(a.to(torch.float32) + b.to(torch.float32))


_COMBINE: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    Min: torch.minimum,
    Max: torch.maximum,
    Product: torch.mul,
}


def _half_fn(dtype: torch.dtype, op: int) -> Callable[[Any, Any, Any], None]:
    """A user operation for a 16-bit float type: each combination in float32, rounded back (nearest-even)."""
    combine = _COMBINE[op]

    def fn(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = torch.frombuffer(inbuf, dtype=dtype)
        b = torch.frombuffer(inoutbuf, dtype=dtype)
        b.copy_(combine(a.to(torch.float32), b.to(torch.float32)))

    return fn


_USER_OPS: dict[tuple[torch.dtype, int], Any] = {}


def _reduce_op(dtype: torch.dtype, op: int) -> Any:
    """The MPI operation for Horovod's `op` (Average and Sum both sum; Min, Max, Product), or for float16 and
    bfloat16 a user operation: each combination in float32, rounded back to the 16-bit type (Horovod's float16
    operations; bfloat16 the same way, to nearest-even)."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    if op in (Average, Sum):
        return _sum_op(dtype)
    if dtype not in HALVES:
        return {Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}[op]
    if (dtype, op) not in _USER_OPS:
        _USER_OPS[(dtype, op)] = MPI.Op.Create(_half_fn(dtype, op), commute=True)
    return _USER_OPS[(dtype, op)]


_SUMS: dict[torch.dtype, Any] = {}


def _sum_op(dtype: torch.dtype) -> Any:
    """MPI.SUM, or for float16 and bfloat16 a user operation: each addition in float32, rounded back to the 16-bit
    type (Horovod's float16 operation; bfloat16 the same way, to nearest-even)."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    if dtype not in HALVES:
        return MPI.SUM
    if dtype not in _SUMS:
        _SUMS[dtype] = MPI.Op.Create(_half_sum_fn if dtype == torch.float16 else _bfloat16_sum_fn, commute=True)
    return _SUMS[dtype]


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """tensor *= factor, for float16 and bfloat16 computed in float32 and rounded once (Horovod's ScaleBuffer on
    the CPU)."""
    if factor == 1.0:
        return tensor
    if tensor.dtype in HALVES:
        return tensor.copy_((tensor.to(torch.float32) * float(np.float32(factor))).to(tensor.dtype))
    if not tensor.dtype.is_floating_point:
        return tensor.copy_((tensor.to(torch.float64) * factor).to(tensor.dtype))
    return tensor.mul_(factor)
