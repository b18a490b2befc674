"""`collsync-train runtime=partial` (serverless backup, bsp too) under ULFM (Open MPI 5's `mpirun --with-ft ulfm`):
a rank that dies costs neither the deadline nor a restart.

The partial allreduce's waits poll one-sided windows, which no process failure reaches, so each is made with a
failure detector (`mpi_ulfm.Watch`, `watch=True`): within a pause of the death every survivor's wait raises MPI's
process-failure error, wherever the dead rank was (between rounds, or inside a round it counts in, holding its
block of the sum). Then, as the bucketed reducer does for `runtime=allreduce` (`runtime.mpi_ulfm`):

1. every survivor revokes the world's communicator and the partial allreduce's own, and shrinks the world to the
   ranks left (`mpi_ulfm.shrink`);
2. they agree on the step: a partial allreduce's ranks may be up to its `depth` rounds apart (a rank reads a round
   complete before it came without waiting), so each keeps its last `depth + 1` results (`Kept`), and the lowest
   rank at the highest version hands those behind the results they had not applied (the same means, contributors
   and dropped, so the replicas and rank 0's trace stay as if each had read them from the ring);
3. the replica regroups on the n' left (`lost.regroup`: `lost` and `world` events, the quorum of n'), the data
   follows `data.Batches` with n' workers from the step and the ledger starts afresh there (as a relaunch on n'
   from a checkpoint at that step would: `rounds.run_partial` on a resumed replica), and a new partial allreduce
   is made on the survivors' communicator;
4. the round that was open is done again by the n' left; the gradients of it are computed again (on the batches
   of n'), nothing else: no relaunch, no checkpoint read.

Rank 0 evaluates, checkpoints and writes the run folder, so a dead rank 0 ends the run (`rank0_lost`: one line,
exit 2, at once), for `collsync-run` to relaunch from the last checkpoint. A rank stopped, not dead, is not a
process failure: `sync.backups` and the deadline decide (`mpi_partial_lost`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

from collsync import ending
from collsync.data import Batches
from collsync.loops import GradFn, Gradients
from collsync.lost import regroup
from collsync.rounds import apply_result, run_partial
from collsync.runs.parts import Launch
from collsync.runtime import PartialResult
from collsync.runtime.mpi_partial import PartialAllreduce
from collsync.runtime.mpi_ulfm import Shrunk, recovering, shrink
from collsync.runtime.mpi_world import rank_prefix
from collsync.server import Server
from collsync.types import Flat


def rank0_lost(shrunk: Shrunk, host: str) -> NoReturn:
    """Rank 0 died: it evaluates, checkpoints and writes the run folder, so the run cannot go on in place. The
    lowest survivor says so in one line and ends the job (`MPI_Abort(2)`, as any error of the run); the others
    wait for that rather than each say it. The last checkpoint stays for `collsync-run`'s relaunch."""
    from mpi4py import MPI  # lazily: collsync imports without an MPI library

    first = shrunk.comm.Get_rank() == 0
    ending.end(
        ending.DEADLINE,
        f"collsync-train: {rank_prefix(MPI.COMM_WORLD)}: error: rank 0 on {host} died (it evaluates, checkpoints "
        "and writes the run folder), so the run cannot go on in place (ULFM); collsync-run relaunches it on the "
        "ranks left from its last checkpoint",
        comm=MPI.COMM_WORLD,
        defer=0.0 if first else 2 * ending.REPORT_GRACE_S,
    )


class Kept:
    """A partial allreduce (`runtime.Partial`) that keeps the last `keep` results it returned, numbered by the
    replica's version (`base` + its own round), the means copied: what a rank ahead hands one behind after a
    shrink."""

    def __init__(self, keep: int) -> None:
        self.results: deque[PartialResult] = deque(maxlen=keep)
        self.pa: Any = None
        self.rank = self.size = self.base = 0

    def use(self, pa: PartialAllreduce, base: int) -> None:
        """Drive `pa` from now on; its round 0 is the replica's version `base`."""
        self.pa, self.rank, self.size, self.base = pa, pa.rank, pa.size, base

    def __call__(self, tensor: Flat, quorum: int, round: int) -> PartialResult:
        return self._keep(self.pa(tensor, quorum, round))

    def try_read(self, quorum: int, round: int) -> PartialResult | None:
        result = self.pa.try_read(quorum, round)
        return None if result is None else self._keep(result)

    def stop_reading(self) -> None:
        self.pa.stop_reading()

    def _keep(self, result: PartialResult) -> PartialResult:
        self.results.append(result._replace(mean=result.mean.clone(), round=result.round + self.base))
        return result


