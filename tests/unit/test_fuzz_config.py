"""Config fuzzing: random choices of every config group, with random keys set to valid and invalid values (and now
and then a group or a mapping itself given a value of the wrong kind: removed, a list of options, a scalar), either
train or fail with one line, never with a traceback or a hang.

Each example is composed with Hydra's compose API and run in-process through `collsync.cli.execute`, the function
`collsync-train` calls; an error must be one `collsync.cli.user_error` accepts (the CLI would print it as its one
line). Runtimes that need MPI ranks (mpi, allreduce, partial) go as far as the launch: everything before it
(schema, factories, the checks that need no world) runs, the launch itself is replaced by a marker, because MPI
started inside the test process would stay there for every later test (`test_bad_inputs` launches them for real).

Examples are derandomized (the same every run) and bounded (`COLLSYNC_FUZZ_EXAMPLES`, 30 by default, under a minute
on two cores); `COLLSYNC_FUZZ_SEED=<n>` draws a different set.
"""

from __future__ import annotations

import functools
import math
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

import collsync.train
from collsync.cli import CONF_DIR, execute, user_error

GROUPS = {
    p.name: sorted(f.stem for f in p.glob("*.yaml"))
    for p in sorted(Path(CONF_DIR).iterdir())
    if p.is_dir() and list(p.glob("*.yaml"))
}
# Top-level keys a user sets; `steps` stays small so that every example that trains ends in about a second.
TOP_LEVEL = ["seed", "batch_size", "eval_every", "ema_decay", "warmup_updates", "linear_scaling", "guard", "guard_loss"]
FIXED = ["steps=3", "progress=false"]
NEEDS_MPI = {"mpi", "allreduce", "partial"}
EXAMPLES = int(os.environ.get("COLLSYNC_FUZZ_EXAMPLES", "30"))
SEED = os.environ.get("COLLSYNC_FUZZ_SEED")
# No example may take longer (one that trains takes about a second): longer is a hang.
EXAMPLE_LIMIT_S = 60


class Launched(Exception):
    """Raised instead of starting MPI: the config went through every check before the launch."""


class Hung(Exception):
    """An example ran past EXAMPLE_LIMIT_S."""


