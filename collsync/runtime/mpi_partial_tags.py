"""The encodings of a ring entry's tag word and record (`mpi_partial`'s windows; pure, no MPI): what a tag says to
a reader of a round (`TagState`), and the stamps that tell a record written for one round from an older one. Apart
from the windows (`mpi_partial_windows`) so that every module that compares a tag's state, the direct exchange's
(`mpi_partial_direct`, which the windows import) included, compares it with the same names."""

from __future__ import annotations

from enum import StrEnum

import numpy as np

EMPTY = -1  # the tag of a ring entry no round has used yet


class TagState(StrEnum):
    """What an entry's tag says to a reader of a round (`tag_state`). A `StrEnum`: its members print and compare
    as their words, as the plain strings they replace did."""

    PENDING = "pending"  # its quorum not yet in (or the entry still holds an earlier round)
    SUMMING = "summing"  # its contributors known, each summing its block
    READY = "ready"  # the mean and record are there for every reader
    OVERWRITTEN = "overwritten"  # the entry has moved on to a later round: the mean is gone


PENDING, SUMMING, READY, OVERWRITTEN = TagState
# A record word (blocks, quorum, count, ranks[n] of a ring entry) holds round * STAMP + value + 2: a reader that
# saw the tag of round t takes the record from the same read only if every word carries round t (MPI makes each
# word atomic, not the words together). Values are -1 (a padded rank) up to STAMP - 3; the +2 keeps a word never
# written (0) from passing as round 0's.
STAMP = 1 << 20


def writing_tag(round_: int) -> int:
    """The tag of an entry whose mean for `round_` is being summed (its contributors known, each summing a block):
    negative, distinct from `EMPTY`."""
    return -2 - round_


def tag_state(tag: int, round_: int) -> TagState:
    """What an entry's tag says to a reader of `round_`: PENDING (its quorum not yet in), SUMMING (the contributors
    are summing their blocks), READY, or OVERWRITTEN (the entry has moved on to a later round: the mean is gone)."""
    if tag == EMPTY:
        return PENDING
    complete = tag >= 0
    holds = tag if complete else -2 - tag
    if holds > round_:
        return OVERWRITTEN
    if holds < round_:
        return PENDING
    return READY if complete else SUMMING


def stamp(round_: int, values: np.ndarray) -> np.ndarray:
    """`values` (an entry's record) as the words that say they belong to `round_`."""
    return values + (round_ * STAMP + 2)


def unstamp(words: np.ndarray, round_: int) -> np.ndarray | None:
    """The record in `words` if every word was written for `round_`, else None (some are older or not yet there)."""
    values = words - (round_ * STAMP + 2)
    return values if bool(((values >= -1) & (values < STAMP - 2)).all()) else None
