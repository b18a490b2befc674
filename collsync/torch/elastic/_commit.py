"""The commit file of `collsync.torch.elastic`: the last `State.commit()`, kept on disk so that a job relaunched on
the ranks left (`collsync-run`) starts from it.

Horovod keeps a commit in host memory only: its elastic driver keeps the surviving processes alive and their memory
holds the commit. Without ULFM a lost rank ends the whole MPI job, so collsync also writes each commit to a file:
rank 0 writes it (to a temporary file in the same folder, flushed to disk, then `os.replace`d over the last one, so a
reader sees the previous commit or the new one, never half of one) and any rank can read it.

Where: the folder given to the state (`commit_dir=`), else the one `collsync-run` passes in `COLLSYNC_ELASTIC_DIR`,
else none: commits stay in memory, as in Horovod. There is no fixed default folder, because a second, unrelated run
of the same script in the same place would then resume from the first one's last commit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from collsync.supervise_target import ELASTIC_ENV, ELASTIC_FILE

FORMAT = 1  # the layout of the saved dict; a file of another layout is refused, not misread


def commit_dir(given: str | os.PathLike[str] | None) -> Path | None:
    """The folder commits are written to: `given`, else `$COLLSYNC_ELASTIC_DIR`, else None (memory only)."""
    if given is not None:
        return Path(given)
    env = os.environ.get(ELASTIC_ENV)
    return Path(env) if env else None


def write(folder: Path, payload: dict[str, Any]) -> Path:
    """Write `payload` as the folder's commit file, atomically (temporary file, fsync, `os.replace`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ELASTIC_FILE
    tmp = folder / f".{ELASTIC_FILE}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read(folder: Path) -> dict[str, Any] | None:
    """The folder's last commit, or None when it has none. The file holds the script's own objects (any picklable
    attribute of the state), so it is read with `weights_only=False`: read only commit folders you wrote."""
    path = folder / ELASTIC_FILE
    if not path.exists():
        return None
    loaded = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(loaded, dict) or loaded.get("format") != FORMAT:
        found = loaded.get("format") if isinstance(loaded, dict) else type(loaded).__name__
        raise ValueError(f"{path}: not a collsync.torch.elastic commit of format {FORMAT} (found {found!r})")
    return loaded
