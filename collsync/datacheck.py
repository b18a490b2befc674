"""The checks data gets once read, before a model is built for it: each split's features and labels (one row per
sample, numbers, finite, whole labels >= 0, naming the first bad row), and the number of classes the training labels
make (a mistyped label must not build a huge output layer)."""

from __future__ import annotations

import numpy as np

MAX_CLASSES = 100_000
"""The most classes a data set may have (its output layer grows with them): more is a mistyped label or config."""


def too_many_classes(classes: int, held: int, rows: int) -> str:
    """Why `classes` (the largest training label + 1) cannot be the number of classes, or "": a label far above
    the others is a typo (100000 among 0..9 would build a 100,001-way output layer, a 494 MB checkpoint), more
    classes than training rows leave some with nothing to learn from, and beyond `MAX_CLASSES` the output layer
    alone outgrows what a run here trains."""
    fix = "labels must number the classes 0..K-1"
    if classes > 2 * held:
        return f"{classes} classes of which it holds {held}: {fix}"
    if classes > rows:
        return f"{classes} classes, more than its {rows} rows (a class needs rows to learn from): {fix}"
    if classes > MAX_CLASSES:
        return f"{classes} classes, more than the {MAX_CLASSES} collsync builds an output layer for: {fix}"
    return ""


def check_split(name: str, part: str, x: np.ndarray, y: np.ndarray, xs: str, ys: str) -> None:
    """One split's features `x` and labels `y` (called `xs`, `ys` in messages, which name the first bad row)."""
    # Shapes and dtypes first: numpy's own errors on a 0-d array or text data name neither the file nor the split.
    if x.ndim < 1 or y.ndim < 1:
        raise ValueError(f"{name}: {part} features {x.shape} and labels {y.shape} must have one row per sample")
    for what, a in (("features", x), ("labels", y)):
        if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
            raise ValueError(f"{name}: {part} {what} must be numbers (got dtype {a.dtype})")
    if y.ndim != 1 or len(x) != len(y):
        raise ValueError(f"{name}: {part} features {x.shape} and labels {y.shape} must have the same rows")
    if len(y) == 0:
        raise ValueError(f"{name}: the {part} split is empty ({xs} and {ys} have 0 rows)")
    # Float labels are accepted when they are whole numbers (np.savez of a float array is common).
    if np.issubdtype(y.dtype, np.floating) and (bad := ~np.isfinite(y) | (y != np.round(y))).any():
        row = int(np.argmax(bad))
        raise ValueError(
            f"{name}: {part} labels must be whole numbers (got dtype {y.dtype}; {ys} row {row} holds {y[row]})"
        )
    if y.min() < 0:
        row = int(np.argmax(y < 0))
        raise ValueError(f"{name}: {part} labels must be >= 0 (found {y.min():g}; {ys} row {row} holds {y[row]:g})")
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        bad = np.argwhere(~np.isfinite(x))[0]
        raise ValueError(
            f"{name}: {part} features hold non-finite values ({int((~np.isfinite(x)).sum())}; the first, "
            f"{x[tuple(bad)]}, in {xs} row {int(bad[0])}): clean the data before training"
        )
