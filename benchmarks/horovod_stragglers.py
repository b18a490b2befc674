"""Issue 24's measurement: the Horovod-style script examples/mnist.py under Horovod and under collsync's modes, with
the same stragglers injected on every side; time to Horovod's own final accuracy, and final accuracy.

    .venv/bin/python benchmarks/horovod_stragglers.py                    # 5 repeats x 7 sides x 3 scenarios
    .venv/bin/python benchmarks/horovod_stragglers.py --repeats 3 --scenarios heavy --sides horovod bsp backup
    .venv/bin/python benchmarks/horovod_stragglers.py --model cnn --epochs 20 --scenarios none --sides horovod ssp
    .venv/bin/python benchmarks/horovod_stragglers.py --data fashion --limit 12000 --model cnn --epochs 3 \
        --scenarios none heavy slow shared-core                          # the Fashion-MNIST table
    .venv/bin/python benchmarks/horovod_stragglers.py --tiny --out /tmp/h.json   # the smoke run

Sides: `horovod` (the example with its import line switched to `horovod.torch`; where Horovod is not installed the side
is left out, said so in the JSON, and collsync's bsp is the reference instead), and collsync's `bsp`, `backup` (b = 1,
margin "auto"), `async`, `psp`, `ssp`, `specsync` (and, asked for by name, ssp's variants: `ssp-stream`, never holding
out for the fresh version, `patience=None`; `ssp-own`, reading its own writes, `stream=False`), each with `--workers`
workers (the server modes launch one rank more, the server). Scenarios (examples/mnist.py `--straggle`): `none`;
`heavy`, 10% of batches 0.2 s longer; `slow`, the last worker computing 3x as long; and, asked for by name, `slow-host`:
no injected delay, the ranks across the cluster in one box (scripts/cluster.py; `bash scripts/cluster_up.sh` first) with
the last worker alone on node2, whose link gets the `slow-host` model (5 ms each way) for the scenario: straggling made
by the network, on every side alike; and `shared-core`: no injected delay, the last worker's process held to
`--core-share` of one core (a CPU quota in its own cgroup, `cpu.cfs_quota_us` or `cpu.max`; root only), as a worker
whose core is shared with a busy neighbour: its real forward and backward passes take longer, not a sleep; and
`busy-host`: both at once across the box, every host's link the `1gbe` model and node2's processes held to
`--core-share` of one core (`scripts/cluster.py cpu`), as a host on a 1 Gbit/s network slowed by a CPU-bound
neighbour (issue 33, item 5). Every batch
sleeps `--compute` seconds besides (a larger model's compute, so that 3x means something), and the delays come from a
generator seeded by the repeat and the worker: the same on every side. The runs are interleaved (repeat r runs every
scenario and side before repeat r + 1), each launch is timed by the script itself from the start of training, and the
load average is recorded before each.

Reported per scenario and side: the final accuracy (the workers' mean test accuracy at the end) as median and
range; the time to the reference's own final accuracy (the median of the reference's final accuracies in that
scenario), from worker 0's test accuracy after each epoch (the first epoch at or above it; a run that never gets
there counts as not reaching it), as median and range over the runs that reached it; and the ratio of the
reference's median time to it (> 1: sooner than Horovod). One JSON (`--out`) holds every run and the summary; the
markdown table for benchmarks/README.md is printed (and written to `--table`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# scripts/cluster.py (a script, not a package): the box's state and the cpu cgroups, shared-core's too.
_spec = importlib.util.spec_from_file_location("cluster", ROOT / "scripts" / "cluster.py")
assert _spec is not None and _spec.loader is not None
CLUSTER = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(CLUSTER)

EXAMPLE = ROOT / "examples" / "mnist.py"
BIN = Path(sys.executable).parent
SIDES = ["horovod", "bsp", "backup", "async", "psp", "ssp", "ssp-stream", "ssp-own", "specsync"]
SERVER_SIDES = {"async", "psp", "ssp", "ssp-stream", "ssp-own", "specsync"}
# ssp's variants only when asked for by name: ssp-stream never holds out for the fresh version (patience=None),
# ssp-own reads its own writes (stream=False); plain ssp is its default (streaming, patience 0.5).
SSP_VARIANTS = {"ssp-stream": "eager", "ssp-own": "off"}
DEFAULT_SIDES = [s for s in SIDES if s not in SSP_VARIANTS]
SCENARIOS = ["none", "heavy", "slow"]
NAMED = ["slow-host", "shared-core", "busy-host"]  # run only when asked for by name (each needs root)
BOXED = {"slow-host", "busy-host"}  # across the cluster in one box
CGROUP = "collsync-shared-core"  # the cgroup the shared-core worker runs in (made and removed by this script)
BOX = Path(os.environ.get("COLLSYNC_CLUSTER_DIR", "/tmp/collsync-cluster"))  # scripts/cluster.py's folder
SLOW_HOST = "node2"
IMPORT = "import collsync.torch as hvd  # was: import horovod.torch as hvd"
EPOCH = re.compile(r"epoch (\d+)/\d+: loss \S+, test accuracy ([0-9.]+) at ([0-9.]+) s")
FINAL = re.compile(r"test accuracy: ([0-9.]+)")
DROPPED = re.compile(r"gradients dropped: (\d+)")
CAUGHT_UP = re.compile(r"rounds caught up: (\d+)")
BATCHES = re.compile(r"batches per worker: ([0-9, ]+) in ([0-9.]+) s")


def have_horovod() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True)
    return probe.returncode == 0


def horovod_script(folder: Path) -> Path:
    """examples/mnist.py with its import line switched to Horovod, as a user would switch it."""
    source = EXAMPLE.read_text()
    if IMPORT not in source:
        raise SystemExit(f"horovod_stragglers: {EXAMPLE} has no line {IMPORT!r} to switch")
    script = folder / "mnist_horovod.py"
    script.write_text(source.replace(IMPORT, "import horovod.torch as hvd"))
    return script


def launch(side: str, scenario: str, repeat: int, args: argparse.Namespace, horovod: Path | None) -> dict[str, Any]:
    """One run of the example; its epochs (seconds, worker 0's accuracy), final accuracy and drops."""
    ranks = args.workers + (1 if side in SERVER_SIDES else 0)
    script = horovod if side == "horovod" else EXAMPLE
    sync = "bsp" if side == "horovod" else "ssp" if side in SSP_VARIANTS else side
    straggle = "none" if scenario in NAMED else scenario
    command = [
        sys.executable,
        str(script),
        "--sync",
        sync,
        "--epochs",
        str(args.epochs),
        "--compute",
        str(args.compute),
    ]
    command += ["--straggle", straggle, "--model", args.model, "--every-epoch", "--seed", str(repeat)]
    command += ["--data", args.data] + (["--limit", str(args.limit)] if args.limit else [])
    command += ["--stream", SSP_VARIANTS[side]] if side in SSP_VARIANTS else []
    argv = [str(BIN / "mpiexec"), "-n", str(ranks), *command]
    if scenario in BOXED:
        argv = [str(BOX / "bin" / "mpiexec"), "-hosts", box_hosts(ranks), *argv[1:]]
    if scenario == "shared-core":  # MPMD: the last rank (the last worker) joins the quota's cgroup, then runs
        join = f'echo $$ > {cgroup_procs()} && exec "$@"'
        argv = [str(BIN / "mpiexec"), "-n", str(ranks - 1), *command, ":", "-n", "1", "sh", "-c", join, "sh", *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    run: dict[str, Any] = {"side": side, "scenario": scenario, "repeat": repeat, "load_before": os.getloadavg()}
    held = throttled() if scenario == "busy-host" else None
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**run, "ok": False, "error": f"no end within {args.timeout} s"}
    run["wall_s"] = time.monotonic() - start
    if held is not None:  # the seconds node2's processes were stopped by their CPU quota: whether the hold bit
        run["throttled_s"] = throttled() - held
    final = FINAL.findall(proc.stdout)
    if proc.returncode != 0 or not final:
        return {**run, "ok": False, "error": (proc.stderr or proc.stdout)[-600:]}
    epochs = [(float(t), float(a)) for _, a, t in EPOCH.findall(proc.stdout)]
    dropped, caught_up = DROPPED.findall(proc.stdout), CAUGHT_UP.findall(proc.stdout)
    batches = BATCHES.findall(proc.stdout)
    return {
        **run,
        "ok": True,
        "epochs": epochs,
        "final": float(final[-1]),
        "dropped": int(dropped[-1]) if dropped else 0,
        "caught_up": int(caught_up[-1]) if caught_up else 0,
        # Each worker's steps and the seconds of the training loop (worker 0's clock): the per-worker rates.
        "batches": [int(b) for b in batches[-1][0].split(",")] if batches else None,
        "loop_s": float(batches[-1][1]) if batches else None,
    }


def box_hosts(ranks: int) -> str:
    """The box's hosts for `ranks` ranks: the last one alone on the slow host, the others over node0 and node1
    (MPICH fills the hosts in order, so the last rank, the last worker, is the one on node2)."""
    first = ranks // 2
    return f"node0:{first},node1:{ranks - 1 - first},{SLOW_HOST}:1"


def cluster(*args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "cluster.py"), *args], check=True)


