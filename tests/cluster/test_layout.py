"""What ranks across the box's hosts believe about their cores and their links: the hosts are namespaces of one
kernel, so every rank shares the machine's cores with all the others (`node_layout` by the kernel's boot id, not
by host name), while MPI reaches the other hosts over TCP (`spans_hosts`), where `CommThread` waits in MPI's
blocking `Allreduce` (its algorithms tuned for the network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.cluster.box import DIR, ENV, ROOT, cluster, mpirun, need

PROBE = """
import json
from mpi4py import MPI
from collsync.runtime.mpi_thread import CommThread
from collsync.runtime.mpi_world import node_layout, own_cores, spans_hosts
comm = MPI.COMM_WORLD
thread = CommThread(comm)
said = dict(rank=comm.rank, layout=node_layout(comm), own=own_cores(comm), hosts=spans_hosts(comm),
            blocking=thread.blocking, name=MPI.Get_processor_name())
thread.close()
every = comm.gather(said, root=0)  # one print by one rank: the ranks' lines would interleave in mpiexec's output
if comm.rank == 0:
    print("LAYOUT " + json.dumps(every), flush=True)
"""


def test_hosts_of_one_kernel_share_its_cores_and_reduce_in_mpi(mpi):
    need(mpi)
    cmd = mpirun(mpi, "node0:2,node1:1,node2:1", 4, "-c", PROBE)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LAYOUT ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    said = json.loads(lines[0].split(" ", 1)[1])
    assert sorted(s["rank"] for s in said) == [0, 1, 2, 3]
    assert {s["name"] for s in said} == {"node0", "node1", "node2"}
    cores = len(os.sched_getaffinity(0))
    for s in said:
        assert s["layout"] == [4, cores], s  # all four ranks on this one machine, whichever host they are on
        assert s["own"] == (4 <= cores), s
        assert s["hosts"] is True, s
        assert s["blocking"] is True, s  # across hosts: MPI's blocking algorithm even where cores are shared


# Busy for 1 s of wall time; prints the host and the CPU seconds the process got.
BURN = (
    "import socket, time\nt = time.perf_counter() + 1.0\nwhile time.perf_counter() < t: pass\n"
    "print(socket.gethostname(), time.process_time())"
)


def test_a_host_whose_cpu_is_held_runs_its_processes_at_that_share_and_lets_go(box):
    """`cluster.py cpu node2 0.25` (issue 33, item 5: a host slowed by a CPU-bound neighbour): a rank the box's
    mpiexec starts on node2 gets about a quarter of one core while one on node0 takes what the machine gives it;
    `cpu node2 none` removes what it made."""
    cluster("cpu", "node2", "0.25")
    try:
        command = [str(DIR / "bin" / "mpiexec"), "-hosts", "node0:1,node2:1", "-n", "2", sys.executable, "-c", BURN]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV)
    finally:
        cluster("cpu", "node2", "none")
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = dict(line.split() for line in proc.stdout.splitlines())
    held, free = float(got["node2"]), float(got["node0"])
    assert held <= 0.4, got  # 0.25 s of CPU in 1 s, with the quota's period as slack
    assert free > held + 0.1, got  # unheld it takes what the machine gives it (2 cores, shared)
    assert not (DIR / "cpu" / "node2").exists()
    assert "not held" not in proc.stderr, proc.stderr
