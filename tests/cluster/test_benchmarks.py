"""benchmarks/between_hosts.py's smoke run: the push/pull and partial allreduce benchmarks across two hosts with a
link model on, each row naming the model that was in force, and every link left without a model after."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cluster.box import ENV, ROOT, cluster


def test_between_hosts_smoke(box, tmp_path):
    out = tmp_path / "between.json"
    cmd = [sys.executable, "benchmarks/between_hosts.py", "--tiny", "--only", "pushpull", "partial", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["benchmark"] for r in rows] == ["pushpull", "partial"]
    for row in rows:
        assert row["ok"] and row["link"] == "10gbe" and "rate 10gbit" in row["in_force"], row
        assert row["result"]["command"], row  # the benchmark's own JSON, kept whole
    assert "pull" in rows[0]["figures"] and "quorum n" in rows[1]["figures"]
    status = cluster("status").stdout
    assert "tbf" not in status and "netem" not in status, status  # the models taken off again
