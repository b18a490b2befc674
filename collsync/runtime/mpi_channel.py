"""A communicator for one protocol instance's messages, out of reach of the messages an earlier instance left behind.

A protocol's point-to-point messages go on a `Dup` of the ranks' communicator, freed with the instance. A message
sent to a rank that never received it (a delivery to a rank that was lost, or that stopped reading) stays in that
rank's MPI queues after the free, and MPICH and Open MPI both give a freed communicator's context id to a later
`Dup`: the later instance's receive with the same tag then takes the stale message. Seen: a partial allreduce's
delivery of round 6 to the rank a test had just lost was taken, a test later, as round 6 of a new allreduce on the
same two ranks, with the old allreduce's bytes (`MPIR_CVAR_NOLOCAL=1`, 1 run in 8). No drain at `free` can see a
message still in flight, and MPI cannot cancel a send reliably, so every instance's tags are its own instead: the
ranks agree on a generation when the channel is made (one `allreduce`, beside the `Dup` that already waits for
every rank) and each tag lies in that generation's range. A stale message then matches no receive again until
`GENERATIONS` more channels have been made on this process and its context id has come back too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpi4py import MPI

GENERATIONS = 256  # tag ranges taken in turn; MPI's smallest allowed tag bound (32767) still leaves 127 tags each
_made = 0  # channels made on this process: the next generation is at least this
# Receives of the messages a freed channel had left unreceived, with their buffers (MPI writes them as they come).
_DRAINED: list[tuple[Any, bytearray]] = []


class Channel:
    """Collective over `comm`: a duplicate of it (`comm`) and `tags` tags of this channel's own (`tag(i)`, i in
    [0, tags)); `tags=None` takes the widest range the MPI library's tag bound leaves each generation (`tags`)."""

    def __init__(self, comm: MPI.Comm, tags: int | None = None) -> None:
        from mpi4py import MPI  # lazily: collsync imports without an MPI library

        global _made
        bound: Any = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)  # the library's bound, an attribute of the world
        span = (int(bound if bound is not None else 32767) + 1) // GENERATIONS
        if tags is not None and not 0 < tags <= span:
            raise ValueError(f"a channel has 1 to {span} tags under this MPI library's tag bound ({bound}); {tags=}")
        self.tags = span if tags is None else tags
        self.MPI, self.comm = MPI, comm.Dup()
        generation = self.comm.allreduce(_made, op=MPI.MAX)  # ranks may have made different numbers of channels
        _made = generation + 1
        self.base = int(generation) % GENERATIONS * self.tags

    def tag(self, i: int) -> int:
        """This channel's i-th tag."""
        if not 0 <= i < self.tags:
            raise ValueError(f"tag {i} outside this channel's {self.tags} tags")
        return self.base + i

    def free(self) -> None:
        """Take what has come and nobody received (a delivery to a rank that stopped reading: it would sit in the
        MPI library's queues to the exit, where UCX warns of each), then free the communicator. Not waited for:
        a message whose sender is gone may never complete, and what is still in flight is the tags' business."""
        if self.comm == self.MPI.COMM_NULL:
            return
        _DRAINED[:] = [(req, buf) for req, buf in _DRAINED if not req.Test()]
        status = self.MPI.Status()
        while (message := self.comm.Improbe(self.MPI.ANY_SOURCE, self.MPI.ANY_TAG, status)) is not None:
            buf = bytearray(status.Get_count(self.MPI.BYTE))
            _DRAINED.append((message.Irecv([buf, self.MPI.BYTE]), buf))
        self.comm.Free()
