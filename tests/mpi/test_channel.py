"""`mpi_channel.Channel`: a message an earlier channel left unreceived never matches a later channel's receives."""

from __future__ import annotations

import numpy as np
import pytest

from collsync.runtime.mpi_channel import GENERATIONS, Channel


def test_a_message_left_unreceived_is_not_taken_by_the_next_channel(comm):
    """Rank 0 sends every other rank a message that is never received, and the channel is freed: the MPI library
    may give its context id to the next `Dup` (MPICH and Open MPI do), but the free took what had come and the next
    channel's tags are not the old one's (for what is still in flight), so a probe from any source there finds
    nothing, while that channel's own message is found."""
    from mpi4py import MPI

    rank, n = comm.Get_rank(), comm.Get_size()
    if n < 2:
        pytest.skip("needs a rank to leave a message with")
    old = Channel(comm, tags=1)
    stale = np.full(4, 7, dtype=np.int64)
    if rank == 0:
        MPI.Request.Waitall([old.comm.Isend([stale, MPI.INT64_T], r, old.tag(0)) for r in range(1, n)])
    old.comm.Barrier()  # sent (eagerly: 32 bytes) before the free
    old.free()
    new = Channel(comm, tags=1)
    assert new.tag(0) != old.tag(0)
    found = new.comm.Iprobe(MPI.ANY_SOURCE, new.tag(0))
    new.comm.Barrier()  # every rank probed before any message of the new channel is sent
    assert not found, f"rank {rank}: the freed channel's message matched the new channel's tag"
    if rank == 0:
        MPI.Request.Waitall([new.comm.Isend([stale, MPI.INT64_T], r, new.tag(0)) for r in range(1, n)])
    else:
        got = np.zeros(4, dtype=np.int64)
        new.comm.Recv([got, MPI.INT64_T], 0, new.tag(0))
        assert got.tolist() == [7] * 4
    new.free()


def test_channels_agree_on_their_tags_and_bound_them(comm):
    """Every rank gets the same tags (the generation is agreed, whatever each process made before), a tag outside
    the channel's range is refused, and the tags of `GENERATIONS` channels in a row never overlap."""
    from mpi4py import MPI

    if comm.Get_rank() == 0:  # a channel on this rank alone: the ranks' counts of channels made now differ
        Channel(MPI.COMM_SELF).free()
    channels = [Channel(comm, tags=3) for _ in range(GENERATIONS)]
    try:
        bases = [c.base for c in channels]
        assert len(set(comm.allgather(tuple(bases)))) == 1
        assert len({b + i for b in bases for i in range(3)}) == 3 * GENERATIONS
        with pytest.raises(ValueError, match="outside this channel's 3 tags"):
            channels[0].tag(3)
        with pytest.raises(ValueError, match="1 to "):
            Channel(comm, tags=1 << 40)
    finally:
        for c in channels:
            c.free()
