"""One line to stderr in one write.

Python's stderr is write-through: `print(line, file=sys.stderr)` writes the text and its newline in two system calls,
and when several ranks' stderr go through one launcher, another rank's line can land between them
(`...collective)collsync: worker 0 ...`, seen under MPICH's `mpiexec`). One write of a line up to the pipe's atomic
size (4096 bytes on Linux) reaches the launcher whole."""

from __future__ import annotations

import sys
from typing import TextIO


def say(line: str, stream: TextIO | None = None) -> None:
    """Write `line` and its newline to `stream` (stderr by default) in one write, then flush it."""
    out = sys.stderr if stream is None else stream
    out.write(line + "\n")
    out.flush()
