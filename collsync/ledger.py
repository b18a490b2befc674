"""Serverless backup's batches: which batch each rank computes in each round, so that none is lost with a dropped
gradient (000_..., Chen et al., drop the backups' gradients, and with fixed shards their batches would go too).

With torch's fixed shards a rank late for a round loses its batch with its gradient, and a rank that catches up
skips the batches of the rounds it missed: a rank always late leaves its whole shard out of every epoch, and an
epoch of bsp's rounds sees (n - b) / n of the data. The ledger hands each of those batches to a rank in time for a
later round instead: every batch of an epoch is in exactly one applied mean (an epoch's last few, fewer than n,
go first in the next), and an epoch takes the rounds its batches need. Adding rounds over the fixed shards alone
would not do: the late rank's shard would still be computed by the late rank, late again.

Every replica knows every round's contributors, so every rank (and the simulator) works out the same assignment
without a message. Plain Python: used by `rounds` (both MPI fronts), `sim` and `collsync.torch`'s sampler.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class Ledger:
    """Which chunk each of `ranks` ranks computes in each backup round: the batches of dropped gradients handed to
    ranks in time (the shared-sampler idea of the stream modes' `SharedCounter`, decided from the rounds' results).

    Chunk g is batch g // n of shard g % n (n = `ranks`): `data.Batches.batch(g % n, g // n)` in the trainer and the
    simulator, batch g // n of torch's shard g % n in `collsync.torch.DistributedSampler`. Round t hands out n
    chunks: first those returned (oldest first), then fresh ones in order; the ranks that contributed to the last
    round take them first (in rank order), then the others, so a returned chunk goes to a rank that was in time.
    `settle(contributors)` closes the round: the contributors' chunks are used, the others' returned. With every
    rank in every round, round t gives rank r chunk t n + r: the fixed shards exactly. Counts: `used` (chunks in
    an applied mean), `returned` (chunks handed out again after a late or skipped round); `log` (with `keep`) the
    chunks used, in order."""

    def __init__(self, ranks: int, first: int = 0, keep: bool = False) -> None:
        if ranks < 1:
            raise ValueError(f"Ledger: {ranks=} must be >= 1")
        self.ranks = ranks
        self.fresh = first  # the next chunk never handed out (a resumed trainer's replica: version x n)
        self.pending: deque[int] = deque()  # chunks returned, oldest first
        self.order = list(range(ranks))  # the order in which the ranks take the round's chunks
        self.round = self.used = self.returned = 0
        self.log: list[int] | None = [] if keep else None
        self.assigned = self._assign()

    def _assign(self) -> list[int]:
        chunks = [0] * self.ranks
        for r in self.order:
            if self.pending:
                chunks[r] = self.pending.popleft()
            else:
                chunks[r], self.fresh = self.fresh, self.fresh + 1
        return chunks

    def batch(self, rank: int) -> tuple[int, int]:
        """(shard, batch index) of `rank`'s chunk in the round under way."""
        g = self.assigned[rank]
        return g % self.ranks, g // self.ranks

    def settle(self, contributors: list[int]) -> None:
        """Round `round` was applied with `contributors`' gradients: theirs used, the others' chunks returned."""
        members = set(contributors)
        for r, g in enumerate(self.assigned):
            if r in members:
                self.used += 1
                if self.log is not None:
                    self.log.append(g)
            else:
                self.pending.append(g)
                self.returned += 1
        self.order = sorted(members) + [r for r in range(self.ranks) if r not in members]
        self.round += 1
        self.assigned = self._assign()

    def state_dict(self) -> dict[str, Any]:
        """Plain types, for a checkpoint (the simulator's)."""
        return {
            "fresh": self.fresh,
            "pending": list(self.pending),
            "order": list(self.order),
            "counts": [self.round, self.used, self.returned],
            "assigned": list(self.assigned),
        }

    @classmethod
    def from_state(cls, ranks: int, state: dict[str, Any]) -> Ledger:
        """The ledger `state_dict()` gave."""
        ledger = cls(ranks)
        ledger.fresh, ledger.order = int(state["fresh"]), [int(r) for r in state["order"]]
        ledger.pending = deque(int(g) for g in state["pending"])
        ledger.round, ledger.used, ledger.returned = (int(c) for c in state["counts"])
        ledger.assigned = [int(g) for g in state["assigned"]]
        return ledger
