"""`collsync-train` as a user runs it: a subprocess per run, reading the run folder it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TRAIN = [sys.executable, "-c", "from collsync.cli import train; train()"]
FAST = ["steps=40", "eval_every=20", "runtime.workers=4", "progress=false"]


def run_train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    args = [*TRAIN, f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def test_default_run_writes_its_folder(tmp_path):
    proc = run_train(tmp_path, *FAST, "plots=true")  # the default, said here: tests/run.sh sets COLLSYNC_PLOTS=false
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    for name in ("trace.jsonl", "metrics.csv", "summary.json", "params.pt", ".hydra/config.yaml"):
        assert (run / name).is_file(), name
    assert list(run.glob("*.png")), "no plots written"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trace_checks"]["updates"] == 40
    assert summary["trace_checks"]["pushed"] == summary["trace_checks"]["applied"] + summary["trace_checks"]["dropped"]
    assert "acc" in proc.stdout.lower()
    cost = summary["sim_cost"]  # the simulator's own wall time, evaluation (aside) left out
    assert cost["wall_s"] > 0 and cost["aside_wall_s"] > 0
    assert abs(cost["per_update_ms"] - 1e3 * cost["wall_s"] / 40) < 1e-6 * cost["per_update_ms"]
    assert cost["per_gradient_ms"] < cost["per_update_ms"]  # rounds of 4 workers: several gradients an update
    assert "ms wall per update" in proc.stdout


def test_fashion_mnist_trains_from_the_debian_package(tmp_path, monkeypatch):
    """`data=fashion_mnist` at its default path, a few steps (CI installs the package: scripts/setup.sh). Where it is
    missing this fails with the run's one line, which says how to install it. The decompressed files are cached in
    the user cache, for the next run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    proc = run_train(tmp_path, "data=fashion_mnist", "steps=20", "eval_every=10", "runtime.workers=4", "progress=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trace_checks"]["updates"] == 20
    assert summary["final_acc"] >= 0.4, summary["final_acc"]  # 10 classes: 0.1 by chance; 0.62 measured
    records = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "xdg" / "collsync").glob("*.json"))
    assert records == sorted(
        ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    )


# Bad values answered in one line: tests/integration/test_bad_inputs.py (one row per case).


# A local multirun sweep (`-m sync=bsp,async ...`), a run folder and summary per job: test_report_cli.py.


def test_version_is_collsyncs():
    import collsync

    proc = subprocess.run([*TRAIN, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"collsync {collsync.__version__}"
    assert collsync.__version__ not in ("", "0+unknown")


def test_divergence_stops_with_one_line_and_keeps_the_run(tmp_path):
    proc = run_train(tmp_path, *FAST, "optimizer.lr=1e6")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "guard: the test loss is" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["incomplete"].startswith("guard:") and (tmp_path / "run" / "params.pt").is_file()


def test_guard_off_trains_on_through_divergence(tmp_path):
    proc = run_train(tmp_path, *FAST, "optimizer.lr=1e6", "guard=off")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "incomplete" not in json.loads((tmp_path / "run" / "summary.json").read_text())
