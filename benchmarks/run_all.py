"""Every benchmark in one command: one JSON per benchmark, and the Speed table of benchmarks/README.md from them.

    python benchmarks/run_all.py                          # everything at full size (about an hour on 2 cores)
    python benchmarks/run_all.py --only mpi_fullsync_n2 vs_peers_n2   # some of them
    python benchmarks/run_all.py --table                  # only re-write the README table from the JSONs there are
    python benchmarks/run_all.py --tiny --out /tmp/smoke  # the CI smoke run: every benchmark at tiny size

Each benchmark measures its figure as a ratio against a baseline in the same run (sides alternated rep by rep),
and checks its own correctness (the same parameters as the baseline, every gradient counted); a benchmark that fails
fails the whole command (the others still run, the failures are listed at the end). `--tiny` runs each at the
smallest size that still goes through every side (a smoke run: its timings mean nothing, the table is not touched).
Full-size JSONs go to benchmarks/results/<name>.json; the table lists each with the command that produced it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
README = HERE / "README.md"
BEGIN, END = "<!-- run_all: begin -->", "<!-- run_all: end -->"


def _mpi(ranks: int, script: str, *args: str) -> list[str]:
    return [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, str(HERE / script), *args]


def _py(script: str, *args: str) -> list[str]:
    return [sys.executable, str(HERE / script), *args]


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def _fullsync(d: dict[str, Any]) -> str:
    parts = []
    for size, row in d["sizes"].items():
        r = row["ratio_to_loop"]
        parts.append(f"{size}: thread {_f(r['thread'])}, poll {_f(r['poll'])}, plain {_f(r['plain'])}")
    return "; ".join(parts)


def _peers(d: dict[str, Any]) -> str:
    parts = []
    for size, row in d["sizes"].items():
        r = row["ratio_to_loop"]
        sides = ", ".join(f"{k} {_f(v)}" for k, v in r.items() if k != "loop")
        parts.append(f"{size}: {sides}")
    return "; ".join(parts)


def _shards(d: dict[str, Any]) -> str:
    rows = d["servers"]
    return "; ".join(
        f"M={m}: {_f(r['updates_per_s_vs_1'])}x updates/s (one core per rank, modelled: {_f(r['modelled_vs_1'])}x)"
        for m, r in rows.items()
    )


def _stragglers(d: dict[str, Any]) -> str:
    backups = [k for k in d if k.startswith("backup")]
    out = [f"bsp {_f(d['bsp']['real_over_ideal'])} of ideal"]
    out += [f"{k} {_f(d[k]['speedup_over_bsp'])}x bsp (ideal {_f(d[k]['ideal_speedup_over_bsp'])}x)" for k in backups]
    out.append(f"async {_f(d['async']['updates_per_s_over_bsp'])}x bsp's updates/s")
    return "; ".join(out)


def _psp(d: dict[str, Any]) -> str:
    keys = [k for k in d if isinstance(d[k], dict) and "time_saved" in d[k]]
    return "; ".join(f"{k}: {100 * d[k]['time_saved']:.0f}% saved, acc {100 * d[k]['final_acc']:.1f}%" for k in keys)


def _torch_stragglers(d: dict[str, Any]) -> str:
    return "; ".join(f"{k} {_f(v['updates_vs_bsp'])}x bsp's updates/s" for k, v in d["modes"].items() if k != "bsp")


def _horovod_stragglers(d: dict[str, Any]) -> str:
    """Per scenario: the collsync side soonest to the reference's final accuracy, and the worst final accuracy."""
    parts = []
    for scenario, block in d["summary"].items():
        rows = {k: v for k, v in block["sides"].items() if k != d["reference"]}
        timed = {k: v["sooner_than_reference"] for k, v in rows.items() if v["sooner_than_reference"]}
        best = max(timed, key=lambda k: timed[k]) if timed else None
        worst = min(rows, key=lambda k: rows[k]["final_minus_reference"]) if rows else None
        soonest = f"{best} {_f(timed[best])}x sooner" if best else "none reached it"
        lowest = f"{worst} {100 * rows[worst]['final_minus_reference']:+.1f} points" if worst else ""
        parts.append(f"{scenario}: {soonest}, lowest final {lowest}")
    return "; ".join(parts)


def _partial(d: dict[str, Any]) -> str:
    r = d["ratio_to_allreduce"]
    fresh = f" (a new mean tensor each round: {_f(r['partial_n_alloc'])})" if "partial_n_alloc" in r else ""
    by_hand = f"; `Allreduce` by hand on a torch buffer: {_f(r['allreduce_torch'])}" if "allreduce_torch" in r else ""
    return f"quorum n: {_f(r['partial_n'])}{fresh}, quorum n - 1: {_f(r['partial_n_minus_1'])}{by_hand}"


