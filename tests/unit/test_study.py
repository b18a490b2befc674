"""benchmarks/study.py: the longer recipe studies keep 001_... App. C.4's schedule at its fractions of the run
(lr x 0.1 at 50% and 75%, warm-up over 3%) and their override sets compose into a valid config."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from hydra import compose, initialize_config_dir

from collsync import schema
from collsync.cli import CONF_DIR
from collsync.cli import __file__ as cli_file


def _study() -> ModuleType:
    path = Path(cli_file).resolve().parent.parent / "benchmarks" / "study.py"
    spec = importlib.util.spec_from_file_location("study", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["study"] = module
    spec.loader.exec_module(module)
    return module


def test_long_penalty_sweeps_scale_the_schedule_with_the_run() -> None:
    study = _study()
    sweeps = study._recipe_penalty_long_sweeps(1600, "gamma_heterogeneous", "4,48", ("0.1",))
    ga = next(s for s in sweeps if "method=ga" in s)
    # One job of the multirun: the first value of each swept key.
    job = [o if "=[" in o else o.split(",")[0] for o in ga]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=job)
    schema.check(cfg)
    assert cfg.steps == 1600 and list(cfg.optimizer.milestones) == [800, 1200] and cfg.warmup_updates == 48
    assert cfg.penalty.weight_decay == 0.0005 and cfg.optimizer.weight_decay == 0  # App. C.5
    assert cfg.stragglers._target_.endswith("gamma_heterogeneous") and cfg.runtime.workers == 4
    # The single-worker baseline comes first, at C.4's lr, and every other pass names one lr.
    assert "runtime.workers=1" in sweeps[0] and "optimizer.lr=0.1" in sweeps[0]
    assert all(sum(o.startswith("optimizer.lr=") for o in s) == 1 for s in sweeps)
