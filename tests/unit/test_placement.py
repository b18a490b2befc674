"""The servers' placement by host (`collsync.runtime.placement.server_order`): which ranks serve, and the order the
placed communicator gives every rank. Pure: host names in, an order out."""

from __future__ import annotations

import pytest

from collsync.runtime.placement import check_placement, launch_order, named_rank, server_order
from collsync.runtime.spec import auto, mpi


def servers_of(hosts: list[str], servers: int, placement: str = "spread") -> list[int]:
    return server_order(hosts, servers, placement)[:servers]


def test_block_placement_over_two_hosts_puts_a_server_on_each():
    """mpiexec's block placement, 4 ranks a host: ranks 0 and 4 serve, the workers follow in the launch's order."""
    hosts = ["a"] * 4 + ["b"] * 4
    assert server_order(hosts, 2) == [0, 4, 1, 2, 3, 5, 6, 7]


def test_several_hosts_one_server_each_in_the_order_of_their_first_rank():
    hosts = ["n0"] * 3 + ["n1"] * 3 + ["n2"] * 3
    assert servers_of(hosts, 3) == [0, 3, 6]


def test_uneven_hosts_take_turns_and_a_host_out_of_ranks_is_passed_over():
    """One rank on b, three on a, two on c: the second round has no rank of b left."""
    hosts = ["a", "a", "a", "b", "c", "c"]
    assert servers_of(hosts, 3) == [0, 3, 4]
    assert servers_of(hosts, 5) == [0, 3, 4, 1, 5]
    assert server_order(hosts, 5) == [0, 3, 4, 1, 5, 2]


def test_more_servers_than_hosts_doubles_up_only_after_every_host_has_one():
    hosts = ["a"] * 4 + ["b"] * 4
    assert servers_of(hosts, 3) == [0, 4, 1]
    assert servers_of(hosts, 4) == [0, 4, 1, 5]


def test_one_host_changes_nothing():
    """Ranks 0..S-1 serve, and the order is the launch's: no communicator is made (`place`), the run is the same."""
    for servers in (0, 1, 2, 5):
        assert server_order(["box"] * 6, servers) == list(range(6))


def test_ranks_already_dealt_round_robin_change_nothing():
    """srun --distribution=cyclic (or mpiexec -ppn 1): the servers are on distinct hosts already."""
    assert server_order(["a", "b", "a", "b"], 2) == [0, 1, 2, 3]


def test_first_and_no_servers_are_the_identity():
    hosts = ["a"] * 3 + ["b"] * 3
    assert server_order(hosts, 2, "first") == list(range(6))
    assert server_order(hosts, 0) == list(range(6))


def test_rank_zero_stays_rank_zero_and_every_rank_is_placed_once():
    """Rank 0 evaluates and writes the run folder: it must not move, whatever the hosts."""
    for hosts in (["a", "b", "a", "c", "b"], ["x"] * 2 + ["y"] * 5, ["p", "q", "r"]):
        for servers in range(1, len(hosts)):
            order = server_order(hosts, servers)
            assert order[0] == 0 and sorted(order) == list(range(len(hosts)))


def test_a_bad_placement_is_refused_naming_the_option():
    assert check_placement("first", "x") == "first"
    with pytest.raises(ValueError, match=r"^runtime: placement='block' must be 'spread' .* or 'first'$"):
        mpi(placement="block")
    with pytest.raises(ValueError, match=r"runtime: placement='Spread'"):
        auto(placement="Spread")  # refused outside MPI too (the simulator), as everywhere the run lands
    with pytest.raises(ValueError, match=r"^placement='' must be"):
        server_order(["a"], 0, "")


def test_the_runtime_carries_the_placement_and_defaults_to_spread():
    assert mpi().placement == "spread" and mpi(placement="first").placement == "first"


def test_ranks_of_an_unplaced_communicator_are_named_as_they_are():
    """Without a placed communicator (one host, "first"), naming is the identity: no MPI is touched."""
    assert named_rank(object(), 3) == 3 and named_rank(None, 2) == 2
    assert launch_order(object(), ["a", "b", "c"]) == ["a", "b", "c"]
