"""torch threads per rank: an equal share of the node, never more than the cores the rank may run on."""

from __future__ import annotations

import pytest

from collsync.runtime.mpi_world import threads_per_rank


@pytest.mark.parametrize(
    ("own", "total", "node", "threads"),
    [
        (64, 64, 4, 16),  # unbound ranks: an equal share
        (1, 64, 4, 1),  # `--cpu-bind=cores`, one core each: one thread, not 16 on one core
        (4, 64, 4, 4),  # `--cpus-per-task=4`
        (2, 2, 4, 1),  # ranks outnumber cores: still one thread
        (8, 8, 1, 8),
    ],
)
def test_threads_per_rank(own: int, total: int, node: int, threads: int) -> None:
    assert threads_per_rank(own, total, node) == threads
