"""The install lists every package: pyproject.toml names its packages one by one, so a new folder of modules (or of
configs) must be added there, or a non-editable install silently lacks it."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_folder_of_modules_or_configs_is_a_listed_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for pattern in ("*.py", "*.yaml")
        for path in (ROOT / "collsync").rglob(pattern)
        if "__pycache__" not in path.parts
    }
    assert folders - listed == set(), f"add to [tool.setuptools] packages: {sorted(folders - listed)}"
