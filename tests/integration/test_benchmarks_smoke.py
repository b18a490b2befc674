"""Every benchmark of `benchmarks/run_all.py` at its tiny size, so that none of them rots.

No timing is asserted (speed lives in benchmarks/ as ratios against a baseline in the same run); each benchmark
checks its own sides against its baseline (same parameters, every gradient counted) and exits non-zero otherwise,
and here the JSON it writes is checked for what it must hold. The list is `run_all.py`'s own, so a benchmark added
there is smoke-tested here (and fails until `_check` knows it). Not repeated here: `vs_peers`, which
test_torch_launch.py runs at tiny size (`test_vs_peers_benchmark_runs_at_tiny_size`), and the soak, whose driver
tests/mpi/test_soak.py runs at CI size; and the two benchmarks in `TOO_SLOW` (see there).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
assert _spec is not None and _spec.loader is not None
run_all = importlib.util.module_from_spec(_spec)
sys.modules["run_all"] = run_all  # its dataclasses look their module up there
_spec.loader.exec_module(run_all)

COVERED_ELSEWHERE = {"vs_peers_n2", "mpi_soak"}  # the tests named in the docstring run them at tiny size
# Three collsync-train launches each (about 20 s of CPU even at 4 steps): over the smoke run's budget of 60 s.
# `python benchmarks/run_all.py --tiny --only mpi_stragglers mpi_psp` runs them.
TOO_SLOW = {"mpi_stragglers", "mpi_psp"}


def _check(name: str, data: dict[str, Any]) -> None:
    """What each benchmark's JSON must hold after a correct tiny run."""
    if name == "sim_overhead":
        assert data["gradients"] > 0 and data["ratio"] > 0
    elif name == "mpi_pushpull":
        assert data["bytes"] > 0 and data["pull_ratio"] > 0 and data["push_ratio"] > 0
    elif name.startswith("mpi_fullsync"):
        for row in data["sizes"].values():
            assert set(row["ratio_to_loop"]) == {"loop", "thread", "poll", "plain", "blocking"}
            assert max(row["max_param_diff"].values()) <= 1e-4
    elif name == "mpi_partial_allreduce":
        assert set(data["median_ms"]) == {
            "allreduce",
            "allreduce_torch",
            "partial_n",
            "partial_n_alloc",
            "partial_n_minus_1",
            "partial_n_minus_1_counted",
            "partial_n_minus_1_host",
        }
        assert data["max_abs_diff"] <= 1e-5  # the partial mean is the allreduce mean (checked in the run too)
        # Round trips counted per round: a full quorum is one Allreduce (no one-sided call), n - 1 goes through the
        # windows and messages, on either protocol (each rank's own count, gathered).
        rma, n = data["rma_per_round"], data["ranks"]
        for side in (f"quorum {n - 1}", f"quorum {n - 1}, host-summed"):
            assert len(rma[side]["per_rank"]) == n
            assert rma[side]["max_protocol_round_trips"] > 0 == rma[f"quorum {n}"]["max_round_trips"]
    elif name == "mpi_rounds":
        # Every policy's workers (2 at -n 3) counted: a few round trips a round (4, and the first read and the last
        # spread over a few rounds; tests/mpi asserts the protocol's own count).
        assert set(data["per_round"]) == {"bsp", "ssp", "psp"}
        for row in data["per_round"].values():
            assert len(row["protocol_round_trips"]) == 2 and all(0 < x <= 12 for x in row["protocol_round_trips"])
    elif name == "mpi_shards_scaling":
        rows = data["servers"]
        assert set(rows) == {"1", "2"}
        target = int(data["command"].split("--updates ")[1].split()[0])
        assert all(row["updates"] == target for row in rows.values())
    elif name == "mpi_stragglers":
        assert data["bsp"]["updates"] > 1 and data["async"]["updates"] > 1
    elif name == "mpi_psp":
        rows = [v for v in data.values() if isinstance(v, dict)]
        assert len(rows) == 3 and all(0.0 <= r["final_acc"] <= 1.0 for r in rows)
    elif name == "horovod_stragglers":
        assert all(run["ok"] for run in data["runs"]) and len(data["runs"]) == 2
        block = data["summary"]["heavy"]
        assert set(block["sides"]) == {data["reference"], "backup"} and 0.0 < block["target"] <= 1.0
        assert all(0.0 <= row["final"]["median"] <= 1.0 for row in block["sides"].values())
        for run in data["runs"]:  # each worker's steps and the loop's seconds, from the example's last line
            assert len(run["batches"]) == 2 and all(b > 0 for b in run["batches"]) and run["loop_s"] > 0, run
    elif name.startswith("torch_stragglers"):
        assert "bsp" in data["modes"] and len(data["modes"]) >= 2
    else:
        raise AssertionError(f"no check for benchmark {name}: add one here")


