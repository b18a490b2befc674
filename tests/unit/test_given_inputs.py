"""Issue 36's inputs that were taken without a word: command-line combinations (`schema.check_overrides`), a
checkpoint past `steps`, a finished run folder under `resume=auto`, mistyped labels, straggler times that overflow,
a `runtime.workers` the launch contradicts and injected delays past the deadline."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from collsync import checkpoint, rundir, schema
from collsync.data import npz, synthetic
from collsync.datacheck import MAX_CLASSES, too_many_classes
from collsync.runs.parts import Parts, _check_injected
from collsync.runs.resume import resumed
from collsync.stragglers import gamma_heterogeneous, none
from collsync.train import _check_given_workers


def test_given_reads_the_last_value_typed_with_or_without_plus() -> None:
    overrides = ["sync=psp", "+sync.pushes=3", "steps=4", "++sync.pushes=5"]
    assert schema.given(overrides, "sync.pushes") == "5"
    assert schema.given(overrides, "sync.push_fraction") is None
    assert schema.given(["hydra.run.dir="], "hydra.run.dir") == ""


def test_pushes_and_push_fraction_are_not_both_given() -> None:
    with pytest.raises(schema.ConfigError, match=r"^sync.pushes=3 and sync.push_fraction=0.5 both set psp's quorum"):
        schema.check_overrides(["sync=psp", "sync.pushes=3", "sync.push_fraction=0.5"])
    assert schema.check_overrides(["sync=psp", "sync.pushes=3"]) == []
    assert schema.check_overrides(["sync=psp", "sync.pushes=3", "sync.push_fraction=null"]) == []


def test_an_option_that_replaces_the_methods_own_is_named() -> None:
    assert schema.check_overrides(["method=dana", "optimizer=adam"]) == [
        "method=dana sets optimizer=dana, and optimizer=adam on the command line replaces it: this run trains "
        "optimizer=adam"
    ]
    (warning,) = schema.check_overrides(["method=sa", "optimizer=nesterov"])  # the study's SA with NAG
    assert warning.startswith("method=sa sets optimizer=momentum, and optimizer=nesterov")
    (warning,) = schema.check_overrides(["method=dana", "penalty=gap_aware"])
    assert warning.startswith("method=dana sets penalty=none, and penalty=gap_aware")
    assert schema.check_overrides(["method=dana", "optimizer=dana", "penalty=none"]) == []
    assert schema.check_overrides(["optimizer=adam"]) == []


def test_an_empty_resume_is_refused() -> None:
    with pytest.raises(schema.ConfigError, match=r"^resume='' is empty: pass resume=auto"):
        schema.RunConfig(resume="")


def test_a_checkpoint_past_steps_is_refused_naming_both(tmp_path: Path) -> None:
    config = {"steps": 10, "seed": 0}
    checkpoint.save({"config": config, "version": 40}, tmp_path / checkpoint.NAME)
    kept = checkpoint.Keeper(config, tmp_path, None, None, str(tmp_path))
    with pytest.raises(ValueError, match=r"is at server step 40, already past steps=10: pass steps > 40"):
        kept.resumed()
    at_the_end = checkpoint.Keeper({**config, "steps": 40}, tmp_path, None, None, str(tmp_path))
    assert at_the_end.resumed() is not None


def test_a_finished_run_folder_is_found_only_under_resume_auto(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"updates": 60}))
    assert rundir.finished(tmp_path, "auto", 60) == {"updates": 60}
    with pytest.raises(ValueError, match=r"holds a finished run of 60 updates and no checkpoint to go on from, so "):
        rundir.finished(tmp_path, "auto", 61)  # more steps, no checkpoint: a fresh start would overwrite the run
    (tmp_path / checkpoint.NAME).write_bytes(b"")
    assert rundir.finished(tmp_path, "auto", 61) is None  # more steps: go on from the checkpoint
    assert rundir.finished(tmp_path, None, 60) is None
    assert rundir.finished(tmp_path, str(tmp_path), 60) is None
    (tmp_path / "summary.json").write_text(json.dumps({"updates": 60, "incomplete": "stopped by SIGTERM"}))
    assert rundir.finished(tmp_path, "auto", 60) is None
    assert rundir.finished(tmp_path / "nothing-here", "auto", 60) is None


def test_a_label_far_above_the_others_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    y = np.arange(60) % 10
    arrays = {"x_train": rng.random((60, 4)), "x_test": rng.random((10, 4)), "y_test": np.arange(10)}
    np.savez(tmp_path / "typo.npz", **arrays, y_train=np.where(np.arange(60) == 17, 100000, y))
    with pytest.raises(ValueError, match=r"y_train row 17 holds label 100000, which makes 100001 classes of which it"):
        npz(str(tmp_path / "typo.npz"))
    np.savez(tmp_path / "gap.npz", **arrays, y_train=np.where(y == 3, 12, y))  # a few classes unseen: accepted
    assert npz(str(tmp_path / "gap.npz")).classes == 13


def test_more_classes_than_rows_or_the_bound_are_refused(tmp_path: Path) -> None:
    """Issue 36: the classes the labels make are bounded by the training rows and by `MAX_CLASSES`."""
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.random((6, 2)), "x_test": rng.random((2, 2)), "y_test": np.arange(2)}
    np.savez(tmp_path / "rows.npz", **arrays, y_train=np.array([0, 1, 2, 3, 4, 9]))  # 10 classes, 6 rows
    with pytest.raises(ValueError, match=r"row 5 holds label 9, which makes 10 classes, more than its 6 rows \("):
        npz(str(tmp_path / "rows.npz"))
    assert too_many_classes(MAX_CLASSES + 1, MAX_CLASSES, 2 * MAX_CLASSES).startswith("100001 classes, more than")
    assert too_many_classes(MAX_CLASSES, MAX_CLASSES, MAX_CLASSES) == ""
    with pytest.raises(ValueError, match=r"^synthetic: classes=100001 must be <= 100000"):
        synthetic(classes=MAX_CLASSES + 1)


def test_straggler_times_that_would_overflow_the_clock_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^stragglers: mean=1e\+308 must be <= 1e\+09 seconds"):
        none(mean=1e308)
    with pytest.raises(ValueError, match=r"^stragglers: v_mach=1e\+200 must be in \[1e-06, 100\]"):
        gamma_heterogeneous(v_mach=1e200)
    assert max(gamma_heterogeneous(mean=1e9, v_mach=100).sampler(16, 0).machine_means) < float("inf")


def test_a_runtime_workers_the_launch_contradicts_is_refused() -> None:
    _check_given_workers(2, 3, 2)
    with pytest.raises(ValueError, match=r"^runtime.workers=7 does not fit the launch: 3 ranks give 2 worker"):
        _check_given_workers(7, 3, 2)
    with pytest.raises(ValueError, match=r"runtime.workers=-1 .*: pass runtime.workers=2 or leave it out$"):
        _check_given_workers(-1, 3, 2)


def _parts(time_scale: float, mean: float, deadline: float | None) -> Parts:
    fake: Any = SimpleNamespace(
        runtime=SimpleNamespace(time_scale=time_scale),
        stragglers=none(mean=mean),
        policy=SimpleNamespace(deadline=deadline),
    )
    return cast(Parts, fake)


def test_an_injected_delay_past_the_deadline_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^runtime.time_scale=1e\+06 x stragglers.mean=1 s injects 1e\+06 s per"):
        _check_injected(_parts(1e6, 1.0, 600.0))
    _check_injected(_parts(0.01, 1.0, 600.0))
    _check_injected(_parts(1e6, 1.0, None))  # no deadline: waits as long as it takes, as asked


@pytest.mark.parametrize(
    ("driver", "kind", "refused"),
    [
        (
            {"now": 1.0},
            "mpi",
            "written by the simulator (simulated seconds), and this run is an MPI run (wall seconds)",
        ),
        ({}, "sim", "written by an MPI run (wall seconds), and this run is the simulator (simulated seconds)"),
        ({"now": 1.0}, "sim", ""),
        ({}, "mpi", ""),
        ({}, "partial", ""),
    ],
)
def test_resume_across_runtimes_is_refused_naming_both(driver: dict[str, Any], kind: str, refused: str) -> None:
    """Issue 36: a simulator's checkpoint resumed under MPI mixed simulated and wall seconds in one summary; an MPI
    checkpoint resumed in the simulator ended in KeyError 'workers'. Each is refused naming both runtimes."""
    saved = {"version": 3, "driver": driver}
    kept = SimpleNamespace(resumed=lambda: saved, source=Path("run") / "checkpoint.pt")
    parts = cast(Parts, SimpleNamespace(runtime=SimpleNamespace(kind=kind)))
    if not refused:
        assert resumed(cast(checkpoint.Keeper, kept), parts) is saved
        return
    with pytest.raises(ValueError, match=r"^resume: run/checkpoint.pt was ") as caught:
        resumed(cast(checkpoint.Keeper, kept), parts)
    assert refused in str(caught.value)
