"""Checkpoints and exact resume in the simulator (in-process), and what a checkpoint refuses.

A run that writes a checkpoint every k updates is the uninterrupted run (checkpointing changes nothing); resumed
from its last checkpoint, with the same config, it must end bit for bit where the uninterrupted run ended:
parameters, EMA and the trace (but for the one `resume` event that marks where it went on).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from collsync import checkpoint
from collsync.cli import CONF_DIR
from collsync.train import run

SMALL = [
    "data=synthetic",
    "data.samples=600",
    "model.hidden=[16]",
    "runtime.workers=4",
    "progress=false",
    "eval_every=10",
]


def config(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[*SMALL, *overrides])


def events(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "trace.jsonl").open()]


def finished(folder: Path) -> dict:
    return torch.load(folder / "params.pt", weights_only=False)


# case: (overrides, k): each stopped at another multiple of its k, so the resumed state varies from case to case.
CASES = {
    "backup": (["sync=backup"], 10),
    # The adaptive margin's estimate and each worker's start time are the simulator's to restore; a fixed margin's
    # collection timeouts are events; catch-up's batch index follows the restored round.
    "backup_auto": (["sync=backup", "stragglers=gamma_heterogeneous"], 13),
    "backup_fixed": (["sync=backup", "stragglers=gamma_heterogeneous", "runtime.margin=0.3"], 10),
    "async": (["sync=async", "optimizer=sgd"], 23),
    "ssp": (["sync=ssp", "stragglers=gamma_homogeneous"], 13),
    "psp_timeout": (["sync=psp", "sync.timeout=0.3"], 10),
    "bfasgd": (["sync=bfasgd", "optimizer=fasgd"], 23),  # workers' coin flips: their random streams are restored
    "dana_ga": (["sync=async", "method=dana_ga"], 13),  # nested rule states, per-worker momenta, a look-ahead view
    "slow_server": (["sync=backup", "stragglers=slow_server"], 23),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_bitwise_equal_to_the_uninterrupted_run(case: str, tmp_path: Path) -> None:
    overrides, k = CASES[case]
    steps = 47
    plain = run(config(*overrides, f"steps={steps}", "checkpoint.seconds=null"), tmp_path / "plain")
    reference = finished(tmp_path / "plain")
    first = tmp_path / "checkpointed"
    run(config(*overrides, f"steps={steps}", f"checkpoint.every={k}"), first)
    assert torch.equal(finished(first)["params"], reference["params"]), "checkpointing changed the run"
    saved = torch.load(first / checkpoint.NAME, weights_only=True)
    assert saved["version"] == (steps - 1) // k * k
    again = tmp_path / "resumed"
    result = run(config(*overrides, f"steps={steps}", f"resume={first}"), again)
    got = finished(again)
    assert torch.equal(got["params"], reference["params"]), f"{case}: resumed at {saved['version']} differs"
    assert torch.equal(got["ema"], reference["ema"])
    assert [e["version"] for e in events(again) if e["ev"] == "resume"] == [saved["version"]]
    assert [e for e in events(again) if e["ev"] != "resume"] == events(tmp_path / "plain")
    assert result["final_acc"] == plain["final_acc"]


def test_a_signal_checkpoints_and_the_run_goes_on_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM between two updates (here: asked for at update 19) writes the checkpoint and the run folder, marked
    incomplete, and ends with Preempted (exit status 143 from the CLI); resumed, the run ends as if never stopped."""
    from collsync.evaluate import Evaluator

    steps = 40
    run(config("sync=backup", f"steps={steps}"), tmp_path / "plain")
    original = Evaluator.__call__

    def call(self, server) -> None:
        original(self, server)
        if server.version == 19:
            checkpoint.request(signal.SIGTERM)

    monkeypatch.setattr(Evaluator, "__call__", call)
    try:
        with pytest.raises(checkpoint.Preempted) as stopped:
            run(config("sync=backup", f"steps={steps}"), tmp_path / "stopped")
    finally:
        checkpoint.clear()
    monkeypatch.undo()
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM at server step 19" in str(stopped.value)
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    assert summary["incomplete"].startswith("stopped by SIGTERM")
    assert torch.load(tmp_path / "stopped" / checkpoint.NAME, weights_only=True)["version"] == 19
    run(config("sync=backup", f"steps={steps}", "resume=auto"), tmp_path / "stopped")
    assert torch.equal(finished(tmp_path / "stopped")["params"], finished(tmp_path / "plain")["params"])


def test_resume_refuses_a_different_config_naming_the_key(tmp_path: Path) -> None:
    run(config("sync=backup", "steps=20", "checkpoint.every=10"), tmp_path / "a")
    with pytest.raises(ValueError, match=r"different config: sync\.backups=1 there, 2 here"):
        run(config("sync=backup", "sync.backups=2", "steps=20", f"resume={tmp_path / 'a'}"), tmp_path / "b")
    with pytest.raises(ValueError, match=r"different config: optimizer\.lr"):
        run(config("sync=backup", "optimizer.lr=0.5", "steps=20", f"resume={tmp_path / 'a'}"), tmp_path / "b")


def test_resume_refuses_a_missing_or_damaged_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        run(config("steps=5", f"resume={tmp_path / 'nowhere'}"), tmp_path / "a")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / checkpoint.NAME).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a readable collsync checkpoint"):
        run(config("steps=5", f"resume={bad}"), tmp_path / "b")
    # A pickle that would run code is refused by weights_only loading, never executed.
    torch.save({"format": checkpoint.FORMAT, "evil": print}, bad / checkpoint.NAME)
    with pytest.raises(ValueError, match="is not a readable collsync checkpoint"):
        run(config("steps=5", f"resume={bad}"), tmp_path / "c")


def test_resume_auto_starts_afresh_without_a_checkpoint(tmp_path: Path) -> None:
    result = run(config("steps=12", "resume=auto"), tmp_path / "a")
    assert result["updates"] == 12
    assert not [e for e in events(tmp_path / "a") if e["ev"] == "resume"]


def test_checkpoint_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half way (a killed rank, a full disk) leaves the previous checkpoint whole and no
    temporary file behind."""
    path = tmp_path / checkpoint.NAME
    checkpoint.save({"version": 1, "x": torch.arange(3)}, path)

    def broken(obj, f, *args, **kwargs) -> None:
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError):
        checkpoint.save({"version": 2, "x": torch.arange(4)}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["version"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.NAME]


def test_schedule_counts_updates_and_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: clock[0])
    by_count = checkpoint.Schedule(every=5, seconds=None)
    assert [v for v in range(1, 12) if by_count.due(v) and (by_count.written(v) or True)] == [5, 10]
    by_time = checkpoint.Schedule(every=None, seconds=10.0)
    assert not by_time.due(1)
    clock[0] += 10.0
    assert by_time.due(2)
    for every in (0, "abc", 2.5, True):
        with pytest.raises(ValueError, match=f"checkpoint.every={every!r} must be a whole number >= 1"):
            checkpoint.Schedule(every=every, seconds=None)
    for seconds in (0, -1.0, "soon"):
        with pytest.raises(ValueError, match=f"checkpoint.seconds={seconds!r} must be a number > 0"):
            checkpoint.Schedule(every=None, seconds=seconds)
