"""The k-of-n partial allreduce and serverless backup workers on it, at any world size (every rank runs every test)."""

from __future__ import annotations

import random
import socket
import time
import zlib

import pytest
import torch

from collsync.checks import check_trace
from collsync.loops import run_allreduce
from collsync.policy import backup, bsp
from collsync.rounds import BackupRounds, run_partial
from collsync.rules import sgd
from collsync.runtime.mpi_coll import MpiCollective
from collsync.runtime.mpi_partial import PartialAllreduce, PartialResult
from collsync.runtime.mpi_windows import RmaCounts
from collsync.server import Server
from collsync.trace import Trace


def _contribution(rank: int, round_: int, numel: int) -> torch.Tensor:
    """Small integers, distinct per rank and round: any summation order is exact, and a wrong slot shows."""
    return torch.arange(numel, dtype=torch.float64) + (rank * 1000 + round_ % 997)


def _expected(result: PartialResult, numel: int) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float64)
    for r in result.contributors:
        total += _contribution(r, result.round, numel)
    return total / result.quorum


def _same_everywhere(comm, value: bytes) -> bool:
    return len(set(comm.allgather(value))) == 1


def test_full_quorum_equals_allreduce(comm):
    n, numel = comm.Get_size(), 10
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=2) as pa:
        for t in range(6):
            x = torch.arange(numel, dtype=torch.float64) * (comm.Get_rank() + 1) + t
            result = pa(x, quorum=n, round=t)
            reference = MpiCollective(comm).allreduce_mean(x.clone())
            assert torch.equal(result.mean, reference)
            assert result.contributors == list(range(n)) and result.dropped == []


def test_counted_rounds_give_the_same_means_and_count_every_round_trip(comm):
    """`count` changes nothing a round returns; a partial round makes remote calls and Flushes (waits among them),
    a full round none on the windows (it is an allreduce)."""
    n, rank, numel = comm.Get_size(), comm.Get_rank(), 9
    # The direct exchange by name: what a round moves by messages is asserted below (the default takes the host's
    # windows on one host; the host-summed path's counts are the last test's).
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=2, protocol="direct") as pa:
        counts = pa.count(RmaCounts())
        for t in range(8):
            before = counts.copy()
            k = max(1, n - 1) if t % 2 else n
            result = pa(_contribution(rank, t, numel), quorum=k, round=t)
            assert torch.equal(result.mean, _expected(result, numel))
            took = counts.minus(before)
            if k == n > 1:
                assert took.remote_ops == took.round_trips == 0
            else:
                assert took.remote_ops >= took.round_trips > took.waits >= 0
                # The mean came from the host's ring or the contributors' messages (a dropped rank), from the other
                # contributors' messages, or this rank was the only one and wrote it there.
                moved = ("Get", "Irecv") if rank in result.dropped else ("Irecv",) if result.quorum > 1 else ("Put",)
                assert sum(took.ops[kind] for kind in moved) >= 1, took.ops
        assert _same_everywhere(comm, zlib.crc32(result.mean.numpy().tobytes()).to_bytes(4, "little"))


def test_quorum_below_n_counts_exactly_k(comm):
    n, numel, rounds = comm.Get_size(), 7, 40
    rng = random.Random(comm.Get_rank())
    seen = []
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=3) as pa:
        for t in range(rounds):
            k = 1 + t % n
            if rng.random() < 0.3:
                time.sleep(rng.random() * 1e-3)
            result = pa(_contribution(comm.Get_rank(), t, numel), quorum=k, round=t)
            assert len(result.contributors) == k and len(result.dropped) == n - k
            assert sorted(result.contributors + result.dropped) == list(range(n))
            assert torch.equal(result.mean, _expected(result, numel))
            seen.append((result.contributors, result.dropped, result.mean.numpy().tobytes()))
    assert _same_everywhere(comm, repr(seen).encode())


