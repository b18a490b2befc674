"""The direct exchange's message waits (`mpi_partial_messages`) over fake requests, without MPI: a timeout names
exactly the peers whose message is pending, and which way, and never the rank itself."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from collsync.runtime.mpi_partial_direct import DirectRounds
from collsync.runtime.mpi_partial_messages import Messages, Pending
from collsync.runtime.mpi_windows import Backoff
from collsync.runtime.mpi_world import RankLost


class _Request:
    def __init__(self, done: bool) -> None:
        self.done = done

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return self.done


class _Comm:
    """Point-to-point calls whose requests complete at once, but those to or from the peers in `stuck` (as
    (peer, send) pairs): a peer stopped inside the round."""

    def __init__(self, stuck: set[tuple[int, bool]]) -> None:
        self.stuck = stuck

    def Irecv(self, buf: Any, peer: int, tag: int) -> _Request:  # noqa: N802
        return _Request((peer, False) not in self.stuck)

    def Isend(self, buf: Any, peer: int, tag: int) -> _Request:  # noqa: N802
        return _Request((peer, True) not in self.stuck)


def _messages(stuck: set[tuple[int, bool]]) -> Messages:
    """A `Messages` on the fake communicator (its constructor would duplicate a real one)."""
    msgs = Messages.__new__(Messages)
    fake_mpi = SimpleNamespace(
        Request=SimpleNamespace(Testall=lambda reqs: all(r.Test() for r in reqs)), Exception=OSError, INT64_T="int64"
    )
    msgs.MPI, msgs.comm, msgs.mpi_t, msgs.backoff = fake_mpi, _Comm(stuck), "double", Backoff(spins=0, cap=1e-4)
    msgs.rounds, msgs.counts, msgs.deliveries = 1000, None, None
    msgs.channel = SimpleNamespace(tag=lambda i: i)  # a `Channel` of generation 0
    return msgs


def _contributor(rank: int, stuck: set[tuple[int, bool]]) -> DirectRounds:
    """Rank `rank` of 4 (one host each) as a contributor of the direct exchange, its timeouts at once."""
    rounds = DirectRounds()
    rounds.msgs, rounds.rank, rounds.size, rounds.numel, rounds.dtype = _messages(stuck), rank, 4, 6, torch.float64
    rounds.timeout, rounds._spin, rounds._parts = 0.0, False, None
    rounds._who, rounds._hosts = f"rank {rank}", [f"h{r}" for r in range(4)]
    return rounds


@pytest.mark.parametrize(
    ("stuck", "named"),
    [
        # Receives are posted first, so the receive from rank 3 was the 2nd request, which the contributors
        # [0, 2, 3] paired with rank 2 (this rank) before: it must name rank 3.
        ({(3, False)}, "rank 3 on h3 (its block of the sum not received)"),
        ({(0, True)}, "rank 0 on h0 (this rank's block of the sum not taken)"),
        (
            {(3, False), (3, True), (0, True)},
            "rank 0 on h0 (this rank's block of the sum not taken); rank 3 on h3 (its block of the sum not "
            "received, this rank's block of the sum not taken)",
        ),
    ],
)
def test_a_timed_out_exchange_names_the_peer_it_waits_on_not_itself(stuck, named):
    rounds = _contributor(2, stuck)
    with pytest.raises(RankLost) as failed:
        rounds._exchange(torch.ones(6, dtype=torch.float64), [0, 2, 3], [], 5, torch.empty(6, dtype=torch.float64))
    message = str(failed.value)
    assert f"round 5 is being summed: waiting on {named} after timeout=0.0s" in message, message
    assert "rank 2 on" not in message


def test_a_listener_names_the_contributor_whose_block_of_the_mean_is_missing():
    rounds = _contributor(1, {(2, False)})
    with pytest.raises(RankLost, match=r"waiting on rank 2 on h2 \(its block of the mean not received\) after"):
        rounds._exchange(None, [0, 2, 3], [1], 7, torch.empty(6, dtype=torch.float64))


def test_a_record_not_taken_names_the_contributor_that_did_not_take_it():
    msgs = _messages({(3, True)})
    record = np.zeros(6, dtype=np.int64)
    posted = msgs.post([(record, 0), (record, 3)], [], msgs.tag(4, 0))
    assert posted.messages == [Pending(0, send=True), Pending(3, send=True)]
    with pytest.raises(RankLost, match=r"^\[3\] after timeout=0.0s$"):
        msgs.wait(posted, 0.0, lambda pending: str([m.peer for m in pending]))


def test_until_returns_what_the_probe_found_and_times_out_naming_it():
    msgs = _messages(set())
    answers = iter([None, None, "here"])
    assert msgs.until(lambda: next(answers), 1.0, lambda: "never") == "here"
    with pytest.raises(RankLost, match="^nothing came after timeout=0.0s$"):
        msgs.until(lambda: None, 0.0, lambda: "nothing came")
