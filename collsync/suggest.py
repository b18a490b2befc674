""" "Did you mean ...": the close matches of a mistyped name among the names it could have been, so that a typo
(`sync=asynch`) is answered with the name meant, not only with the list to search."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """' (did you mean 'async'?)' for the closest of `options` to `word` (up to three), or '' when none is close."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=3, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)"