def _rounds(d: dict[str, Any]) -> str:
    """Round trips a round per worker (the protocol's own, then the polls'), per policy."""
    rows = d["per_round"]
    return "; ".join(
        f"{name}: {', '.join(_f(x) for x in row['protocol_round_trips'])} round trips a round"
        f" + {', '.join(_f(x) for x in row['poll_round_trips'])} polling"
        for name, row in rows.items()
    )


def _soak(d: dict[str, Any]) -> str:
    return f"{d.get('pushes_per_s', 0):.0f} pushes/s, replay equal: {d.get('replay_equal', d.get('passed'))}"


@dataclass
class Bench:
    name: str
    what: str
    baseline: str
    full: list[str]
    tiny: list[str] | None  # None: the smoke run of another entry runs the same script
    summary: Callable[[dict[str, Any]], str]
    target: str = "(none set)"
    out_flag: str = "--out"
    env: dict[str, str] = field(default_factory=dict)


BENCHES = [
    Bench(
        "sim_overhead",
        "simulator overhead",
        "a plain loop computing the same gradients and momentum steps",
        _py("sim_overhead.py"),
        _py("sim_overhead.py", "--steps", "20", "--repeats", "1", "--workers", "2"),
        lambda d: _f(d["ratio"]),
        "<= 1.15",
    ),
    Bench(
        "mpi_pushpull",
        "MPI mailbox pull / push, 4 MiB, 2 ranks",
        "raw `MPI_Get` / `MPI_Put` + `Flush` of the same buffer, alternated rep by rep",
        _mpi(2, "mpi_pushpull.py", "--reps", "500"),
        _mpi(2, "mpi_pushpull.py", "--reps", "3", "--numel", "4096"),
        lambda d: f"pull {_f(d['pull_ratio'])}, push {_f(d['push_ratio'])}",
        ">= 0.8",
    ),
    *[
        Bench(
            f"mpi_fullsync_n{n}",
            f"serverless BSP step (`runtime=allreduce`), {n} ranks",
            "the same gradients + one blocking mpi4py `Allreduce` + SGD",
            _mpi(n, "mpi_fullsync.py", "--repeats", "5" if n == 2 else "3"),
            _mpi(2, "mpi_fullsync.py", "--tiny") if n == 2 else None,
            _fullsync,
            "<= 1.10",
        )
        for n in (2, 4)
    ],
    *[
        Bench(
            f"vs_peers_n{n}",
            f"`collsync.torch` bsp and its peers, {n} ranks",
            "backward + one mpi4py `Allreduce` of the flat gradient + SGD by hand",
            _mpi(n, "vs_peers.py", "--reps", "7" if n == 2 else "5"),
            _mpi(2, "vs_peers.py", "--tiny") if n == 2 else None,
            _peers,
            "bsp <= 1.05 at 100k, <= Horovod at 5M",
        )
        for n in (2, 4)
    ],
    Bench(
        "mpi_partial_allreduce",
        "k-of-n partial allreduce (windows), 1M float32, 4 ranks",
        "mpi4py `Allreduce` in place + the division by n, the order shuffled rep by rep",
        _mpi(4, "mpi_partial_allreduce.py", "--reps", "200"),
        _mpi(2, "mpi_partial_allreduce.py", "--reps", "2", "--numel", "1024"),
        _partial,
        "quorum n <= 1.10",
    ),
    Bench(
        "mpi_rounds",
        "round trips of a worker's bsp, ssp and psp round through the servers' windows, 1 server + 3 workers",
        "(counts: 7.1-9.1 a round before issue 33's item 3)",
        _mpi(4, "mpi_rounds.py"),
        _mpi(3, "mpi_rounds.py", "--steps", "6", "--numel", "1024", "--compute", "1", "--repeats", "1"),
        _rounds,
        "4 a round",
    ),
    Bench(
        "mpi_shards_scaling",
        "async updates/s with M = 1, 2, 4 server shards, 5M parameters, 4 workers",
        "M = 1 in the same run",
        _py("mpi_shards_scaling.py"),
        _py("mpi_shards_scaling.py", "--tiny"),
        _shards,
        "grows with M",
    ),
    Bench(
        "mpi_stragglers",
        "backup workers over MPI, injected gamma stragglers, 1 server + 4 workers",
        "the ideal round time (order statistic of the injected times)",
        _py("mpi_stragglers.py"),
        _py("mpi_stragglers.py", "--ranks", "3", "--steps", "4", "--time-scale", "0.001"),
        _stragglers,
    ),
    Bench(
        "mpi_psp",
        "PSP-SGD over MPI: 2 shards (one slow) + 4 gamma workers",
        "naive sync (c = n, b = 100%)",
        _py("mpi_psp.py"),
        _py("mpi_psp.py", "--workers", "2", "--steps", "4", "--time-scale", "0.001"),
        _psp,
    ),
    Bench(
        "torch_stragglers_servers",
        "`collsync.torch` modes under injected stragglers, 1 server + 4 workers",
        "bsp on the server",
        _mpi(5, "torch_stragglers.py"),
        _mpi(3, "torch_stragglers.py", "--steps", "3", "--scale", "0.001"),
        _torch_stragglers,
    ),
    Bench(
        "torch_stragglers_serverless",
        "`collsync.torch` backup (b=1) vs bsp under injected stragglers, 4 workers",
        "bsp (allreduce)",
        _mpi(4, "torch_stragglers.py", "--serverless"),
        _mpi(2, "torch_stragglers.py", "--serverless", "--steps", "3", "--scale", "0.001"),
        _torch_stragglers,
    ),
    Bench(
        "horovod_stragglers",
        "examples/mnist.py (digits, 4 workers) with injected stragglers: time to Horovod's final accuracy, "
        "final accuracy (benchmarks/README.md, Horovod's own script)",
        "Horovod (`horovod.torch`), the same script and delays",
        _py("horovod_stragglers.py"),
        _py("horovod_stragglers.py", "--tiny"),
        _horovod_stragglers,
        ">= 1.5x sooner (heavy, slow), >= 1.0x (none), every final within 1 point",
    ),
    Bench(
        "mpi_soak",
        "asynchronous parameter server soak, 3 workers, random delays",
        "a replay of the accepted gradients (bitwise the server's parameters)",
        _mpi(4, "mpi_soak.py", "--pushes", "20000", "--numel", "1000000"),
        _mpi(3, "mpi_soak.py", "--pushes", "40", "--numel", "1000"),
        _soak,
        "passes",
    ),
]