def box(scenario: str, on: bool, share: float) -> None:
    """The box's state for a boxed scenario (or, `on` False, every link and CPU as `cluster_up.sh` left them):
    slow-host, the `slow-host` link model on node2's link; busy-host, every host's link `1gbe` and node2's processes
    held to `share` of one core."""
    made = BOX / "cluster.json"
    if on and not made.is_file():
        raise SystemExit(f"horovod_stragglers: {scenario} needs the cluster in one box (bash scripts/cluster_up.sh)")
    if scenario == "slow-host":
        cluster("link", SLOW_HOST, "slow-host" if on else "none")
        return
    hosts = json.loads(made.read_text())["hosts"] if made.is_file() else [SLOW_HOST]
    for host in hosts:
        cluster("link", host, "1gbe" if on else "none")
    cluster("cpu", SLOW_HOST, str(share) if on else "none")


def throttled() -> float:
    """Seconds node2's cgroup (`scripts/cluster.py cpu`) has spent throttled by its quota so far."""
    group = CLUSTER.cpu_controller()[0] / CLUSTER.cpu_group(SLOW_HOST)
    stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return int(stat["throttled_time"]) / 1e9 if "throttled_time" in stat else int(stat["throttled_usec"]) / 1e6


def cgroup_procs() -> Path:
    return CLUSTER.cpu_controller()[0] / CGROUP / "cgroup.procs"


