"""The partial allreduce's encodings and the serverless backup loop, without MPI (a scripted stand-in)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from collsync.checks import check_trace
from collsync.loops import check_policy
from collsync.margin import EXPLORE, Margin
from collsync.policy import asynchronous, backup, bsp, ssp
from collsync.rounds import BackupRounds, apply_result, run_partial, tolerated
from collsync.rules import sgd
from collsync.runtime.mpi_partial import PartialResult
from collsync.runtime.mpi_partial_tags import (
    OVERWRITTEN,
    PENDING,
    READY,
    SUMMING,
    stamp,
    tag_state,
    unstamp,
    writing_tag,
)
from collsync.runtime.mpi_partial_windows import (
    CLOSED,
    _posted_for,
    block,
    check_call,
    check_margin,
    lagging,
    split,
    ticket_state,
)
from collsync.server import Server
from collsync.trace import Trace


@pytest.mark.parametrize(
    ("tag", "round_", "state"),
    [
        (-1, 0, PENDING),  # entry never used
        (writing_tag(5), 5, SUMMING),  # this round's blocks being summed
        (2, 5, PENDING),  # the entry still holds an earlier round (5 - depth 3)
        (writing_tag(2), 5, PENDING),
        (5, 5, READY),
        (8, 5, OVERWRITTEN),  # reused for round 5 + depth
        (writing_tag(8), 5, OVERWRITTEN),  # being reused: a reader must not keep what it read
    ],
)
def test_tag_states(tag, round_, state):
    assert tag_state(tag, round_) == state


def test_writing_tags_never_collide_with_empty_or_complete():
    assert {writing_tag(r) for r in range(100)}.isdisjoint({-1, *range(100)})


def test_ticket_state_subtracts_the_earlier_rounds_of_the_entry():
    # 4 ranks; the entry served 2 earlier rounds (every rank's ticket and one close each) before this one.
    assert ticket_state(2 * (4 + CLOSED), 2, 4, direct=False) == (0, False, 0)
    assert ticket_state(2 * (4 + CLOSED) + 3, 2, 4, direct=False) == (3, False, 0)
    full = 0b1111 + (1 << 4)  # direct: a round adds every rank's bit and the close flag 1 << n
    assert ticket_state(2 * full, 2, 4, direct=True) == (0, False, 0)
    assert ticket_state(2 * full + 0b1010, 2, 4, direct=True) == (2, False, 0b1010)  # ranks 1 and 3 came before


def test_ticket_state_tells_a_ticket_drawn_after_the_close():
    assert ticket_state(2, 0, 4, direct=False) == (2, False, 0)
    assert ticket_state(CLOSED + 3, 0, 4, direct=False) == (3, True, 0)  # the fourth ticket, after the close
    assert ticket_state(CLOSED, 0, 4, direct=False) == (0, True, 0)
    assert ticket_state((1 << 4) + 0b0111, 0, 4, direct=True) == (3, True, 0b0111)  # ranks 0-2 before the close


@pytest.mark.parametrize("margin", [0, -1.0, "soon", True, [1.0]])
def test_check_margin_names_a_bad_value(margin):
    with pytest.raises(ValueError, match="margin=.* must be None, 'auto' or a number of seconds > 0"):
        check_margin(margin)


def test_margin_waits_the_round_so_far_until_it_has_measured():
    margin = Margin()
    assert margin.limit(0.02, 3) == 0.02  # nothing measured yet: wait up to T, and measure
    for _ in range(20):
        margin.observe(0.001, True, 0.02)  # every rank came 1 ms after the quorum-th
    assert margin.limit(0.02, 3) == pytest.approx(0.02 / 3)  # the estimate (~1 ms) is below T / N: T / N
    assert 0.001 <= margin.estimate < 0.002
    assert margin.limit(1.0, 3) == pytest.approx(1.0 / 3)  # never below T / N
    assert margin.limit(0.0005, 3) == 0.0005  # never above T


def test_margin_follows_the_spread_and_halves_when_ranks_stay_out():
    margin = Margin()
    for gap in [0.010, 0.012, 0.008] * 10:
        margin.observe(gap, True, 1.0)
    assert margin.mean == pytest.approx(0.010, abs=0.001) and 0.010 < margin.estimate < 0.020
    assert margin.limit(0.03, 3) == margin.estimate  # between T / N and T: the estimate itself
    margin.observe(0.0, False, 0.05)  # the margin ran out with a rank missing
    assert margin.estimate == 0.025
    margin.observe(0.0, False, margin.limit(0.06, 3))
    assert margin.estimate == pytest.approx(0.0125)
    margin.observe(0.010, True, 0.02)  # a complete round sets it from the running estimate again
    assert margin.estimate > 0.010


@pytest.mark.parametrize(("numel", "parts"), [(10, 3), (3, 4), (1, 1), (1_000_003, 7), (0, 2)])
def test_blocks_tile_the_vector_in_order_and_differ_by_at_most_one(numel, parts):
    blocks = [block(i, parts, numel) for i in range(parts)]
    assert blocks[0][0] == 0 and blocks[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))  # contiguous, no gap, no overlap
    widths = [hi - lo for lo, hi in blocks]
    assert max(widths) - min(widths) <= 1 and min(widths) >= 0


def test_split_and_lagging():
    assert split([3, 0], 5) == ([0, 3], [1, 2, 4])
    assert split([], 2) == ([], [0, 1])
    assert lagging([7, 4, 6], round_=9, depth=3) == [1, 2]  # round 9 reuses round 6's entry; 1, 2 have not read it
    assert lagging([0, 0], round_=2, depth=3) == []


def test_a_record_read_with_its_tag_is_taken_only_when_every_word_is_of_the_round():
    record = np.array([0, 3, 3, 0, 2, 5, -1, -1])  # blocks, quorum, count, ranks (padded)
    words = stamp(9, record)
    assert np.array_equal(unstamp(words, 9), record)
    assert unstamp(np.zeros(8, dtype=np.int64), 0) is None  # never written: not round 0's
    for other in (5, 8, 10, 13):  # one word still of the entry's earlier round (depth 4), or of any other
        mixed = words.copy()
        mixed[4] = stamp(other, record)[4]
        assert unstamp(mixed, 9) is None
    blocks = words.copy()
    blocks[0] += 2  # two blocks summed since the record was written: still round 9's
    assert unstamp(blocks, 9)[0] == 2


def test_posted_for_waits_for_the_quorum_and_rejects_extra():
    posted = np.array([4, 3, 4, -1])
    assert _posted_for(posted, 4, 2) == [0, 2]
    assert _posted_for(posted, 4, 3) is None
    with pytest.raises(RuntimeError, match="disagree on the quorum"):
        _posted_for(posted, 4, 1)


def test_check_call_names_the_value():
    with pytest.raises(ValueError, match="round=3, expected round=2"):
        check_call(4, 2, 2, 3, 1, None)
    with pytest.raises(ValueError, match="quorum=3 must be in 1..2"):
        check_call(4, 2, 0, 0, 3, None)
    with pytest.raises(ValueError, match="tensor has 5 elements"):
        check_call(4, 2, 0, 0, 1, torch.zeros(5))


class Scripted:
    """A k-of-n partial allreduce of `size` ranks seen from rank 0: rounds rotate who is counted; every third
    round is complete before rank 0 gets there (try_read answers)."""

    rank = 0

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = 0
        self.stops: list[int] = []  # the calls made before each `stop_reading` (the reads it completed)

    def _result(self, quorum: int, round: int, late: bool) -> PartialResult:
        order = [(round + i) % self.size for i in range(self.size)]
        counted = [r for r in order if not (late and r == 0)][:quorum]
        contributors, dropped = split(counted, self.size)
        return PartialResult(torch.full((3,), float(round)), round, quorum, contributors, dropped)

    def __call__(self, tensor: torch.Tensor, quorum: int, round: int) -> PartialResult:
        self.calls += 1
        return self._result(quorum, round, late=False)

    def try_read(self, quorum: int, round: int) -> PartialResult | None:
        return self._result(quorum, round, late=True) if round % 3 == 2 else None

    def stop_reading(self) -> None:
        self.stops.append(self.calls)


def test_run_partial_traces_every_gradient_applied_or_dropped_once():
    policy, steps = backup(1), 9
    trace = Trace()
    server = Server(torch.zeros(3), sgd(lr=1.0), policy, 4, steps=steps, trace=trace)
    pa = Scripted(4)
    run_partial(server, pa, lambda params, worker, index: torch.ones(3))
    counts = check_trace(trace, policy, 4)
    assert counts == {"pushed": 36, "applied": 27, "dropped": 9, "updates": steps}
    assert pa.calls == 6  # rounds 2, 5, 8 were read without computing a gradient
    assert torch.equal(server.params, -torch.arange(steps, dtype=torch.float32).sum().expand(3))
    assert {e["reason"] for e in trace.of("drop")} == {"late", "finished"}


def test_dropped_ranks_are_traced_as_late_then_finished():
    trace = Trace()
    server = Server(torch.zeros(2), sgd(), backup(1), 2, steps=2, trace=trace)
    for t in range(2):
        apply_result(server, PartialResult(torch.ones(2), t, 1, [0], [1]))
    drops = trace.of("drop")
    assert [(e["worker"], e["clock"], e["reason"]) for e in drops] == [(1, 0, "late"), (1, 1, "finished")]
    assert server.dropped == 2 and server.applied == 2 and server.version == 2


def test_apply_result_rejects_a_round_out_of_step():
    server = Server(torch.zeros(2), sgd(), bsp(), 1)
    with pytest.raises(ValueError, match="round 1 applied to a replica at version 0"):
        apply_result(server, PartialResult(torch.zeros(2), 1, 1, [0], []))


@pytest.mark.parametrize("policy", [asynchronous(), ssp(2), ssp(0, timeout=0.1)])
def test_policies_the_partial_allreduce_cannot_run(policy):
    with pytest.raises(ValueError, match="runtime=partial runs sync=bsp or sync=backup"):
        check_policy(policy)


def test_world_must_match_the_server():
    server = Server(torch.zeros(2), sgd(), bsp(), 3, steps=1)
    with pytest.raises(ValueError, match="workers=3, the world has 4 ranks"):
        run_partial(server, Scripted(4), lambda params, worker, index: params)


def test_sync_config_takes_a_margin_for_serverless_backup_only():
    from collsync.torch.config import sync_config

    assert sync_config("backup").margin == "auto"  # collsync.torch's default: wait for everyone not straggling
    assert sync_config("backup", margin=None).margin is None  # the paper's fixed b
    assert sync_config("backup", backups=2, margin=0.05).margin == 0.05
    with pytest.raises(ValueError, match=r"sync=backup: margin='soon' must be None, 'auto' or a number of seconds"):
        sync_config("backup", margin="soon")
    with pytest.raises(ValueError, match=r"margin=0.1 is for serverless backup"):
        sync_config("backup", servers=1, margin=0.1)
    with pytest.raises(ValueError, match=r"sync=bsp: margin='auto' is for serverless backup"):
        sync_config("bsp", margin="auto")


def test_margin_stops_waiting_for_ranks_later_than_a_step():
    """Complete rounds that waited longer than the closing rank's step S (a persistently slow worker): only T / N,
    however long the period its waits made; a step longer than the mean gap keeps the estimate."""
    margin = Margin()
    for _ in range(10):
        margin.observe(0.02, True, 0.03)  # the slow one came 20 ms after the quorum-th
    assert margin.limit(0.03, 3) == pytest.approx(margin.estimate)  # no step known: as before, the estimate
    assert margin.limit(0.03, 3, step=0.012) == pytest.approx(0.01)  # 20 ms late against a 12 ms step: T / N
    assert margin.limit(0.03, 3, step=0.05) == pytest.approx(margin.estimate)  # within a step: waited for


class Behind(Scripted):
    """Rank 0 comes late: rounds 0..late-1 completed without it (try_read answers them); from then on it is in time."""

    def __init__(self, size: int, late: int) -> None:
        super().__init__(size)
        self.late = late

    def try_read(self, quorum: int, round: int) -> PartialResult | None:
        return self._result(quorum, round, late=True) if round < self.late else None


@pytest.mark.parametrize("catch_up", [True, False])
def test_a_late_rank_catches_up_and_skips_the_batches_it_missed(catch_up):
    """collsync-train's rounds (`run_partial`) as collsync.torch's: with catch-up, a rank late for round 0 applies
    the rounds completed meanwhile and then computes the batch the ledger hands it for the round it comes to (3):
    its own of round 3 (shard 0, batch 3), then those of rank 2 in round 3 and rank 3 in round 4, which were left
    out of those rounds (`Scripted` rotates who is counted); without catch-up, its own next batch (0) for round 3."""
    server = Server(torch.zeros(3), sgd(lr=1.0), backup(1), 4, steps=6)
    asked: list[tuple[int, int]] = []

    def grads(params, worker, index):
        asked.append((worker, index))
        return torch.ones(3)

    run_partial(server, Behind(4, late=3), grads, catch_up=catch_up)
    assert asked == ([(0, 3), (2, 2), (2, 3)] if catch_up else [(0, 0), (0, 1), (0, 2)])
    assert server.version == 6 and server.dropped >= 3


def test_catch_up_applies_at_most_the_room_it_has():
    pa = Behind(4, late=5)
    rounds = BackupRounds(pa, quorum=3)
    applied: list[int] = []
    first = rounds.take(lambda: torch.ones(3))
    assert rounds.late and first.round == 0 and rounds.dropped == 1
    assert rounds.catch_up(2, lambda result: applied.append(result.round)) == 2
    assert applied == [1, 2] and rounds.round == 3 and rounds.caught_up == 2
    off = BackupRounds(Behind(4, late=5), quorum=3, catch_up=False)
    off.take(lambda: torch.ones(3))
    assert off.catch_up(10, lambda result: None) == 0 and off.round == 1


@pytest.mark.parametrize("why", ["room", "epoch", "off"])
def test_a_catch_up_that_stops_inside_the_backlog_tells_the_transport(why):
    """A catch-up that stops with rounds still complete (its room, an epoch's end, or catch-up off) tells the
    transport that it stopped reading (`Partial.stop_reading`: the direct exchange completes the tickets and read
    counter its reads from deliveries left to the next read), before the caller computes; a round in time, not."""
    pa = Behind(4, late=5)
    rounds = BackupRounds(pa, quorum=3, catch_up=why != "off")
    rounds.take(lambda: torch.ones(3))
    assert pa.stops == []  # not after `take`: a catch-up may read on, and its backlog completes with one Flush
    room, stop = (1, None) if why == "room" else (10, (lambda: rounds.round >= 3))
    caught = rounds.catch_up(room, lambda result: None, stop=stop)
    assert caught == {"room": 1, "epoch": 2, "off": 0}[why] and rounds.round == 1 + caught
    assert len(pa.stops) == 1
    in_time = Behind(4, late=0)
    rounds = BackupRounds(in_time, quorum=3)
    rounds.take(lambda: torch.ones(3))
    assert rounds.catch_up(10, lambda result: None) == 0 and not rounds.late
    rounds.pause()
    assert in_time.stops == []  # a round in time (contributed to) leaves nothing to complete


def test_tolerated_is_what_the_policy_allows_while_the_quorum_can_come():
    assert tolerated(backup(1), 4) == 1
    assert tolerated(backup(2), 6) == 2
    assert tolerated(bsp(), 4) == 0


def test_the_partial_protocol_follows_the_placement() -> None:
    """`protocol="auto"` (the default, `runtime.protocol`): the direct exchange where the ranks span hosts, the
    host-summed path on one host; direct or host when asked; the direct exchange never past its ticket word's bits."""
    from collsync.runtime.mpi_partial_direct import DIRECT_MAX_RANKS, direct_protocol
    from collsync.runtime.spec import partial

    assert direct_protocol("auto", ["a", "b", "b"]) and not direct_protocol("auto", ["a", "a", "a"])
    assert direct_protocol("direct", ["a", "a"]) and not direct_protocol("host", ["a", "b"])
    assert not direct_protocol("auto", [str(r) for r in range(DIRECT_MAX_RANKS + 1)])
    with pytest.raises(ValueError, match="protocol='ring' must be one of auto, direct, host"):
        direct_protocol("ring", ["a"])
    assert partial().protocol == "auto" and partial(protocol="host").protocol == "host"
    with pytest.raises(ValueError, match="runtime: protocol='ring' must be auto, direct or host"):
        partial(protocol="ring")


def test_margin_closes_at_once_where_waiting_gave_fewer_gradients_a_second():
    """n / T_all against N / T_now (rounds this rank closed): a round closes at its quorum at once where waiting for
    everyone gave fewer gradients a second (a worker behind a slow link: in time, but its round's exchange slow),
    and every EXPLORE-th round takes the other choice, so that both periods follow the run."""
    margin = Margin()
    decisions = []
    for _ in range(4 * EXPLORE):
        limit = margin.limit(0.06, 3, step=0.05, workers=4)
        decisions.append(limit == 0.0)
        # What the round then cost: 90 ms when it waited and took all 4, 45 ms when it closed at once with 3.
        margin.paced(0.045 if margin.now else 0.09, complete=not margin.now)
    assert margin.period_all == pytest.approx(0.09) and margin.period_now == pytest.approx(0.045)
    late = decisions[2 * EXPLORE :]  # both periods known: 4 / 0.09 < 3 / 0.045, so close at once but to explore
    assert late.count(False) == len(late) // EXPLORE and late.count(True) == len(late) - len(late) // EXPLORE
    assert not margin.waiting_pays(3, 4)
    for _ in range(25 * EXPLORE):  # the worker got faster: a round that waits and takes all 4 costs 50 ms now
        margin.limit(0.06, 3, step=0.05, workers=4)
        margin.paced(0.045 if margin.now else 0.05, complete=not margin.now)
    assert margin.waiting_pays(3, 4)  # 4 / 0.05 > 3 / 0.045: it waits again
    assert margin.limit(0.06, 3, step=0.05) > 0.0  # without `workers` nothing is weighed


def test_a_round_closed_at_once_leaves_the_gap_estimate_alone():
    margin = Margin(period_all=0.09, period_now=0.045)
    margin.observe(0.001, True, 0.02)
    estimate = margin.estimate
    margin.limit(0.06, 3, workers=4)  # waiting does not pay: closed at once
    assert margin.now
    margin.observe(0.0, False, 0.0)
    assert margin.estimate == estimate
