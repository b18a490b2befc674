"""PSP-SGD over MPI (003_... Alg. 1, Fig. 4-5 in miniature): naive sync vs partial push vs partial push and pull.

    python benchmarks/mpi_psp.py                       # 6 ranks: 2 server shards + 4 workers, 300 updates

Every configuration trains digits with the same seed and hyperparameters, with injected stragglers: workers draw
heterogeneous gamma compute times (001_... App. C.3), and shard 1's server is slow (`--slow-server` model seconds
per update), so both of PSP's mechanisms have something to skip. Compared, as the paper does: wall time to the
last update of the slower shard and the final test accuracy.

* naive sync: every worker's gradient each round (c = n), every shard before the next round (b = 100%);
* partial push: the first c = n - 1 gradients of a round (the paper's c = 28 of 32, scaled to n);
* partial push + pull: and a worker goes on once half of the shards (b = 50%) have the round, taking the newest
  block the other shard has published.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_stragglers import ROOT, run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--time-scale", type=float, default=0.01, help="wall seconds per model second")
    parser.add_argument("--slow-server", type=float, default=0.25, help="model seconds shard 1 adds per update")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hosts", default=None, help="ranks across the cluster in one box: node0:2,node1:2,...")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mpi_psp.json")
    args = parser.parse_args()
    ranks, c = args.workers + 2, max(1, args.workers - 1)
    common = [
        f"steps={args.steps}",
        f"seed={args.seed}",
        "sync=psp",
        "runtime.servers=2",
        "runtime.inject_stragglers=true",
        f"runtime.time_scale={args.time_scale}",
        "stragglers=gamma_heterogeneous",
        "stragglers._target_=collsync.stragglers.Stragglers",
        "+stragglers.compute=gamma_heterogeneous",
        f"+stragglers.slow_server={args.slow_server}",
        "+stragglers.shard=1",
    ]
    configs = {
        "naive sync": ["sync.push_fraction=null", "sync.pull_fraction=1.0"],
        "partial push": [f"sync.pushes={c}", "sync.pull_fraction=1.0"],
        "partial push + pull": [f"sync.pushes={c}", "sync.pull_fraction=0.5"],
    }
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in configs.items():
            folder = Path(tmp) / name.replace(" ", "_").replace("+", "and")
            times = run(ranks, common + overrides, folder, args.hosts)
            summary = json.loads((folder / "summary.json").read_text())
            rows[name] = {
                # Training is over when the slowest shard has made its last update.
                "wall_s": max(times[-1], *(shard["last_update_s"] for shard in summary["shards"])),
                "final_acc": summary["final_acc"],
                "best_acc": summary["best_acc"],
                "dropped": summary["trace_checks"]["dropped"],
                "partial_pulls": summary["partial_pulls"],
            }
            print(f"{name:>20}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[name].items()), flush=True)
    naive = rows["naive sync"]["wall_s"]
    for row in rows.values():
        row["time_saved"] = 1.0 - row["wall_s"] / naive
    result = {
        "command": f"python benchmarks/mpi_psp.py --workers {args.workers} --steps {args.steps} "
        f"--time-scale {args.time_scale:g} --slow-server {args.slow_server:g} --seed {args.seed}"
        + (f" --hosts {args.hosts}" if args.hosts else ""),
        "ranks": ranks,
        "pushes_c": c,
        **rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