def _stress(comm, rounds: int, seed: int, longest_sleep: float, margin: float | str | None = None):
    """`rounds` rounds of quorum n - 1 (every 4th: 1 + t % n), ranks jittered at random by up to `longest_sleep`
    s and reading a complete round instead of contributing 3 times in 10: every result is checked, the results
    agree bit for bit on every rank, and each rank's fates come back (per round: 1 counted, 2 contributed but
    dropped, 3 read a complete round without contributing) with the quorum each round counted."""
    n, rank, numel = comm.Get_size(), comm.Get_rank(), 8
    rng = random.Random(seed + rank)
    fate = bytearray(rounds)
    digest, sizes = 0, []
    # The direct exchange by name (the default takes the host's windows on one host, as the other tests do): the
    # path the ranks take across hosts under the same stress.
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=3, margin=margin, protocol="direct") as pa:
        for t in range(rounds):
            k = max(1, n - 1) if t % 4 else 1 + t % n
            if rng.random() < 0.05:
                time.sleep(rng.random() * longest_sleep)
            result = pa.try_read(k, t) if rng.random() < 0.3 else None
            if result is not None:
                fate[t] = 3
                assert rank in result.dropped
            else:
                result = pa(_contribution(rank, t, numel), quorum=k, round=t)
                fate[t] = 1 if rank in result.contributors else 2
            assert len(result.contributors) == result.quorum >= k and len(set(result.contributors)) == result.quorum
            assert margin is not None or result.quorum == k  # without a margin a round counts exactly k
            sizes.append(result.quorum)
            assert torch.equal(result.mean, _expected(result, numel))
            digest = zlib.crc32(
                repr((result.contributors, result.dropped)).encode() + result.mean.numpy().tobytes(), digest
            )
    fates = comm.allgather(bytes(fate))
    assert _same_everywhere(comm, str(digest).encode())
    assert all(len(f) == rounds and 0 not in f for f in fates)  # every rank settled every round
    return fates, sizes


def test_stress_every_contribution_counted_or_dropped_once(comm):
    n, rounds = comm.Get_size(), 10_000
    start = time.monotonic()
    fates, _ = _stress(comm, rounds, 12_345, 200e-6)
    counted = sum(f.count(1) for f in fates)
    assert counted == sum(max(1, n - 1) if t % 4 else 1 + t % n for t in range(rounds))
    if comm.Get_rank() == 0:
        print(f"\n{rounds} rounds at n={n}: {time.monotonic() - start:.1f} s")


def test_slow_rank_within_depth_catches_up_exactly(comm):
    n, rank, numel, depth = comm.Get_size(), comm.Get_rank(), 5, 3
    if n < 2:
        pytest.skip("needs a slow rank beside a quorum of others")
    slow, quorum = n - 1, n - 1
    replica = torch.zeros(numel, dtype=torch.float64)
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=depth) as pa:
        for t in range(4 * depth):
            grad = _contribution(rank, t, numel)
            if rank == slow and t == 0:
                time.sleep(1.0)
                # The others completed exactly `depth` rounds without it, then waited at the gate.
                assert pa.latest() == depth - 1
            if rank != slow and t == depth:
                pa.timeout = 0.2
                with pytest.raises(TimeoutError, match=rf"waits for ranks \[{slow}\] to read round 0"):
                    pa(grad, quorum, t)
                pa.timeout = None  # the gate took no ticket: the call may be retried
            result = pa.try_read(quorum, t)
            if rank == slow and t < depth:
                assert result is not None and slow in result.dropped
            if result is None:
                result = pa(grad, quorum, t)
            replica.mul_(0.5).add_(result.mean)  # order-sensitive: a missed or reordered round would show
    assert _same_everywhere(comm, replica.numpy().tobytes())


def test_calls_out_of_order_are_rejected(comm):
    with PartialAllreduce(comm, 3) as pa:
        with pytest.raises(ValueError, match="round=1, expected round=0"):
            pa(torch.zeros(3), quorum=1, round=1)
        with pytest.raises(ValueError, match="quorum=0 must be in 1"):
            pa(torch.zeros(3), quorum=0, round=0)
        with pytest.raises(ValueError, match="tensor has 4 elements"):
            pa(torch.zeros(4), quorum=1, round=0)
        with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor of 3 elements"):
            pa(torch.zeros(3), quorum=1, round=0, out=torch.zeros(4))