class InPlace:
    """`runtime=partial`'s training under ULFM (see the module): `train` runs `rounds.run_partial` and, after a
    process failure, shrinks, regroups and goes on from the same step; `pa` is the partial allreduce of the world as
    it stands, `lost` the ranks that died (`ending.lost_rank`)."""

    def __init__(self, launch: Launch, make: Callable[[Any], PartialAllreduce], lost: list[dict[str, Any]]) -> None:
        self.launch, self.make, self.lost = launch, make, lost
        self.pa = make(launch.comm)
        self.kept = Kept(self.pa.depth + 1)

    def train(self, server: Server, grads: GradFn, on_update: Callable[[Server], None] | None, catch_up: bool) -> None:
        def attempt() -> None:
            self.kept.use(self.pa, server.version)
            run_partial(server, self.kept, grads, on_update=on_update, catch_up=catch_up)

        recovering(
            attempt, lambda error: self._recover(server, on_update), lambda: [self.launch.comm, *self.pa.comms()]
        )

    def _recover(self, server: Server, on_update: Callable[[Server], None] | None) -> None:
        """Steps 1-3 of the module's docstring (collective over the survivors)."""
        launch, old = self.launch, self.launch.comm
        shrunk = shrink(old, *self.pa.comms())
        if 0 in shrunk.lost:
            rank0_lost(shrunk, launch.hosts[0])
        self._catch_up(shrunk, server, on_update)
        gone = [launch.hosts[r] for r in shrunk.lost]
        self.lost.extend(ending.lost_rank(r, h, server.contributed[r]) for r, h in zip(shrunk.lost, gone, strict=True))
        regroup(server, shrunk.lost, shrunk.lost, gone)
        new, n = shrunk.comm, shrunk.comm.Get_size()
        launch.hosts = [h for r, h in enumerate(launch.hosts) if r not in shrunk.lost]
        launch.comm, launch.workers = new, n
        if isinstance(launch.grads, Gradients):
            run = launch.parts.run
            launch.grads.batches = Batches(launch.parts.data, n, run.batch_size, run.seed)
        if launch.shrunk is not None:
            launch.shrunk(old, new)
        self.pa = self.make(new)
        if new.Get_rank() == 0:
            named = ", ".join(f"rank {r} on {h}" for r, h in zip(shrunk.lost, gone, strict=True))
            logging.getLogger("collsync.train").warning(
                "%s died; going on in place with %d of %d ranks from step %d (ULFM: nothing read back; the open "
                "round's gradients computed again)",
                named,
                n,
                shrunk.was,
                server.version,
            )

    def _catch_up(self, shrunk: Shrunk, server: Server, on_update: Callable[[Server], None] | None) -> None:
        """Step 2: those behind apply the results the lowest rank at the highest version kept."""
        versions = shrunk.comm.allgather(server.version)
        high, low = max(versions), min(versions)
        root = versions.index(high)
        if high == low:
            return
        mine = [r for r in self.kept.results if r.round >= low] if shrunk.comm.Get_rank() == root else None
        results: list[PartialResult] = shrunk.comm.bcast(mine, root=root)
        if [r.round for r in results] != list(range(low, high)):
            raise RuntimeError(
                f"partial allreduce: after the shrink the survivors are at versions {versions}, and rank {root} kept "
                f"rounds {[r.round for r in results]}: the ranks behind cannot catch up in place"
            )
        for result in results[server.version - low :]:
            apply_result(server, result)
            if on_update is not None:
                on_update(server)