def shared_core(share: float | None) -> None:
    """Make the shared-core cgroup holding its processes to `share` of one core (None: remove it)."""
    CLUSTER.hold(CGROUP, share)


def time_to(epochs: list[list[float]], target: float) -> float | None:
    """Seconds to the first epoch whose accuracy is at least `target` (None: never)."""
    return next((t for t, a in epochs if a >= target - 1e-9), None)


def spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarise(runs: list[dict[str, Any]], reference: str) -> dict[str, Any]:
    """Per scenario and side: final accuracy, time to the reference's median final accuracy, ratios."""
    out: dict[str, Any] = {}
    for scenario in sorted({r["scenario"] for r in runs}, key=[*SCENARIOS, *NAMED].index):
        ok = [r for r in runs if r["scenario"] == scenario and r["ok"]]
        ref = [r["final"] for r in ok if r["side"] == reference]
        target = statistics.median(ref) if ref else None
        rows: dict[str, Any] = {}
        for side in [s for s in SIDES if any(r["side"] == s for r in ok)]:
            mine = [r for r in ok if r["side"] == side]
            times = [t for r in mine if target is not None and (t := time_to(r["epochs"], target)) is not None]
            rows[side] = {
                "runs": len(mine),
                "final": spread([r["final"] for r in mine]),
                "reached": len(times),
                "time_to_target": spread(times),
                "dropped": spread([float(r["dropped"]) for r in mine]) if side == "backup" else None,
                "caught_up": spread([float(r.get("caught_up", 0)) for r in mine]) if side == "backup" else None,
                "failed": len([r for r in runs if r["scenario"] == scenario and r["side"] == side and not r["ok"]]),
            }
        base = rows.get(reference, {}).get("time_to_target")
        for row in rows.values():
            here = row["time_to_target"]
            row["sooner_than_reference"] = base["median"] / here["median"] if base and here else None
            row["final_minus_reference"] = row["final"]["median"] - target if target is not None else None
        out[scenario] = {"target": target, "sides": rows}
    return out


def target_label(target: float | None) -> str:
    """How a scenario's target is named in the table and the figure ("no target" where the reference never ended)."""
    return "no target" if target is None else f"target {target:.3f}"