def run(bench: Bench, tiny: bool, out: Path) -> tuple[bool, float, str]:
    """Run one benchmark, its JSON to `out`; (ok, seconds, last lines of its output)."""
    argv = [*((bench.tiny or []) if tiny else bench.full), bench.out_flag, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **bench.env}
    start, cpu = time.monotonic(), _children_cpu()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
    return proc.returncode == 0 and out.exists(), took, f"CPU {_children_cpu() - cpu:.1f} s\n{tail}"


def _children_cpu() -> float:
    """CPU seconds (user + system) of finished child processes: a smoke run's cost that the machine's load does not
    change much, unlike its wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def table(results: Path) -> str:
    """The README's Speed table from the JSONs in `results` (rows without a JSON are left out)."""
    rows = [
        "| what | command | baseline | result (ratio to the baseline, same run) | target |",
        "|---|---|---|---|---|",
    ]
    for b in BENCHES:
        path = results / f"{b.name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        shown = [f"benchmarks/{Path(a).name}" if a.endswith(".py") else Path(a).name if "/" in a else a for a in b.full]
        command = data.get("command") or " ".join(shown)
        load = data.get("load_before")
        when = f"; load {load[0]:.1f} before" if load else ""
        try:
            figures = b.summary(data)
        except (KeyError, TypeError):
            figures = "written by an older version of the script: re-run it"
        result = f"{figures} (`results/{b.name}.json`{when})"
        rows.append(f"| {b.what} | `{command}` | {b.baseline} | {result} | {b.target} |")
    return "\n".join(rows)


def write_table(results: Path) -> None:
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"run_all: {README} has no {BEGIN} ... {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{BEGIN}\n{table(results)}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="every benchmark at its smallest size (CI smoke run)")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHES], help="these benchmarks only")
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSONs (default benchmarks/results)")
    parser.add_argument("--table", action="store_true", help="only re-write the README table from the JSONs")
    args = parser.parse_args()
    out = args.out or HERE / "results"
    if args.table:
        write_table(out)
        return
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for bench in BENCHES:
        if (args.only and bench.name not in args.only) or (args.tiny and bench.tiny is None):
            continue
        ok, took, tail = run(bench, args.tiny, out / f"{bench.name}.json")
        cpu, _, tail = tail.partition("\n")
        print(f"{bench.name}: {'ok' if ok else 'FAILED'} in {took:.1f} s ({cpu})", flush=True)
        if not ok:
            failed.append(bench.name)
            print(tail, flush=True)
    if not args.tiny and args.out is None:
        write_table(out)
    if failed:
        raise SystemExit(f"run_all: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
