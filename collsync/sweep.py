"""A local sweep's members checked before the first of them trains (issue 36: `-m sync.backups=1,8,2` trained
member 0 for nothing, since member 1 was a bad value that only its own turn met).

Hydra's basic launcher runs the members of `collsync-train -m ...` one after another in this process; at the first
member (job 0), `refused` composes every member's config as the sweep will, and runs on each the checks a run makes
before its first gradient (`collsync.train.check`: the schema, the factories, the fit of runtime, policy and
workers). A member refused there is named in one line and nothing trains. What only training meets (a run that
diverges) still fails that member alone, and the sweep goes on (`collsync.cli`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from omegaconf import DictConfig, open_dict


def members(overrides: Sequence[str]) -> list[list[str]]:
    """Each member's overrides in job order, as Hydra's basic sweeper expands the sweep's (`a=1,2 b=x,y`: four)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [list(member) for batch in BasicSweeper.split_arguments(parsed, None) for member in batch]


def refused(
    config_name: str,
    overrides: Sequence[str],
    check: Callable[[DictConfig, dict[str, str], list[str]], None],
    user_error: Callable[[BaseException], str | None],
) -> list[tuple[int, str, str]]:
    """(job number, its overrides, the one-line message) of every member of the sweep of `overrides` over the config
    `config_name` that `check` refuses; a bug is raised."""
    from hydra import compose

    found = []
    for job, member in enumerate(members(overrides)):
        own = [o for o in member if not o.lstrip("+~").startswith("hydra")]  # what the member's line names
        try:
            cfg = compose(config_name=config_name, overrides=member, return_hydra_config=True)
            choices = {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items()}
            with open_dict(cfg):
                del cfg["hydra"]
            check(cfg, choices, own)
        except Exception as exc:  # noqa: BLE001 - sorted into user errors and bugs just below
            message = user_error(exc)
            if message is None:
                raise
            found.append((job, " ".join(own), message))
    return found
