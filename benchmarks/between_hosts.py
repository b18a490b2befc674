"""The MPI benchmarks again between hosts: the cluster in one box (scripts/cluster.py), each link model in turn.

    bash scripts/cluster_up.sh
    .venv/bin/python benchmarks/between_hosts.py                         # 10gbe and 1gbe, every benchmark
    .venv/bin/python benchmarks/between_hosts.py --links 1gbe --only pushpull peers
    .venv/bin/python benchmarks/between_hosts.py --tiny --out /tmp/b.json  # the smoke run

Every benchmark below already measures collsync against a raw MPI (or Horovod) baseline in the same run, its sides
alternated rep by rep; here each runs with its ranks spread over the box's hosts (MPICH's `mpiexec` through
DIR/bin/mpiexec, so ranks on different hosts talk over TCP through the bridge, not through shared memory) after
`scripts/cluster.py link <host> <model>` put the link model on every host's link:

* `pushpull`: benchmarks/mpi_pushpull.py, 2 ranks on node0 and node1: the mailbox's pull and push of 4 MiB
  against raw `MPI_Get` / `MPI_Put` + `Flush` on the same windows;
* `partial`: benchmarks/mpi_partial_allreduce.py, 4 ranks (node0:2, node1:2): the k-of-n partial allreduce at
  quorum n and n - 1 (the direct exchange and the host-summed path) against `Allreduce`, 1M float32;
* `fullsync`: benchmarks/mpi_fullsync.py, 4 ranks (node0:2, node1:2): `runtime=allreduce`'s step against a
  hand-written loop with one blocking `Allreduce`, 100k and 5M parameters;
* `peers`: benchmarks/vs_peers.py, 4 ranks (node0:2, node1:2): `collsync.torch` bsp and backup, Horovod and DDP
  against backward + one `Allreduce` by hand, 100k and 5M parameters;
* `psp`: benchmarks/mpi_psp.py `--hosts node0:2,node1:2,node2:2`: PSP-SGD's partial push and pull against naive
  sync, its two shards on node0 and its 4 workers on node1 and node2 (it launches its own runs).

On a kernel without netem the presets are their rate alone (tbf): delays under 1 ms are not made (see
scripts/cluster.py), and the row says which model was in force. Two cores run every rank and the link's forwarding:
the figures are ratios within one run, never absolute speeds. One JSON (`--out`) holds every row (the link model,
the command, the benchmark's own JSON) and the markdown table is printed (and written to `--table`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BOX = Path(os.environ.get("COLLSYNC_CLUSTER_DIR", "/tmp/collsync-cluster"))  # scripts/cluster.py's folder
LINKS = ["10gbe", "1gbe"]


def _f(x: float) -> str:
    return f"{x:.2f}"


def _pushpull(d: dict[str, Any]) -> str:
    said = f"pull {_f(d['pull_ratio'])}, push {_f(d['push_ratio'])} of the raw Get / Put's speed"
    rma = d.get("rma_per_op", {})
    trips = ", ".join(f"{k} {_f(v['round_trips'] - v['waits'])} + {_f(v['waits'])} polls" for k, v in rma.items())
    return said + (f"; round trips: {trips}" if trips else "")


def _partial(d: dict[str, Any]) -> str:
    r = d["ratio_to_allreduce"]
    said = f"quorum n {_f(r['partial_n'])}, quorum n - 1 {_f(r['partial_n_minus_1'])} of `Allreduce`'s time"
    if "partial_n_minus_1_host" in r:
        said += f" (host-summed: {_f(r['partial_n_minus_1_host'])})"
    for side in ("", ", host-summed"):
        rma = d.get("rma_per_round", {}).get(f"quorum {d['ranks'] - 1}{side}")
        if rma:  # the protocol's own round trips per round (the most of any rank), and the polls that waited
            polls = max(m["waits"] for m in rma["per_rank"])
            said += (
                f"; quorum n - 1{side}: {_f(rma['max_protocol_round_trips'])} round trips + up to {_f(polls)} polls"
                " a rank"
            )
    return said


def _psp(d: dict[str, Any]) -> str:
    keys = [k for k in d if isinstance(d[k], dict) and "time_saved" in d[k]]
    return "; ".join(f"{k}: {100 * d[k]['time_saved']:.0f}% saved, acc {100 * d[k]['final_acc']:.1f}%" for k in keys)


def _per_size(d: dict[str, Any], keys: list[str]) -> str:
    parts = []
    for size, row in d["sizes"].items():
        r = row["ratio_to_loop"]
        parts.append(f"{size}: " + ", ".join(f"{k} {_f(r[k])}" for k in keys if k in r))
    return "; ".join(parts) + " of the loop's time"


# name: (hosts, script, full-size arguments, tiny arguments, the row's figures, the target)
BENCHES: dict[str, tuple[str, str, list[str], list[str], Callable[[dict[str, Any]], str], str]] = {
    "pushpull": (
        "node0:1,node1:1",
        "mpi_pushpull.py",
        ["--numel", str(1 << 20), "--reps", "100"],
        ["--numel", "4096", "--reps", "3"],
        _pushpull,
        ">= 0.8",
    ),
    "partial": (
        "node0:2,node1:2",
        "mpi_partial_allreduce.py",
        ["--numel", str(1 << 20), "--reps", "60"],
        ["--numel", "1024", "--reps", "2"],
        _partial,
        "quorum n <= 1.25 (>= 0.8 of its speed)",
    ),
    "fullsync": (
        "node0:2,node1:2",
        "mpi_fullsync.py",
        ["--repeats", "3", "--steps", "20"],
        ["--tiny"],
        lambda d: _per_size(d, ["thread", "poll", "plain", "blocking"]),
        "thread <= 1.25",
    ),
    "peers": (
        "node0:2,node1:2",
        "vs_peers.py",
        ["--reps", "3", "--steps", "20"],
        ["--tiny"],
        lambda d: _per_size(d, ["collsync", "backup", "horovod", "ddp"]),
        "collsync <= 1.25, <= horovod",
    ),
    # Launches its own runs (collsync-train, 2 shards on node0, 4 workers on node1 and node2) with --hosts.
    "psp": (
        "node0:2,node1:2,node2:2",
        "mpi_psp.py",
        ["--workers", "4", "--steps", "300"],
        ["--workers", "2", "--steps", "4", "--time-scale", "0.001"],
        _psp,
        "(none set: time saved against naive sync, across hosts)",
    ),
}
SELF_LAUNCHED = {"psp"}


def link(model: str) -> str:
    """Put `model` on every host's link; what is in force, as scripts/cluster.py said it (for the table)."""
    hosts = json.loads((BOX / "cluster.json").read_text())["hosts"]
    said = []
    for host in hosts:
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "cluster.py"), "link", host, model],
            capture_output=True,
            text=True,
            check=True,
        )
        said = done.stdout.strip().splitlines()
    shown = said[-1].split("link: ", 1)[-1] if said else model
    return shown + ("; its delay left out (no netem, under 1 ms)" if any("left out" in s for s in said) else "")