def _integer_grads(numel: int):
    """Integer-valued gradients: every sum is exact, so partial and full allreduce agree bit for bit."""
    target = torch.arange(numel, dtype=torch.float64) % 5

    def grads(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
        return torch.floor(params * 2) - target + (worker + index) % 3

    return grads


def _least_squares(target: torch.Tensor):
    def grads(params: torch.Tensor, worker: int, index: int) -> torch.Tensor:
        time.sleep(random.Random(worker * 7919 + index).random() * 2e-3)  # uneven workers: some are dropped
        return params - target + 0.01 * (worker + 1)

    return grads


def test_run_partial_full_quorum_equals_run_allreduce(comm):
    n, numel, steps = comm.Get_size(), 33, 25
    start = torch.zeros(numel, dtype=torch.float64)
    reference = run_allreduce(
        Server(start, sgd(lr=0.5), bsp(), n, steps=steps), MpiCollective(comm), _integer_grads(numel)
    )
    trace = Trace()
    server = Server(start, sgd(lr=0.5), bsp(), n, steps=steps, trace=trace)
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=4) as pa:
        run_partial(server, pa, _integer_grads(numel))
    assert server.version == steps and torch.equal(server.params, reference.params)
    counts = check_trace(trace, bsp(), n)
    assert counts["applied"] == steps * n and counts["dropped"] == 0


def test_backup_workers_train_and_pass_the_trace_checks(comm):
    n, numel, steps = comm.Get_size(), 33, 40
    if n < 2:
        pytest.skip("backup workers need at least two ranks")
    policy = backup(1)
    target = torch.linspace(-1, 1, numel, dtype=torch.float64)
    start = torch.zeros(numel, dtype=torch.float64)
    trace = Trace()
    server = Server(start, sgd(lr=0.1), policy, n, steps=steps, trace=trace)
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=4) as pa:
        run_partial(server, pa, _least_squares(target))
    counts = check_trace(trace, policy, n)
    assert counts["updates"] == steps
    assert counts["applied"] == steps * (n - 1) and counts["dropped"] == steps
    assert (server.params - target).norm() < 0.1 * (start - target).norm()  # it trains
    assert _same_everywhere(comm, server.params.numpy().tobytes())


def test_full_and_partial_rounds_mix_with_a_lagging_rank(comm):
    """Full-quorum rounds (an allreduce, no ticket, read[] written lazily) between partial ones: the tickets' arrival
    arithmetic, the gate and a rank lagging by up to `depth` rounds all still hold, and `out` is filled in place."""
    n, rank, numel, depth, rounds = comm.Get_size(), comm.Get_rank(), 6, 2, 60
    if n < 2:
        pytest.skip("a partial round needs a quorum below n >= 2")
    rng = random.Random(rank)
    out = torch.empty(numel, dtype=torch.float64)
    replica = torch.zeros(numel, dtype=torch.float64)
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=depth) as pa:
        for t in range(rounds):
            quorum = n if t % 3 == 0 else n - 1
            if rank == n - 1 and t % 3 == 1:
                time.sleep(rng.uniform(0, 0.02))  # often the one dropped, often reading rounds it missed
            result = pa.try_read(quorum, t)
            if result is None:
                result = pa(_contribution(rank, t, numel), quorum, t, out=out if t % 2 else None)
                assert (result.mean is out) == bool(t % 2)  # counted, dropped or full: the mean lands in `out`
            assert result.round == t and result.quorum == quorum and len(result.contributors) == quorum
            if quorum == n:
                assert result.contributors == list(range(n)) and result.dropped == []
            assert torch.equal(result.mean, _expected(result, numel))
            replica.mul_(0.5).add_(result.mean)
    assert _same_everywhere(comm, replica.numpy().tobytes())


