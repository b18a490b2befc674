"""Rank 0's word at the end of a sharded run (`runtime.watchdog.agree_on_the_end`), at any world size >= 2: every
rank that answered the final gather learns whether a rank is gone; a rank rank 0 did not hear from is sent nothing
(between hosts a message to a rank cut off fails in MPI) and, hearing nothing within its bound, takes none gone."""

from __future__ import annotations

import time

import pytest

from collsync.runtime.watchdog import agree_on_the_end


def _blocks(comm, silent: set[int]) -> list:
    """What rank 0's final gather returns (None: a rank that did not answer); nothing elsewhere."""
    return [None if r in silent else r for r in range(comm.Get_size())] if comm.Get_rank() == 0 else []


def test_every_rank_learns_that_none_is_gone(comm):
    assert agree_on_the_end(comm, _blocks(comm, set()), False, 10.0) is False


def test_every_rank_that_answered_learns_that_a_worker_was_lost(comm):
    assert agree_on_the_end(comm, _blocks(comm, set()), True, 10.0) is True


def test_a_rank_that_did_not_answer_is_told_nothing(comm):
    if comm.Get_size() < 2:
        pytest.skip("needs a rank besides rank 0")
    last = comm.Get_size() - 1
    start = time.monotonic()
    gone = agree_on_the_end(comm, _blocks(comm, {last}), False, 0.2)
    if comm.Get_rank() == last:
        # No word within 3 x its bound: taken as none gone (its own close is bounded), after that wait, no sooner.
        assert gone is False and time.monotonic() - start >= 0.6
    else:
        assert gone is True  # rank 0 saw a rank silent at the gather: gone, whatever `lost` said
