"""Backup workers, BSP and async over MPI with injected heterogeneous gamma stragglers (000_... Fig. 3-6 for real).

    python benchmarks/mpi_stragglers.py                      # 5 ranks: 1 server + 4 workers, 200 updates each
    python benchmarks/mpi_stragglers.py --ranks 9 --backups 1 2

Each configuration is one `collsync-train` run under the venv's mpiexec with `runtime.inject_stragglers=true`:
every worker sleeps the compute time the seeded `gamma_heterogeneous` model draws for its batch (001_... App. C.3,
V_mach 0.6, V_task 0.1), times `--time-scale`. From rank 0's trace:

* mean round time (wall seconds between consecutive updates) against its ideal, the mean over rounds of the N-th
  smallest injected time of the n workers (`stragglers.order_statistic_mean`; N = n for BSP): real / ideal is the
  runtime's overhead on top of the straggler model (gradient computation, MPI, the server), >= 1;
* the speedup of each backup setting over BSP in round time, and async updates per second over BSP's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from collsync.stragglers import gamma_heterogeneous, order_statistic_mean

ROOT = Path(__file__).resolve().parent.parent


def run(ranks: int, overrides: list[str], folder: Path, hosts: str | None = None) -> list[float]:
    """Launch one run; return the wall times of its updates (seconds since start, from rank 0's trace). The run's
    summary.json stays in `folder`. `hosts` ("node0:2,node1:4"): the ranks across the cluster in one box
    (scripts/cluster.py, its folder $COLLSYNC_CLUSTER_DIR or /tmp/collsync-cluster) instead of this host."""
    if hosts is None:
        launcher = [str(Path(sys.executable).parent / "mpiexec")]
    else:
        box = Path(os.environ.get("COLLSYNC_CLUSTER_DIR", "/tmp/collsync-cluster"))
        launcher = [str(box / "bin" / "mpiexec"), "-hosts", hosts]
    args = [*launcher, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "collsync.cli"]
    args += [f"hydra.run.dir={folder}", "progress=false", "runtime=mpi", *overrides]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=folder.parent)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} failed:\n{proc.stderr[-2000:]}")
    events = [json.loads(line) for line in (folder / "trace.jsonl").open()]
    return [e["t"] for e in events if e["ev"] == "apply"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--time-scale", type=float, default=0.02, help="wall seconds per model second")
    parser.add_argument("--backups", type=int, nargs="+", default=[1])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mpi_stragglers.json")
    args = parser.parse_args()
    workers = args.ranks - 1
    common = [
        f"steps={args.steps}",
        f"eval_every={args.steps}",
        f"seed={args.seed}",
        "stragglers=gamma_heterogeneous",
        "runtime.inject_stragglers=true",
        f"runtime.time_scale={args.time_scale}",
    ]
    sampler = gamma_heterogeneous().sampler(workers, args.seed)
    configs = {"bsp": ["sync=bsp"]}
    configs |= {f"backup b={b}": ["sync=backup", f"sync.backups={b}"] for b in args.backups}
    configs["async"] = ["sync=async", "optimizer=sgd"]
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in configs.items():
            times = run(args.ranks, common + overrides, Path(tmp) / name.replace(" ", "_").replace("=", ""))
            span = times[-1] - times[0]
            row = {"updates": len(times), "mean_round_s": span / (len(times) - 1), "updates_per_s": len(times) / span}
            if name != "async":
                k = workers - (0 if name == "bsp" else int(name.split("=")[1]))
                ideal = order_statistic_mean(sampler, workers, k, args.steps) * args.time_scale
                row |= {"quorum": k, "ideal_round_s": ideal, "real_over_ideal": row["mean_round_s"] / ideal}
            rows[name] = row
            print(f"{name:>12}: " + ", ".join(f"{key} {value:.4g}" for key, value in row.items()), flush=True)
    bsp = rows["bsp"]
    for name, row in rows.items():
        if name.startswith("backup"):
            row["speedup_over_bsp"] = bsp["mean_round_s"] / row["mean_round_s"]
            row["ideal_speedup_over_bsp"] = bsp["ideal_round_s"] / row["ideal_round_s"]
    rows["async"]["updates_per_s_over_bsp"] = rows["async"]["updates_per_s"] / bsp["updates_per_s"]
    result = {
        "command": f"python benchmarks/mpi_stragglers.py --ranks {args.ranks} --steps {args.steps} "
        f"--time-scale {args.time_scale:g} --backups {' '.join(map(str, args.backups))} --seed {args.seed}",
        "workers": workers,
        "stragglers": "gamma_heterogeneous (mean 1, V_mach 0.6, V_task 0.1)",
        **rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