def test_a_full_round_that_times_out_names_the_rank_that_never_came(comm):
    """A collective cannot say whom it waits for: the roll call does (every rank that timed out answers it)."""
    n, rank, numel = comm.Get_size(), comm.Get_rank(), 4
    if n < 2:
        pytest.skip("needs a missing rank beside others")
    absent = n - 1
    with PartialAllreduce(comm, numel, dtype=torch.float64, timeout=0.3) as pa:
        pa(_contribution(rank, 0, numel), n, 0)
        if rank != absent:
            with pytest.raises(TimeoutError, match=rf"round 1 \(all {n} ranks.*; waiting on rank {absent} on \S+ \("):
                pa(_contribution(rank, 1, numel), n, 1)
            with pytest.raises(RuntimeError, match="round 1's allreduce timed out and is still posted"):
                pa(_contribution(rank, 1, numel), n, 1)  # a retry would post a second allreduce for round 1
        comm.Barrier()
        if rank == absent:
            # Late, it completes the allreduce the others gave up on (their requests finish in free()'s Barrier).
            result = pa(_contribution(rank, 1, numel), n, 1)
            assert torch.equal(result.mean, _expected(result, numel))


def test_free_is_idempotent(comm):
    """`free()` then the `with` block's exit (or `free()` twice) releases windows and communicator once."""
    with PartialAllreduce(comm, 3) as pa:
        assert torch.equal(pa(torch.ones(3), comm.Get_size(), 0).mean, torch.ones(3))
        pa.free()
    pa.free()


