"""Helpers for tests/slurm: find the cluster, submit jobs, wait for them, and record them for the run's summary."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = Path(os.environ.get("COLLSYNC_SLURM_DIR", "/tmp/collsync-slurm"))
# States after which a job never runs again (without a requeue).
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@dataclass
class Record:
    """The jobs the tests submitted, by what they ran: (what, job id, final state)."""

    jobs: list[tuple[str, str, str]] = field(default_factory=list)


RECORD = Record()


def unavailable() -> str | None:
    """Why no cluster answers here, or None when one does (and its environment is set for the tests)."""
    if "SLURM_CONF" not in os.environ and (SLURM_DIR / "slurm.conf").exists():
        os.environ["SLURM_CONF"] = str(SLURM_DIR / "slurm.conf")
    # submitit asks `sacct` for job states: the stand-in that slurm_up.sh writes answers without accounting.
    if (SLURM_DIR / "bin" / "sacct").exists() and str(SLURM_DIR / "bin") not in os.environ["PATH"].split(":"):
        os.environ["PATH"] = f"{SLURM_DIR / 'bin'}:{os.environ['PATH']}"
    if shutil.which("sinfo") is None or "SLURM_CONF" not in os.environ:
        why = (SLURM_DIR / "unavailable").read_text().strip() if (SLURM_DIR / "unavailable").exists() else ""
        return why or "no Slurm cluster here: start one with `bash scripts/slurm_up.sh` (needs root and apt-get)"
    states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if not {"idle", "mixed", "allocated"} & set(states.stdout.split()):
        answer = states.stdout.strip() or states.stderr.strip()
        return f"the Slurm cluster of SLURM_CONF={os.environ['SLURM_CONF']} has no usable node (sinfo: {answer})"
    return None


def job_states(job: str) -> dict[str, str]:
    """The state of a job, or of each task of an array job ('123' or '123_0' -> state), from the controller."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    states = {}
    for line in out.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        task = fields.get("ArrayTaskId")
        name = f"{fields['ArrayJobId']}_{task}" if task else fields["JobId"]
        states[name] = fields["JobState"]
    return states


def wait_for(job: str, what: str, timeout: float = 300.0) -> dict[str, str]:
    """Wait until the job (every task of an array) reaches a final state; record and return the states."""
    deadline = time.monotonic() + timeout
    while True:
        states = job_states(job)
        if states and all(s in FINAL for s in states.values()):
            break
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], timeout=30)
            raise AssertionError(f"{what}: job {job} not finished within {timeout:.0f} s: {states}")
        time.sleep(0.5)
    for name, state in sorted(states.items()):
        RECORD.jobs.append((what, name, state))
    return states


def sbatch(cwd: Path, *args: str) -> str:
    """Submit a batch job from `cwd` (its SLURM_SUBMIT_DIR); return its id."""
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert proc.returncode == 0, f"sbatch {' '.join(args)}: {proc.stderr.strip()}"
    return proc.stdout.strip().split(";")[0]


def start_requeued_now(job: str, scontrol: tuple[str, ...] = ("scontrol",), timeout: float = 120.0) -> None:
    """Slurm holds a requeued job back for 120 s (its BeginTime) before it may start again: a cluster's pause that a
    test need not sit through, so once the job is pending again its start time is set to 5 s from now. Not to now:
    slurmd revokes the first attempt's credential at the requeue, in whole seconds, and an attempt allocated within
    that second is killed as "Job credential revoked" (the job then ends FAILED)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run([*scontrol, "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
        restarts = re.search(r"Restarts=(\d+)", shown.stdout)
        if "JobState=PENDING" in shown.stdout and restarts and int(restarts.group(1)) >= 1:
            subprocess.run([*scontrol, "update", f"jobid={job}", "StartTime=now+5"], timeout=30, check=True)
            return
        if any(f"JobState={state}" in shown.stdout for state in FINAL):
            return
        time.sleep(0.2)
