"""MPICH's shared-memory segments (`/dev/shm/mpich_shm_*`) that a rank killed by a test left behind: nothing
removes them, and a later job whose segment name hashes to one of them fails in MPI_Init ("Out of memory" in
`MPIDI_POSIX_comm_bootstrap`). `clear_stale()` removes those no process maps any more."""

from __future__ import annotations

import time
from pathlib import Path

SHM = Path("/dev/shm")


def _mapped() -> set[str]:
    """The names of the /dev/shm files some process maps now."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue  # the process ended meanwhile, or is not ours to read
        names.update(line.rsplit("/", 1)[-1] for line in text.splitlines() if "/dev/shm/" in line)
    return names


def clear_stale(min_age_s: float = 60.0) -> list[str]:
    """Remove MPICH segments no process maps and older than `min_age_s` (a job starting now may hold one open but
    not yet mapped); returns their names."""
    mapped, now, gone = _mapped(), time.time(), []
    for path in SHM.glob("mpich_shm_*"):
        try:
            if path.name in mapped or now - path.stat().st_mtime < min_age_s:
                continue
            path.unlink()
        except OSError:
            continue  # removed by another run meanwhile
        gone.append(path.name)
    return gone