SMOKED = [b for b in run_all.BENCHES if b.tiny is not None and b.name not in COVERED_ELSEWHERE | TOO_SLOW]


@pytest.mark.parametrize("bench", SMOKED, ids=[b.name for b in SMOKED])
def test_benchmark_runs_at_tiny_size(tmp_path: Path, bench: Any) -> None:
    out = tmp_path / f"{bench.name}.json"
    ok, _, tail = run_all.run(bench, tiny=True, out=out)
    assert ok, tail
    _check(bench.name, json.loads(out.read_text()))


def test_the_readme_table_is_written_from_the_jsons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{run_all.BEGIN}\nold\n{run_all.END}\nafter\n")
    monkeypatch.setattr(run_all, "README", readme)
    (tmp_path / "sim_overhead.json").write_text(json.dumps({"command": "python sim.py", "ratio": 1.234}))
    run_all.write_table(tmp_path)
    text = readme.read_text()
    assert "old" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    assert "| simulator overhead | `python sim.py` |" in text and "1.23 (`results/sim_overhead.json`)" in text


def test_horovod_stragglers_draws_a_saved_run(tmp_path: Path) -> None:
    """`--replot` draws a committed result (accuracy against time, a panel per scenario) without launching."""
    saved = ROOT / "benchmarks" / "results" / "horovod_stragglers_ssp.json"
    png = tmp_path / "ssp.png"
    argv = [sys.executable, str(ROOT / "benchmarks" / "horovod_stragglers.py"), "--replot", str(saved)]
    proc = subprocess.run([*argv, "--plot", str(png)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_horovod_stragglers_table_keeps_a_scenario_without_a_target() -> None:
    """A scenario whose reference never finished has no target: its rows say so instead of failing the table."""
    spec = importlib.util.spec_from_file_location("horovod_stragglers", ROOT / "benchmarks" / "horovod_stragglers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    final = {"median": 0.9, "min": 0.9, "max": 0.9}
    row = {"time_to_target": None, "final": final, "reached": 0, "runs": 1}
    row |= {"sooner_than_reference": None, "final_minus_reference": None}
    text = module.table({"none": {"target": None, "sides": {"backup": row}}}, "horovod")
    assert "| none (no target) | backup | never; 0/1 | - | 0.900 (0.900-0.900) | - |" in text


def test_horovod_stragglers_merges_more_repeats_of_a_saved_measurement(tmp_path: Path) -> None:
    """`--merge`: the runs of two saved measurements summarised together, each (scenario, side, repeat) once; files
    that measured something else are refused."""

    def saved(repeats: range, finals: dict[str, float], epochs: int = 3) -> dict[str, Any]:
        runs = [
            {"side": side, "scenario": "none", "repeat": r, "ok": True, "epochs": [[10.0 + r, final]], "final": final}
            for r in repeats
            for side, final in finals.items()
        ]
        config = {"epochs": epochs, "workers": 4, "model": "cnn", "compute": 0.01, "data": "fashion", "limit": None}
        config |= {"core_share": 0.25, "sides": list(finals), "scenarios": ["none"]}
        return {"command": "c", "config": config, "reference": "horovod", "runs": runs}

    first, more, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps(saved(range(3), {"horovod": 0.8, "ssp": 0.9})))
    more.write_text(json.dumps(saved(range(2, 5), {"horovod": 0.8, "ssp": 0.7})))  # repeat 2 measured again
    other.write_text(json.dumps(saved(range(3, 5), {"horovod": 0.8}, epochs=8)))
    script = [sys.executable, str(ROOT / "benchmarks" / "horovod_stragglers.py"), "--merge"]
    out = tmp_path / "m.json"
    proc = subprocess.run([*script, str(first), str(more), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = json.loads(out.read_text())
    ssp = merged["summary"]["none"]["sides"]["ssp"]
    assert len(merged["runs"]) == 10 and ssp["runs"] == 5 and merged["config"]["repeats"] == 5
    assert ssp["final"] == {"median": 0.7, "min": 0.7, "max": 0.9}  # repeats 0-1 at 0.9, 2-4 (the later file) 0.7
    refused = subprocess.run([*script, str(first), str(other)], capture_output=True, text=True)
    assert refused.returncode != 0 and "measured something else (epochs)" in refused.stderr


def test_horovod_stragglers_refuses_sides_without_a_reference_before_launching() -> None:
    """Every ratio is against Horovod (or bsp) in the same run: sides without either are refused at once, naming
    what to add, instead of launching and failing at the summary."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "horovod_stragglers.py"), "--sides", "specsync", "ssp"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "no reference side among --sides specsync ssp: add horovod (or bsp" in proc.stderr, proc.stderr[-2000:]
