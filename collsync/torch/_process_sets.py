"""Horovod's process sets on MPI communicators: `ProcessSet`, `add_process_set`, `remove_process_set` and
`global_process_set`.

A process set is a subset of the workers that runs collectives on its own (`hvd.allreduce(t, process_set=ps)`).
Horovod builds one from a list of worker ranks (`hvd.rank()` numbering) or from an mpi4py communicator, registers
it with `add_process_set` (which every worker calls, in the same order, members or not, as Horovod requires) and
gives it an id (0 is the global set, of every worker). Here a registered set is an MPI communicator made with
`MPI_Comm_create_group` over the workers' communicator (collective over the members only, so the workers outside
a set wait for nobody); the workers outside keep its ranks and id, and an operation they call on it is refused, as
Horovod refuses it. Ranks given to collectives (a broadcast's `root_rank`) stay worker ranks, as in Horovod.

Sets belong to one `init()`: after `shutdown()` and a new `init()` the registry starts over and old sets are
invalid (Horovod re-creates them from `init(process_sets=...)`; sets built from communicators are not supported by
`add_process_set`, as in Horovod).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from collsync.torch._world import World, state


class ProcessSet:
    """A set of workers that runs collectives together (Horovod's `ProcessSet`): built from a list of worker ranks
    (kept sorted) or an mpi4py communicator, usable once `add_process_set` registered it (`process_set_id` is then
    set; `size()` and `rank()` answer None before)."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        if _is_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object"
            ) from None
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def _entry(self) -> _Entry | None:
        if self.process_set_id is None:
            return None
        return _registry(state("ProcessSet")).get(self.process_set_id)

    def size(self) -> int | None:
        """How many workers the set holds, or None if it is not registered."""
        entry = self._entry()
        return None if entry is None else len(entry.ranks)

    def rank(self) -> int | None:
        """This worker's rank within the set (its position in `ranks`), -1 on a worker outside it, None if the set
        is not registered."""
        entry = self._entry()
        if entry is None:
            return None
        me = state("ProcessSet").comm.Get_rank()
        return entry.ranks.index(me) if me in entry.ranks else -1

    def included(self) -> bool | None:
        """Whether this worker is in the set, or None if the set has no ranks yet."""
        if self.ranks is None:
            return None
        return state("ProcessSet").comm.Get_rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Horovod's `global_process_set`: every worker, id 0, whatever `init()` made the world."""

    process_set_id = 0

    def __init__(self) -> None:
        pass

    @property
    def ranks(self) -> list[int] | None:  # type: ignore[override]
        from collsync.torch import _world  # read the live state: None before init

        st = _world._STATE
        return None if st is None else list(range(st.comm.Get_size()))

    def _invalidate(self) -> None:
        pass  # the global set stays valid

    def _entry(self) -> _Entry | None:
        st = state("global_process_set")
        return _Entry(list(range(st.comm.Get_size())), st.comm)


global_process_set: ProcessSet = _GlobalProcessSet()


class _Entry:
    """A registered set: its worker ranks and, on its members, its communicator (None elsewhere)."""

    def __init__(self, ranks: list[int], comm: Any) -> None:
        self.ranks, self.comm = ranks, comm


_REGISTRY: dict[int, _Entry] = {}  # process_set_id -> entry, for the World in _WORLD
_WORLD: list[World] = []  # the World the registry belongs to (a new init() starts a new registry)
_NEXT = [1]  # the next id: every worker registers sets in the same order, so ids agree


def _registry(st: World) -> dict[int, _Entry]:
    if not _WORLD or _WORLD[0] is not st:
        _WORLD[:] = [st]
        _REGISTRY.clear()
        _NEXT[0] = 1
    return _REGISTRY


def _is_comm(obj: Any) -> bool:
    try:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library
    except ImportError:
        return False
    return isinstance(obj, MPI.Comm)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set and return it with its id (Horovod's `hvd.add_process_set`): every worker calls it,
    in the same order. A set of the same ranks as one registered already is refused with ValueError, and one built
    from a communicator with NotImplementedError, as Horovod does."""
    st = state("add_process_set")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError(
            "Dynamically adding process sets defined by an MPI communicator is not implemented. "
            "Please build the process set via a list of ranks."
        )
    ranks = list(process_set.ranks)
    size = st.comm.Get_size()
    if not ranks or ranks[0] < 0 or ranks[-1] >= size or len(set(ranks)) != len(ranks):
        raise ValueError(f"add_process_set: ranks {ranks} must be distinct worker ranks in 0..{size - 1}")
    registry = _registry(st)
    if ranks == list(range(size)) or any(e.ranks == ranks for e in registry.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    key = _NEXT[0]
    _NEXT[0] = key + 1
    comm = None
    if st.comm.Get_rank() in ranks:
        group = st.comm.Get_group()
        sub = group.Incl(ranks)
        comm = st.comm.Create_group(sub, tag=key)
        sub.Free()
        group.Free()
    registry[key] = _Entry(ranks, comm)
    process_set.process_set_id = key
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every worker calls it); False for the global set or one not registered. The set
    object is invalidated (its id becomes None), as in Horovod."""
    st = state("remove_process_set")
    key = process_set.process_set_id
    if key is None or key == 0:
        return False
    process_set._invalidate()
    entry = _registry(st).pop(key, None)
    if entry is None:
        return False
    if entry.comm is not None:
        entry.comm.Free()
    return True


def set_comm(process_set: Any, what: str) -> tuple[Any, list[int] | None]:
    """The communicator an operation on `process_set` runs on, and the set's worker ranks (None for the global
    set, whose ranks are the communicator's). Refused: a set not registered, a worker outside the set."""
    st = state(what)
    if process_set is None or process_set is global_process_set:
        return st.comm, None
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{what}: process_set={process_set!r} is not a collsync.torch.ProcessSet")
    key = process_set.process_set_id
    entry = None if key is None else _registry(st).get(key)
    if entry is None:
        raise ValueError(f"{what}: process set {process_set} does not exist, or has not been registered")
    if entry.comm is None:
        raise ValueError(f"{what}: rank {st.comm.Get_rank()} is not a member of the provided process set")
    return entry.comm, entry.ranks


def set_root(root_rank: int, ranks: list[int] | None, size: int, what: str) -> int:
    """A worker rank (Horovod numbers broadcast roots by `hvd.rank()`, in process sets too) as a rank of the set's
    communicator."""
    if ranks is None:
        if not 0 <= root_rank < size:
            raise ValueError(f"{what}: root_rank={root_rank} must be in 0..{size - 1}")
        return root_rank
    if root_rank not in ranks:
        raise ValueError(f"{what}: root_rank={root_rank} is not in the process set (ranks {ranks})")
    return ranks.index(root_rank)


def set_world(st: World, process_set: Any, what: str) -> World | None:
    """The world a `DistributedOptimizer` on `process_set` reduces over: `st` itself for the global set, a copy
    whose `comm` is the set's communicator on its members, None on a worker outside the set (Horovod's optimizer
    does not reduce there)."""
    if process_set is None or process_set is global_process_set:
        return st
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id is None:
        raise ValueError(f"{what}: process set {process_set} does not exist, or has not been registered")
    entry = _registry(st).get(process_set.process_set_id)
    if entry is None:
        raise ValueError(f"{what}: process set {process_set} does not exist, or has not been registered")
    return None if entry.comm is None else dataclasses.replace(st, comm=entry.comm)