def test_a_margin_counts_every_rank_that_comes_within_it(comm):
    """margin=seconds: a round waits that long after its quorum-th arrival, so ranks a moment behind are counted
    (all n, the divisor n), and only a rank later than the margin is dropped; the lists and means agree everywhere."""
    n, rank, numel, rounds = comm.Get_size(), comm.Get_rank(), 9, 30
    if n < 2:
        pytest.skip("a margin needs a quorum below n >= 2")
    slow, quorum = n - 1, n - 1
    rng = random.Random(rank)
    seen = []
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=3, margin=1.0, protocol="direct") as pa:
        for t in range(rounds):
            time.sleep(rng.random() * 2e-3)  # the jitter of ranks nobody would call stragglers
            if t == rounds // 2:
                pa.margin = 0.2  # any margin, the same on every rank
            if rank == slow and t == rounds // 2:
                time.sleep(1.0)
            result = pa.try_read(quorum, t) or pa(_contribution(rank, t, numel), quorum, t)
            assert torch.equal(result.mean, _expected(result, numel))
            assert result.quorum == len(result.contributors) >= quorum
            seen.append((result.contributors, result.mean.numpy().tobytes()))
    assert _same_everywhere(comm, repr(seen).encode())
    counted = [c for c, _ in seen]
    assert counted[: rounds // 2] == [list(range(n))] * (rounds // 2)  # nobody late by a second: nobody dropped
    assert slow not in counted[rounds // 2]  # 1 s late against a margin of 0.2 s
    assert all(set(range(n - 1)) <= set(c) for c in counted)  # the others were never late


def _rounds_dropped(comm, sleep, rounds: int) -> list[int]:
    """Each rank sleeps `sleep(rank, t)` s (its compute) before round t of a margin="auto" partial allreduce of
    quorum n - 1; returns how many of each rank's contributions were dropped, after checking every result."""
    n, rank, numel = comm.Get_size(), comm.Get_rank(), 5
    digest, dropped = 0, 0
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=4, margin="auto") as pa:
        for t in range(rounds):
            time.sleep(sleep(rank, t))
            result = pa.try_read(n - 1, t) or pa(_contribution(rank, t, numel), n - 1, t)
            assert torch.equal(result.mean, _expected(result, numel))
            dropped += rank in result.dropped
            digest = zlib.crc32(repr(result.contributors).encode() + result.mean.numpy().tobytes(), digest)
    assert _same_everywhere(comm, str(digest).encode())
    return comm.allgather(dropped)


def test_auto_margin_drops_almost_nothing_without_stragglers(comm):
    if comm.Get_size() < 2:
        pytest.skip("a margin needs a quorum below n >= 2")
    rounds = 100
    dropped = _rounds_dropped(comm, lambda rank, t: 0.01, rounds)
    # Fixed b = 1 drops one gradient in every round: 100 here. A quiet machine drops 0-2; at load 15 (-n 2 off shared
    # memory, beside other launches) 8, when a 10 ms sleep overran the margin its own spread had set.
    assert sum(dropped) <= 0.2 * rounds, dropped


def test_auto_margin_drops_a_late_ranks_gradients(comm):
    """A rank 0.25 s late in every 15th round (each round ~0.01 s) is dropped there, the others never are."""
    n = comm.Get_size()
    if n < 2:
        pytest.skip("needs a late rank beside a quorum of others")
    late = n - 1
    dropped = _rounds_dropped(comm, lambda rank, t: 0.25 if rank == late and t % 15 == 7 else 0.01, 60)
    assert dropped[late] >= 4 and sum(dropped[:late]) <= 0.05 * 60, dropped  # the others: as without stragglers


def test_auto_margin_stops_waiting_for_a_rank_slow_in_every_round(comm):
    """A rank 3x slower in every round is dropped in most: the rounds that waited for it waited longer than a step,
    so the margin falls to T / N (`backups.Margin`) instead of following the period its own lateness made."""
    n = comm.Get_size()
    if n < 3:
        pytest.skip("needs a slow rank beside a quorum of 2 or more (with a quorum of 1, T / N is the whole period)")
    slow, rounds = n - 1, 40
    dropped = _rounds_dropped(comm, lambda rank, t: 0.03 if rank == slow else 0.01, rounds)
    assert dropped[slow] >= 0.75 * rounds and sum(dropped[:slow]) <= 0.05 * rounds * slow, dropped


def test_stress_with_auto_margin_every_contribution_counted_or_dropped_once(comm):
    rounds = 2_000
    fates, sizes = _stress(comm, rounds, 777, 2e-3, margin="auto")
    # Every rank the round counted says it was counted, and no other: membership was decided once.
    assert [sum(f[t] == 1 for f in fates) for t in range(rounds)] == sizes


def test_a_rank_that_stops_is_lost_and_the_others_go_on(comm):
    """tolerate=1: the last rank stops calling after round 4; the others' gate waits `timeout` for it, declares it
    lost (the lowest live rank then reads for it) and they run 30 rounds with the same means; at the end
    `leave_live` names it, and when it comes back it is told it cannot rejoin."""
    n, rank, numel = comm.Get_size(), comm.Get_rank(), 6
    if n < 2:
        pytest.skip("needs a rank to lose beside the others")
    gone, rounds = n - 1, 30
    seen = []
    kw = {"timeout": 0.5, "tolerate": 1, "protocol": "direct"}  # the direct exchange, as across hosts
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=3, **kw) as pa:
        for t in range(rounds if rank != gone else 5):
            result = pa.try_read(n - 1, t) or pa(_contribution(rank, t, numel), n - 1, t)
            assert torch.equal(result.mean, _expected(result, numel))
            seen.append((result.contributors, result.mean.numpy().tobytes()))
        if rank == gone:
            time.sleep(3.0)  # stopped: the others go on without it
            with pytest.raises(TimeoutError, match="went on without this rank from round 5"):
                pa(_contribution(rank, 5, numel), n - 1, 5)
            assert pa.leave_live() == [gone]
        else:
            assert pa.leave_live() == [gone]
            assert [c for c, _ in seen[5:]] == [list(range(n - 1))] * (rounds - 5)  # every live rank, every round
        assert pa.lost == {gone: 5}
        live = comm.allgather(repr(seen[5:]).encode() if rank != gone else None)
        assert len({v for v in live if v is not None}) == 1  # every live rank read the same rounds


