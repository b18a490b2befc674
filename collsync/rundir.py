"""The run folder on disk: checked before training, and never the only place the trained parameters could go.

`probe(out_dir)` writes, syncs and removes a small file, so that a folder that cannot take the results (read-only,
full, under a regular file) stops the run before the first gradient. `keep_on_write_failure(out_dir, payload)`
wraps the writes at the end of training: if one fails (the disk filled up meanwhile, the file system went away),
the parameters are saved to a temporary file instead and the error names both the folder and that file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Bytes the probe writes: a few pages, so a folder with less room than a small model's parameters fails it.
PROBE_BYTES = 65536


class RunFolderError(OSError):
    """The run folder cannot be written; the message is one line naming the folder, the OS error and, at the end of
    training, where the parameters were kept."""

    def __str__(self) -> str:
        return str(self.args[0])


def describe(exc: OSError) -> str:
    """An OS error as one line naming its path: "'/data/run/x': [Errno 28] No space left on device"."""
    where = f"{exc.filename!r}: " if exc.filename is not None else ""
    return f"{where}[Errno {exc.errno}] {exc.strerror or exc}"


def probe(out_dir: Path) -> None:
    """Create the run folder if needed and write `PROBE_BYTES` to a temporary file in it (flushed to disk with
    fsync, then removed); raise RunFolderError naming the folder if any of that fails."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-probe-") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise RunFolderError(f"the run folder {str(out_dir)!r} cannot be written: {describe(exc)}") from exc


def keep(payload: dict[str, Any]) -> Path:
    """Save `payload` (torch.save) to a new file in the temporary folder, else in the home folder; its path."""
    import torch

    errors = []
    for folder in (Path(tempfile.gettempdir()), Path.home()):
        try:
            fd, name = tempfile.mkstemp(prefix="collsync-params-", suffix=".pt", dir=folder)
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            return Path(name)
        except OSError as exc:
            errors.append(describe(exc))
    raise OSError(f"no folder could take them ({'; '.join(errors)})")


@contextlib.contextmanager
def keep_on_write_failure(out_dir: Path, payload: dict[str, Any]) -> Iterator[None]:
    """Writes to the run folder at the end of training: on an OSError, `keep(payload)` elsewhere and raise
    RunFolderError naming the folder, the error and the file that holds the parameters now."""
    try:
        yield
    except OSError as exc:
        failed = f"the run folder {str(out_dir)!r} could not be written at the end of training ({describe(exc)})"
        try:
            kept = keep(payload)
        except OSError as lost:
            raise RunFolderError(f"{failed}, and the parameters could not be kept elsewhere: {lost}") from exc
        raise RunFolderError(f"{failed}; the parameters are kept in {kept}") from exc