def run_one(name: str, model: str, tiny: bool, folder: Path, timeout: float) -> dict[str, Any]:
    hosts, script, full, small, figures, target = BENCHES[name]
    ranks = sum(int(h.split(":")[1]) for h in hosts.split(","))
    out = folder / f"{name}-{model}.json"
    if name in SELF_LAUNCHED:
        hosts = hosts if not tiny else "node0:2,node1:1,node2:1"
        argv = [sys.executable, str(HERE / script), "--hosts", hosts]
    else:
        argv = [str(BOX / "bin" / "mpiexec"), "-hosts", hosts, "-n", str(ranks), sys.executable, str(HERE / script)]
    argv += [*(small if tiny else full), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    row: dict[str, Any] = {"benchmark": name, "link": model, "hosts": hosts, "target": target}
    shown = " ".join(small if tiny else full)
    if name in SELF_LAUNCHED:
        row["command"] = f"python benchmarks/{script} --hosts {hosts} {shown}"
    else:
        row["command"] = f"DIR/bin/mpiexec -hosts {hosts} -n {ranks} python benchmarks/{script} {shown}"
    row["load_before"] = os.getloadavg()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "ok": False, "error": f"no end within {timeout:g} s"}
    if proc.returncode != 0 or not out.is_file():
        return {**row, "ok": False, "error": (proc.stderr or proc.stdout)[-800:]}
    data = json.loads(out.read_text())
    return {**row, "ok": True, "figures": figures(data), "result": data}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| link | what | command | result (ratio to the baseline, same run) | target |", "|---|---|---|---|---|"]
    for r in rows:
        result = r["figures"] if r["ok"] else f"FAILED: {r['error'].splitlines()[-1] if r['error'] else ''}"
        load = f"; load {r['load_before'][0]:.1f} before"
        lines.append(f"| {r['in_force']} | {r['benchmark']} | `{r['command']}` | {result}{load} | {r['target']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", nargs="+", default=LINKS, help="link presets or specs (scripts/cluster.py)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    parser.add_argument("--tiny", action="store_true", help="each benchmark at its smallest size, one link model")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one benchmark may take")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "between_hosts.json")
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args()
    if not (BOX / "cluster.json").is_file():
        raise SystemExit("between_hosts: needs the cluster in one box (bash scripts/cluster_up.sh)")
    links = args.links[:1] if args.tiny else args.links
    rows = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            for model in links:
                in_force = link(model)
                for name in args.only:
                    row = run_one(name, model, args.tiny, Path(folder), args.timeout)
                    row["in_force"] = in_force
                    rows.append(row)
                    print(f"{model} {name}: {row['figures'] if row['ok'] else 'FAILED'}", flush=True)
    finally:
        link("none")
    shown = table(rows)
    print(shown, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/between_hosts.py " + " ".join(sys.argv[1:])
    args.out.write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    if args.table:
        args.table.write_text(shown + "\n")
    failed = [f"{r['link']} {r['benchmark']}" for r in rows if not r["ok"]]
    if failed:
        raise SystemExit(f"between_hosts: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
