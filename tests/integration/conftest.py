"""The order in which tests/run.sh's serial stage hands out this folder's files (`-m serial -n 2 --dist loadfile
--no-loadscope-reorder`: a file to a worker, in collection order): the longest first, so that the stage does not end
with one worker running a long file alone while the other sits idle. xdist's own order (most tests first) handed out
test_keepalive.py (2 tests, up to 150 s) last. The other stage keeps xdist's order, which ends its workers within 1%
of each other."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent

# The serial tests' files by the seconds they took together (setup included), longest first, measured on two busy
# cores; a file not named here runs after these, in collection order. A new file that takes minutes belongs here.
LONGEST_FIRST = (
    "test_elastic.py",  # 487 s
    "test_lost_workers.py",  # 348 s
    "test_ulfm.py",  # 333 s
    "test_mpi_cli.py",  # 306 s
    "test_faults.py",  # 254 s
    "test_keepalive.py",  # 184 s
    "test_lost_rank.py",  # 137 s
    "test_torch_launch.py",  # 129 s
    "test_torch_specsync.py",  # 125 s
    "test_torch_lost.py",  # 95 s
    "test_partial_lost.py",  # 88 s
    "test_restart.py",  # 78 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Sort this folder's serial tests by their file's place in LONGEST_FIRST (stable: a file's own tests keep
    their order), in the places they held among the session's items (every other test keeps its place)."""
    here = [i for i, item in enumerate(items) if item.path.parent == HERE and item.get_closest_marker("serial")]
    place = {name: n for n, name in enumerate(LONGEST_FIRST)}
    ordered = sorted((items[i] for i in here), key=lambda item: place.get(item.path.name, len(place)))
    for i, item in zip(here, ordered, strict=True):
        items[i] = item