def test_direct_exchange_gives_the_host_paths_bits_in_a_constant_number_of_round_trips(comm):
    """The direct exchange (contributions between contributors, membership from one bit-per-rank ticket word) and
    the host-summed path give the same bits, the rank-order sum of the contributors (values where the order of the
    additions shows), on every rank; a contributor Gets nothing from the host, moves what a ring allreduce moves
    (2 (count - 1) / count of the vector each way) and makes the same few round trips at any world size."""
    n, rank, numel, rounds = comm.Get_size(), comm.Get_rank(), 1000, 12
    quorum = max(1, n - 1)

    def contribution(r: int, t: int) -> torch.Tensor:
        return torch.randn(numel, dtype=torch.float32, generator=torch.Generator().manual_seed(r * 7919 + t)) * 1e3

    seen: dict[str, list[bytes]] = {}
    for protocol in ("direct", "host"):
        seen[protocol] = []
        with PartialAllreduce(comm, numel, depth=2, protocol=protocol) as pa:
            assert pa.direct == (protocol == "direct")
            counts = pa.count(RmaCounts())
            for t in range(rounds):
                before = counts.copy()
                result = pa(contribution(rank, t), quorum, t)
                took = counts.minus(before)
                total = contribution(result.contributors[0], t)
                for r in result.contributors[1:]:  # rank order, one addition after the other
                    total.add_(contribution(r, t))
                assert torch.equal(result.mean, total.div_(len(result.contributors)))
                seen[protocol].append(result.mean.numpy().tobytes())
                if protocol == "direct" and rank in result.contributors:
                    count = len(result.contributors)
                    assert took.ops["Get"] == 0 and took.round_trips - took.waits <= 9, took
                    # The blocks of the sum and of the mean (to the ranks listening too), and the record: the
                    # closer's to every other rank that drew a ticket before its close, or one received; the writer
                    # also delivers the mean to each rank outside the exchange (`mpi_partial_deliver`).
                    outside = n - count
                    assert 2 * (count - 1) <= took.ops["Isend"] <= (count - 1) + 2 * (n - 1) + outside, took
                    assert 2 * (count - 1) <= took.ops["Irecv"] <= 2 * (count - 1) + 1, took
                    block = numel // count + 1
                    floats = 2 * 2 * (numel - numel // count + 1) + block * (n - count)  # + blocks to listeners
                    record = 8 * (2 + n) * (n - 1)
                    delivered = outside * (8 * (3 + n) + 4 * numel)
                    # + the writer's copy to the ring and its deliveries
                    assert took.data_bytes <= 4 * floats + record + 4 * numel + delivered, took
    assert all(_same_everywhere(comm, b) for b in seen["direct"] + seen["host"])


def test_a_direct_rounds_writer_marks_its_contributors_read_and_they_take_no_atomic_for_it(comm):
    """A contributor of a direct round never reads the ring (it holds the mean from the exchange), so the round's
    writer marks read[r] for every contributor in one `Accumulate(MAX)`: a contributor's own atomics are its ticket
    (and the closer's close) only, where writing its read counter was one more round trip to the host, which across
    hosts completes only once the host enters MPI. Any world size; every contributor's read[] is exact after each
    round, and a dropped rank's its own."""
    n, rank, numel, rounds = comm.Get_size(), comm.Get_rank(), 64, 6
    quorum = max(1, n - 1)
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=2, protocol="direct") as pa:
        counts = pa.count(RmaCounts())
        for t in range(rounds):
            before = counts.copy()
            result = pa(_contribution(rank, t, numel), quorum=quorum, round=t)
            atomics = counts.minus(before).ops["Fetch_and_op"]
            assert torch.equal(result.mean, _expected(result, numel))
            pa.stop_reading()  # a dropped rank's deferred read[] lands: every word is settled for the check below
            comm.Barrier()  # every writer's mark is flushed (in its round)
            if n > 1:
                mine = [atomics if rank in result.contributors else 0]
                # The tickets and the one close: count + 1 in all (read counters written too: 2 count + 1).
                assert sum(sum(a) for a in comm.allgather(mine)) == len(result.contributors) + 1
                read = pa._load_many(pa._read, n)
                assert all(int(read[r]) == t + 1 for r in range(n)), (t, read)
            comm.Barrier()  # nobody starts round t + 1 (and moves a read[]) before every rank checked


def test_the_default_protocol_follows_the_placement(comm):
    """`protocol="auto"`, the default: the direct exchange only where the ranks span hosts (by host name)."""
    spans = len(set(comm.allgather(socket.gethostname()))) > 1
    with PartialAllreduce(comm, 16, depth=2) as pa:
        assert pa.direct == (spans and comm.Get_size() <= 40)