def render(value: Any) -> str:
    """A value as a Hydra override spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(render(v) for v in value) + "]"
    return str(value)


# Values of the kind a key holds (small, so a run that accepts them stays fast) and values of other kinds.
SMALL_INTS = st.integers(min_value=-2, max_value=9)
FLOATS = st.sampled_from(
    [0.0, 1e-8, 0.001, 0.05, 0.1, 0.5, 0.9, 0.999, 1.0, 1.5, 3.0, -0.1, float("nan"), float("inf")]
)
WRONG = st.sampled_from(["abc", "x1", "1.5", "true", "null", "[1,2]", "[]", "-1", "0", "nan", "1e3"])
# Values of another kind than a key's or a group's: mappings, lists, scalars.
OTHER_KIND = st.sampled_from(["{a:1}", "{}", "{lr:0.1}", "[1,2]", "[]", "abc", "3", "null"])
# The mappings of conf/config.yaml that are not groups: Hydra lets a scalar replace them (`checkpoint=foo`).
MAPPINGS = ["checkpoint"]
GROUP_EXAMPLES = int(os.environ.get("COLLSYNC_FUZZ_GROUP_EXAMPLES", "15"))


def value_for(current: Any) -> st.SearchStrategy[str]:
    """Override values for a key whose composed value is `current`: mostly of its kind, sometimes not."""
    if isinstance(current, bool):
        same: st.SearchStrategy[Any] = st.booleans()
    elif isinstance(current, int):
        same = SMALL_INTS
    elif isinstance(current, float):
        same = FLOATS
    elif isinstance(current, (list, ListConfig)):
        same = st.lists(st.integers(min_value=-1, max_value=9), min_size=0, max_size=3)
    elif current is None:
        same = st.one_of(st.none(), SMALL_INTS, FLOATS)
    else:
        same = st.sampled_from([current, "bogus"])
    return st.one_of(same.map(render), same.map(render), same.map(render), WRONG)


@st.composite
def overrides(draw: st.DrawFn) -> tuple[list[str], set[str]]:
    """Group choices, then keys of the composed config set to drawn values; and the keys perturbed."""
    # Each group keeps its default half of the time: with every group drawn at once, most examples would be
    # refused for one of several conflicts and few would train.
    choices = [f"{g}={draw(st.sampled_from(options))}" for g, options in GROUPS.items() if draw(st.booleans())]
    cfg = composed_choices(tuple(choices))
    keys = [k for k in TOP_LEVEL if k in cfg]
    for group in GROUPS:
        node = cfg.get(group)
        if isinstance(node, DictConfig):
            keys += [f"{group}.{k}" for k in node if not str(k).startswith("_")]
    picked = draw(st.lists(st.sampled_from(sorted(keys)), min_size=0, max_size=2, unique=True))
    values = [f"{k}={draw(value_for(OmegaConf.select(cfg, k, throw_on_missing=False)))}" for k in picked]
    return choices + values, set(picked)


@st.composite
def group_level(draw: st.DrawFn) -> tuple[list[str], set[str]]:
    """Group choices, then a group or a mapping of conf/config.yaml given a value of the wrong kind (the group
    removed, a list of its options, a scalar or a list where its mapping goes) and maybe one key of the config a
    value of another kind; and the keys perturbed."""
    args, _ = draw(overrides())
    groups = [g for g in GROUPS if g not in ("method", "experiment")]  # those two are optional and set other groups
    whole = draw(st.sampled_from(groups + MAPPINGS))
    if whole in MAPPINGS:
        value = f"{draw(st.sampled_from(['', '++']))}{whole}={draw(OTHER_KIND)}"
    else:
        options = ",".join(draw(st.lists(st.sampled_from(GROUPS[whole]), min_size=1, max_size=2, unique=True)))
        value = draw(st.sampled_from([f"{whole}=[{options}]", f"~{whole}", f"++{whole}={draw(OTHER_KIND)}"]))
    args = [a for a in args if a.split("=", 1)[0].split(".", 1)[0] != whole]  # the group's own choice and keys
    cfg = composed_choices(tuple(a for a in args if "." not in a.split("=", 1)[0]))
    keys = [
        f"{g}.{k}" for g in groups if isinstance(cfg.get(g), DictConfig) for k in cfg[g] if not str(k).startswith("_")
    ]
    key = draw(st.sampled_from(sorted(keys)))
    extra = [f"{key}={draw(OTHER_KIND)}"] if draw(st.booleans()) and not key.startswith(f"{whole}.") else []
    return [*args, value, *extra], {whole, *(key for _ in extra)}


def compose_config(args: list[str]) -> DictConfig:
    return compose_with_choices(args)[0]


def compose_with_choices(args: list[str]) -> tuple[DictConfig, dict[str, Any]]:
    """The config as `collsync-train` gets it, and Hydra's choice of option per group (which the CLI passes on)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*FIXED, *args], return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices


@functools.lru_cache(maxsize=256)
def composed_choices(choices: tuple[str, ...]) -> DictConfig:
    """The config of these group choices (only read: the keys there are to perturb and their values)."""
    return compose_config(list(choices))


def _launched(*args: Any, **kwargs: Any) -> None:
    raise Launched


def _hung(signum: int, frame: Any) -> None:
    raise Hung(f"an example ran past {EXAMPLE_LIMIT_S} s")


def check_one_line(exc: BaseException, args: list[str]) -> str:
    """The error is a user error of one line (what the CLI prints); a bug fails the test with its traceback."""
    message = user_error(exc)
    if message is None:
        raise AssertionError(f"not a user error for {args}: {type(exc).__name__}") from exc
    assert message.strip() and "\n" not in message and "Traceback" not in message, (args, message)
    return message


