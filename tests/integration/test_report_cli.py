"""`collsync-train -m` then `collsync-report` on its sweep folder, as a user runs them: subprocesses, run folders."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

TRAIN = [sys.executable, "-c", "from collsync.cli import train; train()"]
REPORT = [sys.executable, "-c", "import sys; from collsync.report import main; sys.exit(main())"]
ENV = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")}


def test_sweep_then_report_on_the_sweep_folder(tmp_path):
    sweep = tmp_path / "multirun" / "sweep"
    train = subprocess.run(
        [*TRAIN, "-m", f"hydra.sweep.dir={sweep}", "steps=20", "eval_every=10", "runtime.workers=2"]
        + ["progress=false", "sync=bsp,async", "seed=0,1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=tmp_path,
    )
    assert train.returncode == 0, train.stderr
    assert (sweep / "multirun.yaml").is_file()
    assert len(list(sweep.glob("*/summary.json"))) == 4  # one run folder per job of the sweep, no more
    for job in range(4):
        log = (sweep / str(job) / "collsync.log").read_text()  # the run's own log lines, not an empty file
        assert "accuracy     theta" in log and "simulated" in log and f"run folder: {sweep / str(job)}" in log
        assert json.loads((sweep / str(job) / "summary.json").read_text())["clock"] == "simulated"
    report = subprocess.run([*REPORT, str(sweep)], capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert re.search(rf"^sync=async seed=1 +{re.escape(str(sweep / '3'))}$", report.stdout, flags=re.M)  # label, folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"]  # nothing written in the current folder
    with open(sweep / "report" / "table.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [(r["group"], r["seeds"], r["clock"]) for r in table] == [
        ("sync=bsp", "2", "simulated"),
        ("sync=async", "2", "simulated"),
    ]
    assert "| runs | seeds | time to 0.5 (simulated s) |" in (sweep / "report" / "table.md").read_text()
