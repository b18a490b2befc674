"""Config fuzzing (issue 36) of two things a single run never meets: resuming a checkpoint that the other kind of
runtime wrote, and the members of a sweep.

* Cross-resume: random overrides (`test_fuzz_config.overrides`) given to a run of one kind of runtime that resumes
  a checkpoint of the other kind (a simulator's under MPI runtimes, an MPI run's in the simulator) never train and
  never end in a traceback: each is refused in one line, the cross-runtime check or one before it. The MPI side runs
  in-process up to the launch (as `test_fuzz_config` does), where the resume check that follows the launch is
  called in its place.
* Sweep members: `collsync-train -m KEY=a,b,c` with random values of a random key (Hydra's basic launcher, in-process):
  a member whose config is refused is named in one line (`sweep member j (...)`) before any member trains, and none
  does; otherwise every member trains or is named (it failed while training) without stopping the ones after it;
  the exit status is 2 when any was named.

Derandomized and bounded like `test_fuzz_config` (`COLLSYNC_FUZZ_CROSS_EXAMPLES`, `COLLSYNC_FUZZ_SWEEP_EXAMPLES`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import collsync.cli
from collsync.cli import execute
from collsync.runs.parts import Parts
from collsync.runs.resume import keeper, resumed
from collsync.runtime import spec
from tests.unit.test_fuzz_config import (
    EXAMPLE_LIMIT_S,
    SEED,
    Launched,
    check_one_line,
    compose_with_choices,
    composed_choices,
    fuzz_example,
    overrides,
    value_for,
)

CROSS_EXAMPLES = int(os.environ.get("COLLSYNC_FUZZ_CROSS_EXAMPLES", "8"))
SWEEP_EXAMPLES = int(os.environ.get("COLLSYNC_FUZZ_SWEEP_EXAMPLES", "2"))
MPI_RUNTIMES = ["mpi", "allreduce", "partial"]
BOTH = ("the simulator (simulated seconds)", "an MPI run (wall seconds)")
SETTINGS: dict[str, Any] = {
    "deadline": None,
    "derandomize": SEED is None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "phases": [Phase.explicit, Phase.reuse, Phase.generate],
}


def _resume_at_the_launch(parts: Parts, flat: Any, out_dir: Path, overrides: Any) -> None:
    """In place of `train._run_mpi`: rank 0's resume check, which an MPI run makes right after its launch."""
    resumed(keeper(parts, out_dir), parts)
    raise Launched


def _without_runtime(args: list[str]) -> list[str]:
    return [a for a in args if a.split("=", 1)[0].split(".", 1)[0] != "runtime"]


def _launched_auto(
    workers: int = 8, servers: int = 1, inject_stragglers: bool = False, time_scale: float = 0.01, **_: Any
) -> spec.RuntimeSpec:
    """`runtime=auto` as a launch of several ranks resolves it: MPI's parameter server."""
    return spec.mpi(servers, inject_stragglers, time_scale)


@st.composite
def cross_resumes(draw: st.DrawFn) -> tuple[list[str], set[str], str]:
    """Random overrides (the runtime left to `auto`, so that the config can match the checkpoint's) and which kind
    of runtime wrote the checkpoint this run resumes: the simulator (this run is then an MPI launch) or MPI."""
    args, perturbed = draw(overrides())
    return (
        _without_runtime(args),
        perturbed - {k for k in perturbed if k.startswith("runtime")},
        draw(st.sampled_from(["simulated", "mpi"])),
    )


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="the hang guard needs SIGALRM (POSIX)")
def test_resuming_the_other_kind_of_runtime_is_refused_in_one_line(tmp_path: Path) -> None:
    simulated = tmp_path / "simulated"
    cfg, choices = compose_with_choices(["checkpoint.every=1"])  # a key a resume may change
    execute(cfg, simulated, choices)
    # An MPI run's checkpoint holds no simulator state (its `driver` is empty): the simulator's with it emptied.
    (tmp_path / "mpi").mkdir()
    saved = torch.load(simulated / "checkpoint.pt", weights_only=True)
    torch.save({**saved, "driver": {}}, tmp_path / "mpi" / "checkpoint.pt")
    named: Counter[str] = Counter()

    @settings(max_examples=CROSS_EXAMPLES, **SETTINGS)
    # The checkpoints' own configs: each reaches the cross-runtime check.
    @example(([], set(), "simulated"))
    @example(([], set(), "mpi"))
    @given(cross_resumes())
    def fuzz(drawn: tuple[list[str], set[str], str]) -> None:
        args, perturbed, written_by = drawn
        args = [*args, f"resume={tmp_path / written_by}"]
        launched = mock.patch.object(spec, "auto", _launched_auto if written_by == "simulated" else spec.auto)
        # fuzz_example puts `_launched` in the place of `train._run_mpi`: the resume check goes first.
        with launched, mock.patch("tests.unit.test_fuzz_config._launched", _resume_at_the_launch):
            outcome = fuzz_example((args, perturbed | {"resume"}), tmp_path)
        assert outcome in ("refused in one line", "refused by Hydra"), (args, outcome)
        outcomes[outcome] += 1

    outcomes: Counter[str] = Counter()
    if SEED is not None:
        fuzz = seed(int(SEED))(fuzz)
    with mock.patch("tests.unit.test_fuzz_config.user_error", _counting(collsync.cli.user_error, named)):
        fuzz()
    print(dict(outcomes), dict(named))
    assert named["both runtimes"] >= 2, named  # both directions reach the check (the explicit examples)