def table(summary: dict[str, Any], reference: str) -> str:
    """The markdown table for benchmarks/README.md."""
    lines = [
        f"| scenario | side | time to {reference}'s final accuracy, s (median, range; runs reaching it) | x sooner "
        f"than {reference} | final accuracy (median, range) | vs {reference}, points |",
        "|---|---|---|---:|---|---:|",
    ]
    for scenario, block in summary.items():
        target = target_label(block["target"])
        for side, row in block["sides"].items():
            t, f = row["time_to_target"], row["final"]
            when = f"{t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f})" if t else "never"
            sooner = f"{row['sooner_than_reference']:.2f}" if row["sooner_than_reference"] else "-"
            points = row["final_minus_reference"]
            lines.append(
                f"| {scenario} ({target}) | {side} | {when}; {row['reached']}/{row['runs']} | "
                f"{sooner} | {f['median']:.3f} ({f['min']:.3f}-{f['max']:.3f}) | "
                + ("-" if points is None else f"{100 * points:+.1f}")
                + " |"
            )
    return "\n".join(lines)


def figure(result: dict[str, Any], path: Path) -> None:
    """Worker 0's test accuracy against seconds since training began, a panel per scenario and a line per side: at
    each epoch the median over the repeats of its time and of its accuracy. The dashed line is the target (the
    reference's median final accuracy): a line that crosses it further left got there sooner."""
    import matplotlib  # lazy: only a run that asks for a figure pays for matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["ok"]]
    scenarios = list(result["summary"])
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.4 * len(scenarios), 3.8), squeeze=False, sharey=True)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        block = result["summary"][scenario]
        for side in block["sides"]:
            curves = [r["epochs"] for r in runs if r["scenario"] == scenario and r["side"] == side]
            length = min(len(c) for c in curves)
            times = [statistics.median(c[e][0] for c in curves) for e in range(length)]
            accuracy = [statistics.median(c[e][1] for c in curves) for e in range(length)]
            reference = side == result["reference"]
            style = {"color": "black", "linewidth": 2.2} if reference else {"linewidth": 1.4}
            ax.plot(times, accuracy, marker="o", markersize=3, label=side, **style)
        if block["target"] is not None:  # None: the reference side has no run that ended
            ax.axhline(block["target"], linestyle="--", color="grey", linewidth=1)
        ax.set_title(f"{scenario} ({target_label(block['target'])})")
        ax.set_xlabel("seconds since training began (median)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("worker 0's test accuracy (median)")
    targets = [b["target"] for b in result["summary"].values() if b["target"] is not None]
    axes[0][0].set_ylim(bottom=min(targets) - 0.1 if targets else None)  # digits near 0.95, Fashion-MNIST near 0.85
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(result: dict[str, Any], shown: str, args: argparse.Namespace) -> None:
    """Write a measurement where the command line asks: the JSON (`--out`), the table (`--table`), the figure
    (`--plot`)."""
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.table:
        args.table.write_text(shown + "\n")
    if args.plot:
        figure(result, args.plot)


def merge(paths: list[Path], args: argparse.Namespace) -> None:
    """One summary of the runs of several saved measurements: each (scenario, side, repeat) once (a later file's run
    replaces an earlier one's), under the first file's reference; the files must agree on what was measured."""
    saved = [json.loads(p.read_text()) for p in paths]
    keys = ("epochs", "workers", "model", "compute", "data", "limit", "core_share")
    first = saved[0]
    for path, other in zip(paths[1:], saved[1:], strict=True):
        differ = [k for k in keys if other["config"].get(k) != first["config"].get(k)]
        if differ or other["reference"] != first["reference"]:
            raise SystemExit(f"horovod_stragglers: {path} measured something else ({', '.join(differ) or 'reference'})")
    runs = {(r["scenario"], r["side"], r["repeat"]): r for one in saved for r in one["runs"]}
    merged = sorted(runs.values(), key=lambda r: (r["repeat"], r["scenario"], r["side"]))
    summary = summarise(merged, first["reference"])
    shown = table(summary, first["reference"])
    print(shown, flush=True)
    sides = list(dict.fromkeys(side for one in saved for side in one["config"]["sides"]))
    scenarios = list(dict.fromkeys(sc for one in saved for sc in one["config"]["scenarios"]))
    result = {
        **first,
        "command": "; ".join(one["command"] for one in saved),
        "merged": [str(p) for p in paths],
        "config": {**first["config"], "sides": sides, "scenarios": scenarios, "repeats": len({r[2] for r in runs})},
        "summary": summary,
        "runs": merged,
    }
    save(result, shown, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--first-repeat", type=int, default=0, help="the first repeat (its seed): more repeats of a saved measurement"
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp", help="examples/mnist.py's --model")
    parser.add_argument("--compute", type=float, default=0.01, help="seconds slept per batch on every worker")
    parser.add_argument("--scenarios", nargs="+", choices=[*SCENARIOS, *NAMED], default=SCENARIOS)
    parser.add_argument("--data", choices=["digits", "fashion"], default="digits", help="examples/mnist.py's --data")
    parser.add_argument("--limit", type=int, default=None, help="examples/mnist.py's --limit (training/test images)")
    parser.add_argument(
        "--core-share",
        type=float,
        default=0.25,
        help="shared-core and busy-host: the share of one core the last worker (busy-host: its host) gets",
    )
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=DEFAULT_SIDES)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take")
    parser.add_argument(
        "--tiny", action="store_true", help="smoke run: 1 repeat, 1 epoch, 2 workers, heavy, horovod and backup"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--plot", type=Path, default=None, help="also draw accuracy against time here (PNG)")
    parser.add_argument(
        "--replot", type=Path, default=None, help="draw a saved --out JSON (to --plot, or beside it) and stop"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="saved --out JSONs of one measurement (e.g. repeats 0-2 and, with --first-repeat 3, 3-4): summarise "
        "their runs together (to --out, --table, --plot) and stop",
    )
    args = parser.parse_args()
    for path in (args.out, args.table, args.plot):  # before the launches, not after them
        if path is not None and not path.parent.is_dir():
            raise SystemExit(f"horovod_stragglers: {path}: its folder {path.parent} does not exist")
    if args.replot:
        figure(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return
    if args.merge:
        merge(args.merge, args)
        return
    if args.tiny:
        args.repeats, args.epochs, args.workers, args.scenarios = 1, 1, 2, ["heavy"]
        args.sides = [s for s in args.sides if s in ("horovod", "backup")] + ([] if have_horovod() else ["bsp"])
    sides = list(args.sides)
    missing = "horovod" in sides and not have_horovod()
    if missing:
        sides.remove("horovod")
    reference = "horovod" if "horovod" in sides else "bsp"
    if reference not in sides:
        raise SystemExit(
            f"horovod_stragglers: no reference side among --sides {' '.join(sides)}: add horovod (or bsp where "
            "Horovod is not installed); every time and accuracy is measured against it in the same run"
            + (" (Horovod is not installed here)" if missing else "")
        )
    runs = []
    if not 0 < args.core_share <= 1:
        raise SystemExit(f"horovod_stragglers: --core-share {args.core_share}: must be in (0, 1]")
    for scenario in BOXED & set(args.scenarios):  # one at a time, around its launches (below)
        box(scenario, False, args.core_share)
    if "shared-core" in args.scenarios:
        shared_core(args.core_share)
    try:
        with tempfile.TemporaryDirectory() as folder:
            horovod = horovod_script(Path(folder)) if "horovod" in sides else None
            for repeat in range(args.first_repeat, args.first_repeat + args.repeats):
                for scenario in args.scenarios:
                    if scenario in BOXED:
                        box(scenario, True, args.core_share)
                    for side in sides:
                        run = launch(side, scenario, repeat, args, horovod)
                        runs.append(run)
                        said = f"final {run['final']:.3f}" if run["ok"] else f"FAILED: {run['error'][-200:]}"
                        print(f"repeat {repeat} {scenario} {side}: {said}", flush=True)
                    if scenario in BOXED:
                        box(scenario, False, args.core_share)
    finally:  # the link model and the cgroup are the machine's, not the run's: never left behind
        for scenario in BOXED & set(args.scenarios):
            box(scenario, False, args.core_share)
        if "shared-core" in args.scenarios:
            shared_core(None)
    summary = summarise(runs, reference)
    shown = table(summary, reference)
    print(shown, flush=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "table", "plot", "replot")}
    result = {
        "command": "python benchmarks/horovod_stragglers.py " + " ".join(sys.argv[1:]),
        "config": {**config, "sides": sides},
        "reference": reference,
        "horovod_missing": missing,
        "load_before": runs[0]["load_before"] if runs else None,
        "summary": summary,
        "runs": runs,
    }
    save(result, shown, args)
    if not all(r["ok"] for r in runs):
        raise SystemExit(f"horovod_stragglers: {sum(not r['ok'] for r in runs)} run(s) failed (see the JSON)")


if __name__ == "__main__":
    main()
