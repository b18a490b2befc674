"""Horovod's build queries, whose answers are fixed for collsync (MPI on the CPU, nothing else): kept apart from
`_world` so that the world's module holds what `init()` sets up."""

from __future__ import annotations

from typing import Any


def mpi_threads_supported() -> bool:
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def _fixed(name: str, value: Any) -> Any:
    """One of Horovod's build queries, whose answer is fixed for collsync (MPI on the CPU, nothing else)."""

    def query() -> Any:
        return value

    query.__name__ = query.__qualname__ = name
    return query


mpi_enabled = _fixed("mpi_enabled", True)
mpi_built = _fixed("mpi_built", True)
gloo_enabled = _fixed("gloo_enabled", False)
gloo_built = _fixed("gloo_built", False)
nccl_built = _fixed("nccl_built", 0)
ddl_built = _fixed("ddl_built", False)
ccl_built = _fixed("ccl_built", False)
cuda_built = _fixed("cuda_built", False)
rocm_built = _fixed("rocm_built", False)