def _counting(user_error: Any, named: Counter[str]) -> Any:
    """`user_error`, counting the messages that name both kinds of runtime."""

    def wrapped(exc: BaseException) -> str | None:
        message = user_error(exc)
        if message is not None and all(kind in message for kind in BOTH):
            named["both runtimes"] += 1
        return message

    return wrapped


@st.composite
def sweeps(draw: st.DrawFn) -> tuple[list[str], str, list[str]]:
    """Group choices (the runtime left to the launch: the simulator here), and a key of that config swept over 2 or
    3 drawn values (scalars: a sweep splits its values at commas)."""
    args, _ = draw(overrides())
    args = [a for a in _without_runtime(args) if "." not in a.split("=", 1)[0]]
    cfg = composed_choices(tuple(args))
    keys = [f"{g}.{k}" for g in cfg if OmegaConf.is_dict(cfg[g]) for k in cfg[g] if not str(k).startswith("_")]
    keys = sorted(k for k in keys if not k.startswith(("runtime.", "hydra.", "checkpoint.")))
    key = draw(st.sampled_from(keys))
    scalar = value_for(OmegaConf.select(cfg, key, throw_on_missing=False)).filter(
        lambda v: not any(c in v for c in ",[]{}") and v.strip()
    )
    return args, key, draw(st.lists(scalar, min_size=2, max_size=3))


def run_sweep(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`collsync-train -m ...` in this process, as `cli.train` runs it (errors raised, then sorted): its exit
    status and stderr. The signal handlers and the logging it sets up are put back after it."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    logged = logging.root.handlers[:], logging.root.level  # Hydra configures logging for each member
    capsys.readouterr()
    status = 0
    try:
        with (
            mock.patch.object(sys, "argv", ["collsync-train", "-m", *argv]),
            mock.patch.dict(os.environ, {"HYDRA_FULL_ERROR": "1"}),
            mock.patch.object(collsync.cli, "_FAILED_MEMBERS", []) as failed,
        ):
            collsync.cli._train()
            status = 2 if failed else 0
    except SystemExit as exc:  # every member checked first: those refused named, and the sweep ended before any
        status = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # noqa: BLE001 - Hydra's refusal of the whole sweep: one line, or a bug
        check_one_line(exc, argv)
        status = 2
    finally:
        GlobalHydra.instance().clear()
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for handler in logging.root.handlers[:]:
            if handler not in logged[0]:
                logging.root.removeHandler(handler)
                handler.close()
        logging.root.setLevel(logged[1])
    return status, capsys.readouterr().err


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="the hang guard needs SIGALRM (POSIX)")
def test_every_sweep_member_trains_or_is_named_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    count = iter(range(10**6))

    @settings(max_examples=SWEEP_EXAMPLES, **SETTINGS)
    @example(([], "sync.deadline", ["60", "soon", "600"]))  # member 1 is refused before member 0 trains
    @given(sweeps())
    def fuzz(drawn: tuple[list[str], str, list[str]]) -> None:
        args, key, values = drawn
        sweep = tmp_path / f"sweep{next(count)}"
        argv = [
            *args,
            "steps=3",
            "progress=false",
            "plots=false",
            f"hydra.sweep.dir={sweep}",
            f"{key}={','.join(values)}",
        ]
        previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError(f"{argv} hung")))
        signal.alarm(EXAMPLE_LIMIT_S * len(values))
        try:
            status, err = run_sweep(argv, capsys)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        named = {
            int(line.split("sweep member ", 1)[1].split(" ", 1)[0])
            for line in err.splitlines()
            if line.startswith("collsync-train: error: sweep member ")
        }
        trained = {j for j in range(len(values)) if (sweep / str(j) / "trace.jsonl").is_file()}
        ran = sweep.is_dir() and any((sweep / str(j)).is_dir() for j in range(len(values)))
        # Members refused by their config: named before the first trains, and none trains. Otherwise every member
        # trained or was named (it failed while training), never both, and one failing does not stop the others.
        if ran and "the sweep trained no member" in err:
            assert named and not trained, (argv, err[-3000:])
        elif ran:
            assert named | trained == set(range(len(values))) and not named & trained, (argv, err[-3000:])
        assert status == (2 if named or not ran else 0), (argv, status, err[-3000:])
        outcomes[f"{len(trained)} trained, {len(named)} named" if ran else "refused before the first member"] += 1

    outcomes: Counter[str] = Counter()
    if SEED is not None:
        fuzz = seed(int(SEED))(fuzz)
    fuzz()
    print(dict(outcomes))
    assert any(o.endswith(" named") and not o.endswith("0 named") for o in outcomes), outcomes
