"""Several `collsync-train` runs in one MPI launch, one after another, each in a run folder of its own.

    mpiexec -n 4 python -m mpi4py tests/scripts/train_runs.py RUNS.json

RUNS.json maps a run folder to the overrides of its run: {"/tmp/x/allreduce/run": ["runtime=allreduce", ...], ...}.
Every rank composes each config as `collsync-train` does (the package's conf/, the same overrides) and runs it
through the entry point's own `execute` (schema check, run folder probe, `collsync.train.run`), so a run here
writes what `collsync-train OVERRIDES hydra.run.dir=FOLDER` writes (but Hydra's own .hydra/ files and log). One
launch instead of one per run: each rank imports torch, Hydra and the runtimes once (a few CPU-seconds per rank and
launch), and `collsync.train` re-opens the MPI runtime per run (as a Hydra sweep run in one process does).
`python -m mpi4py` aborts the whole world on an exception in any rank, so a failing run ends the launch at once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from collsync.cli import CONF_DIR, execute


def main() -> None:
    runs: dict[str, list[str]] = json.loads(Path(sys.argv[1]).read_text())
    for folder, overrides in runs.items():
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose("config", overrides=["progress=false", *overrides])
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        execute(cfg, out)


if __name__ == "__main__":
    main()
