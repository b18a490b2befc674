"""The server's divergence guard (`guard=stop|skip|off`): is a gradient or an update finite, and where it is not."""

from __future__ import annotations

import math

import torch

from collsync.types import Flat

GUARDS = ("stop", "skip", "off")


class Diverged(ValueError):
    """Training went non-finite (or far above its starting loss): the run stops, naming where."""


def finite(t: Flat) -> bool:
    """Every value finite? One reduction and no mask on the server's hot path: NaN and inf propagate through a sum
    (a sum of finite values that overflows also answers False, and is divergence all the same)."""
    return math.isfinite(float(t.sum()))


def first_bad(t: Flat) -> str:
    bad = (~torch.isfinite(t)).nonzero()
    return f"{int(bad.numel())} of {t.numel()} values, the first {t[int(bad[0])].item()} at index {int(bad[0])}"
