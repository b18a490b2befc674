"""The checks a data path gets before anything opens it: a missing path is named, and so is a named pipe, socket
or device, which `open()` would block on (ignoring SIGTERM while it waits for a writer) or read without end."""

from __future__ import annotations

from pathlib import Path


def existing(name: str, path: Path) -> Path:
    """`path` if it is a regular file or a folder (each factory checks which it needs); else a one-line error
    naming the factory and the path."""
    if not path.exists():
        raise FileNotFoundError(f"{name}: path={str(path)!r} does not exist")
    if not path.is_file() and not path.is_dir():
        raise ValueError(f"{name}: path={str(path)!r} is a named pipe, socket or device, not a regular file or folder")
    return path