def fuzz_example(args_keys: tuple[list[str], set[str]], tmp_path: Path) -> str:
    """Run one example; what became of it."""
    args, perturbed = args_keys
    out_dir = tmp_path / f"run{abs(hash(tuple(args)))}"
    try:
        cfg, choices = compose_with_choices(args)
    except Exception as exc:  # noqa: BLE001 - Hydra's own refusal must still be one line
        check_one_line(exc, args)
        return "refused by Hydra"
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(EXAMPLE_LIMIT_S)
    try:
        with mock.patch.object(collsync.train, "_run_mpi", _launched):
            result = execute(cfg, out_dir, choices)
    except Launched:
        assert OmegaConf.select(cfg, "runtime._target_").rsplit(".", 1)[-1] in NEEDS_MPI, args
        return "checked up to the MPI launch"
    except Hung:
        raise
    except Exception as exc:  # noqa: BLE001 - sorted by check_one_line
        message = check_one_line(exc, args)
        if os.environ.get("COLLSYNC_FUZZ_SHOW"):
            print(args, "->", message)
        # A refused value is named: the key (or its last part), or the option or value it conflicts with.
        named = {k.rsplit(".", 1)[-1] for k in perturbed} | {a.split("=", 1)[-1] for a in args}
        named |= {a.split("=", 1)[0].rsplit(".", 1)[-1] for a in args}
        assert any(n and n in message for n in named) or "=" in message, (args, message)
        return "refused in one line"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert result is not None and result["trace_checks"]["updates"] == 3, (args, result)
    assert (out_dir / "params.pt").is_file() and (out_dir / "summary.json").is_file()
    return "trained"


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="the hang guard needs SIGALRM (POSIX)")
def test_random_overrides_train_or_fail_in_one_line(tmp_path: Path) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,  # each example is bounded by EXAMPLE_LIMIT_S instead (a loaded machine varies a lot)
        derandomize=SEED is None,
        database=None,  # nothing written into the checkout
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        # No shrinking: a failure is reported as drawn, in bounded time (its overrides are short enough to read).
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    # One example that reaches the launch whatever the draws (they change as the configs gain keys and options).
    @example((["runtime=partial", "sync=backup"], set()))
    @given(overrides())
    def fuzz(args_keys: tuple[list[str], set[str]]) -> None:
        outcomes[fuzz_example(args_keys, tmp_path)] += 1

    outcomes: Counter[str] = Counter()
    if SEED is not None:
        fuzz = seed(int(SEED))(fuzz)
    fuzz()
    print(dict(outcomes))
    # The examples reach every end: training, a refusal in one line, and the MPI launch.
    assert outcomes["trained"] and outcomes["refused in one line"] and outcomes["checked up to the MPI launch"], (
        outcomes
    )


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="the hang guard needs SIGALRM (POSIX)")
def test_group_level_values_of_the_wrong_kind_fail_in_one_line(tmp_path: Path) -> None:
    @settings(
        max_examples=GROUP_EXAMPLES,
        deadline=None,
        derandomize=SEED is None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    @given(group_level())
    def fuzz(args_keys: tuple[list[str], set[str]]) -> None:
        outcome = fuzz_example(args_keys, tmp_path)
        args, perturbed = args_keys
        whole = next(k for k in perturbed if "." not in k)
        given = next(a for a in args if a.lstrip("~+").split("=", 1)[0] == whole)
        # A group removed or given a list of options never trains (nor does a scalar in its place: Hydra refuses it).
        if whole in GROUPS:
            assert outcome != "trained", args
        outcomes[f"{outcome} ({'removed' if given.startswith('~') else given.split('=', 1)[1][:1] or 'empty'})"] += 1

    outcomes: Counter[str] = Counter()
    if SEED is not None:
        fuzz = seed(int(SEED))(fuzz)
    fuzz()
    print(dict(outcomes))
    # The group-level refusals reach both ends: Hydra's (a scalar for a group) and the schema's (the rest).
    assert any(o.startswith("refused in one line") for o in outcomes), outcomes
    assert any(o.startswith("refused by Hydra") for o in outcomes), outcomes


RESUME_EXAMPLES = int(os.environ.get("COLLSYNC_FUZZ_RESUME_EXAMPLES", "12"))


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="the hang guard needs SIGALRM (POSIX)")
def test_random_overrides_on_a_resume_go_on_or_fail_in_one_line(tmp_path: Path) -> None:
    """Cross-resume: random group choices and keys given to a resume of one finished simulator run (its checkpoint
    at the last step) either go on from it (a key a resume may change) or are refused in one line naming the first
    key that differs, never a traceback: the resume checks meet every kind of config the fuzzing draws."""
    base = tmp_path / "base"
    cfg, choices = compose_with_choices(["checkpoint.every=1"])
    execute(cfg, base, choices)
    assert (base / "checkpoint.pt").is_file()

    @settings(
        max_examples=RESUME_EXAMPLES,
        deadline=None,
        derandomize=SEED is None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    @given(overrides())
    def fuzz(args_keys: tuple[list[str], set[str]]) -> None:
        args, perturbed = args_keys
        outcomes[fuzz_example(([*args, f"resume={base}"], perturbed | {"resume"}), tmp_path)] += 1

    outcomes: Counter[str] = Counter()
    if SEED is not None:
        fuzz = seed(int(SEED))(fuzz)
    fuzz()
    print(dict(outcomes))
    assert outcomes["refused in one line"], outcomes  # most differences are refused: the check is reached
