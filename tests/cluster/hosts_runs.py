"""Each rank's host name, then several `collsync-train` runs in one launch (tests/scripts/train_runs.py).

    mpiexec ... python -m mpi4py tests/cluster/hosts_runs.py RUNS.json

Rank 0 writes the host name of every rank (socket.gethostname(), as the launcher set it) to hosts.json beside
RUNS.json before the runs start, so a test can check that the ranks really were on different hosts.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from train_runs import main  # noqa: E402  (tests/scripts is not a package: found through the path just set)

hosts = MPI.COMM_WORLD.allgather(socket.gethostname())
if MPI.COMM_WORLD.rank == 0:
    (Path(sys.argv[1]).parent / "hosts.json").write_text(json.dumps(hosts))
main()
