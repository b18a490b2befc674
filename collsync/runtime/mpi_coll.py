"""Collectives over mpi4py for the serverless full-sync path (`runtime=allreduce`)."""

from __future__ import annotations

from typing import Any

import torch

from collsync.types import Flat


class MpiCollective:
    """`Collective` over an MPI communicator.

    Allreduce runs in place on the tensor's numpy view: `Tensor.numpy()` shares memory with a CPU tensor, so MPI
    reads and writes torch's buffer directly and no copy is made.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()

    def allreduce_mean(self, flat: Flat) -> Flat:
        from mpi4py import MPI

        buf = flat.detach().contiguous()
        self.comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
        return buf.div_(self.size)

    def broadcast(self, flat: Flat, root: int = 0) -> Flat:
        buf = flat.detach().contiguous()
        self.comm.Bcast(buf.numpy(), root=root)
        return buf

    def iallreduce_mean(self, flat: Flat) -> tuple[Any, Flat]:
        """Start a nonblocking sum; `finish(request, flat)` waits and divides. Lets work overlap communication."""
        from mpi4py import MPI

        buf = flat.detach().contiguous()
        return self.comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM), buf

    def finish(self, request: Any, buf: Flat) -> Flat:
        request.Wait()
        return buf.div_(self.size)

    def barrier(self) -> None:
        self.comm.Barrier()


def as_float(tensor: torch.Tensor) -> torch.Tensor:
    """MPI moves float32 and float64 tensors; anything else is rejected loudly."""
    if tensor.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"mpi: tensors must be float32 or float64, got {tensor.dtype}")
    return tensor
