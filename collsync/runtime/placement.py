"""Where the parameter-server ranks run: spread over the hosts ("spread"), or the world's first ranks ("first").

Why: shard j is served by rank j of the world the shards open over, and worker w is rank `servers + w` (both fronts
count so: `collsync.torch`'s `init(servers=...)` and `collsync-train runtime=mpi runtime.servers=...`). Under a
launcher's block placement (MPICH's mpiexec and srun deal consecutive ranks to one host until it is full) ranks
0..S-1 all run on the first host, so every shard's traffic goes through that one host's network link and cores.

"spread" picks the server ranks round-robin over the hosts (each host's first rank, then each host's second, ...;
hosts in the order of their first rank) and builds a communicator whose rank order puts them first
(`comm.Split(0, key)`), the workers after them in the launcher's order: everything that counts ranks from that
communicator (`servers + w`, shard j on rank j) stays valid unchanged. Where that order is the launcher's already
(one host, a single server, or ranks dealt round-robin over the hosts) no communicator is made: the same ranks and
a bit-identical run. Rank 0 never moves (it is the first rank of the first host, so the first server), so the rank
that evaluates, writes the run folder and prints is the launcher's rank 0 either way.

What names a rank to the user (errors, logs, lost-rank records, summary.json) names the launcher's rank, the rank
of the communicator the placement was made from (MPI_COMM_WORLD, or the one passed to `init(comm=...)`):
`named_rank` maps a rank of the placed communicator (or a duplicate of it) back to that one.

Hosts are told apart by name (`socket.gethostname()`, as `mpi_world.hello` gathers them): ranks on one host share
its link. For tests only, COLLSYNC_FAKE_HOSTS (a comma-separated host name per rank) replaces the gathered names
here and nowhere else, so that a test on one machine can check the placement over several "hosts".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = ["PLACEMENTS", "FAKE_HOSTS_ENV", "check_placement", "server_order", "place", "named_rank", "launch_order"]

PLACEMENTS = ("spread", "first")
DEFAULT = "spread"
FAKE_HOSTS_ENV = "COLLSYNC_FAKE_HOSTS"  # tests only: see the module's docstring

T = TypeVar("T")

# Each communicator `place` made, with its order (order[i]: the rank of the original communicator now at rank i).
# Never freed: the world of a `collsync.torch.init` lives to the process's end.
_PLACED: list[tuple[Any, tuple[int, ...]]] = []


def check_placement(placement: object, what: str) -> str:
    """`placement` if it is one of PLACEMENTS, else a ValueError naming `what` (the option as the front spells it)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"{what}={placement!r} must be 'spread' (servers round-robin over the hosts) or 'first'")
    return str(placement)


def server_order(hosts: Sequence[str], servers: int, placement: str = DEFAULT) -> list[int]:
    """The ranks' new order: element i is the rank (an index into `hosts`, each rank's host) that becomes rank i.

    "spread": the first `servers` are picked round-robin over the hosts (each host's lowest unpicked rank in turn,
    hosts in the order of their first rank; a host out of ranks is passed over), then every other rank in its own
    order. More servers than hosts puts a second server on a host only once every host has one. "first" (or no
    servers): the identity. Pure, so that every rank computes the same order from the same gathered names."""
    check_placement(placement, "placement")
    size = len(hosts)
    if placement == "first" or servers <= 0:
        return list(range(size))
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    chosen: list[int] = []
    want = min(servers, size)
    depth = 0
    while len(chosen) < want:
        for ranks in by_host.values():
            if depth < len(ranks) and len(chosen) < want:
                chosen.append(ranks[depth])
        depth += 1
    taken = set(chosen)
    return chosen + [rank for rank in range(size) if rank not in taken]


def _hosts(gathered: Sequence[str]) -> list[str]:
    """The gathered host names, or COLLSYNC_FAKE_HOSTS's where set (tests only), checked against the world."""
    fake = os.environ.get(FAKE_HOSTS_ENV)
    if not fake:
        return list(gathered)
    hosts = fake.split(",")
    if len(hosts) != len(gathered):
        raise ValueError(
            f"{FAKE_HOSTS_ENV}={fake!r} names {len(hosts)} host(s) for a world of {len(gathered)} ranks (tests only: "
            "one comma-separated host name per rank)"
        )
    return hosts


def place(comm: Any, hosts: Sequence[str], servers: int, placement: str = DEFAULT) -> Any:
    """`comm` with its ranks reordered so that the `servers` chosen by `server_order` come first (collective; every
    rank must pass the same `hosts`, each rank's host name by rank of `comm`). `comm` itself where the order is
    unchanged: one host, or placement "first", costs nothing and changes nothing."""
    order = server_order(_hosts(hosts), servers, placement)
    if order == list(range(len(order))):
        return comm
    placed = comm.Split(0, order.index(comm.Get_rank()))
    _PLACED.append((placed, tuple(order)))
    return placed


def named_rank(comm: Any, rank: int) -> int:
    """`rank` of `comm` as the user knows it: its rank in the communicator the placement was made from, where `comm`
    is a placed communicator or a duplicate of it; any other communicator's ranks are its own (unchanged)."""
    if not _PLACED or comm is None:
        return rank
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    for placed, order in _PLACED:
        if comm is placed or comm.Compare(placed) in (MPI.IDENT, MPI.CONGRUENT):
            return order[rank] if 0 <= rank < len(order) else rank
    return rank


def launch_order(comm: Any, values: Sequence[T]) -> list[T]:
    """`values` by rank of `comm` (e.g. each rank's host) rearranged by the launcher's rank (`named_rank`)."""
    out = list(values)
    for rank, value in enumerate(values):
        out[named_rank(comm, rank)] = value
    return out
