"""Serverless backup's ledger (`collsync.ledger.Ledger`): which batch each rank computes in each round, so that a
dropped gradient's batch is computed again by a rank in time and every batch is in exactly one applied mean."""

from __future__ import annotations

import random

import pytest

from collsync.ledger import Ledger


def test_with_every_rank_in_every_round_it_is_the_fixed_shards():
    ledger = Ledger(4)
    for t in range(5):
        assert [ledger.batch(r) for r in range(4)] == [(r, t) for r in range(4)]
        ledger.settle([0, 1, 2, 3])
    assert ledger.used == 20 and ledger.returned == 0 and ledger.round == 5


def test_a_late_ranks_batch_goes_to_a_rank_in_time_next_round():
    ledger = Ledger(4)
    ledger.settle([0, 1, 2])  # rank 3 late: its chunk 3 comes back
    assert ledger.assigned == [3, 4, 5, 6]  # the first rank in time takes it; rank 3 a fresh one
    ledger.settle([1, 2, 3])  # rank 0 late now: chunk 3 goes to rank 1
    assert ledger.assigned[1] == 3 and ledger.assigned[0] == 9 and ledger.returned == 2


@pytest.mark.parametrize("seed", range(5))
def test_every_chunk_is_used_exactly_once_whoever_is_late(seed):
    """Random contributors (a quorum of n - b, one rank late far more often): no chunk is used twice, and every
    chunk handed out is used, except those of the round under way and fewer than n returned."""
    n, b = 5, 2
    rng = random.Random(seed)
    ledger = Ledger(n, keep=True)
    for _ in range(200):
        late = {n - 1} if rng.random() < 0.8 else set()
        late |= set(rng.sample(range(n), rng.randint(0, b - len(late))))
        ledger.settle([r for r in range(n) if r not in late])
    log = ledger.log
    assert log is not None and len(log) == len(set(log)) == ledger.used
    unused = set(range(ledger.fresh)) - set(log)
    assert unused == set(ledger.assigned) | set(ledger.pending) and len(ledger.pending) < n
    assert ledger.returned > 150


def test_its_state_goes_on_where_it_was():
    ledger = Ledger(3, first=6)
    ledger.settle([0, 2])
    again = Ledger.from_state(3, ledger.state_dict())
    for contributors in ([1, 2], [0, 1, 2], [0]):
        ledger.settle(contributors)
        again.settle(contributors)
        assert again.assigned == ledger.assigned and again.state_dict() == ledger.state_dict()


def test_a_ledger_needs_a_rank():
    with pytest.raises(ValueError, match="Ledger: ranks=0 must be >= 1"):
        Ledger(0)