def test_a_rank_outside_a_direct_round_takes_it_from_its_delivery_without_a_round_trip(comm):
    """The direct exchange's writer sends each complete round's mean and record to every rank outside its exchange
    (`mpi_partial_deliver`): a rank that comes after rounds completed without it takes each one with no round trip
    to the host but the two that complete its tickets and read counter after the backlog, with the same bits."""
    n, rank, numel, rounds = comm.Get_size(), comm.Get_rank(), 257, 4
    late = n - 1
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=rounds, protocol="direct") as pa:
        counts = pa.count(RmaCounts())
        results = []
        if rank != late or n == 1:
            for t in range(rounds):
                results.append(pa(_contribution(rank, t, numel), quorum=max(1, n - 1), round=t))
        comm.Barrier()  # the late rank comes once every round is complete
        if rank == late and n > 1:
            deliveries, start = pa.msgs.deliveries, time.monotonic()
            while deliveries.arrived_from(0) < rounds and time.monotonic() - start < 60:  # sent, maybe not yet here
                time.sleep(0.001)
            before = counts.copy()
            results = [pa.try_read(n - 1, t) for t in range(rounds)]
            took = counts.minus(before)
            assert all(r is not None for r in results)
            # The backlog's tickets completed by one Flush, then the read counter written: 2 round trips for all.
            assert took.round_trips == 2 and took.ops["Get"] == 0, took  # (the Irecvs were counted as they came)
            before = counts.copy()
            assert pa.try_read(n - 1, rounds) is None  # nothing more, and nothing left to complete
            assert counts.minus(before).round_trips == 0
        for result in results:
            assert result is not None and torch.equal(result.mean, _expected(result, numel))
            assert n == 1 or late not in result.contributors
        digest = zlib.crc32(b"".join(r.mean.numpy().tobytes() for r in results if r is not None))
        assert _same_everywhere(comm, digest.to_bytes(4, "little"))


def test_a_catch_up_stopped_inside_its_backlog_leaves_the_ring_counting_what_it_read(comm):
    """A late rank takes rounds from their deliveries (their tickets and read counter left to its next read while
    more have come) and stops catching up on its room with more delivered (`BackupRounds.catch_up`, as on an epoch's
    end): the stop completes them (`stop_reading`), so that stopped right there (SIGSTOP, a hung host) it leaves the
    host's words in agreement with the rounds it read, as the gate and the lost-rank rules read them."""
    n, rank, numel, rounds = comm.Get_size(), comm.Get_rank(), 33, 4
    if n == 1:
        pytest.skip("needs a rank outside the rounds: two ranks or more")
    late = n - 1
    with PartialAllreduce(comm, numel, dtype=torch.float64, depth=rounds, protocol="direct") as pa:
        results = []
        if rank != late:
            results = [pa(_contribution(rank, t, numel), quorum=n - 1, round=t) for t in range(rounds)]
        comm.Barrier()  # the late rank comes once every round is complete
        if rank == late:
            deliveries, start = pa.msgs.deliveries, time.monotonic()
            while deliveries.arrived_from(0) < rounds and time.monotonic() - start < 60:  # sent, maybe not yet here
                time.sleep(0.001)
            backup = BackupRounds(pa, n - 1)
            results.append(backup.take(lambda: pytest.fail("round 0 was complete: nothing to compute")))
            assert backup.late and backup.catch_up(1, results.append) == 1  # its room: rounds 2 and 3 delivered
        read_to = comm.bcast(pa.round if rank == late else None, root=late)  # (a SIGSTOP would come here)
        assert read_to == 2
        # Every rank reads the late rank's words on the host: its read counter, and its ticket bit in each entry.
        assert pa._load(pa._read + late) == read_to
        assert [pa._load(pa._entry_at(t)) >> late & 1 for t in range(rounds)] == [1, 1, 0, 0]
        comm.Barrier()  # read before the late rank goes on
        if rank == late:  # it comes back and reads the rest
            results += [pa.try_read(n - 1, t) for t in range(read_to, rounds)]
        assert [r.round for r in results] == list(range(rounds))
        for result in results:
            assert result is not None and torch.equal(result.mean, _expected(result, numel))
            assert late not in result.contributors
