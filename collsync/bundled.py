"""Data that ships inside an installed wheel, read without importing the wheel's package.

scikit-learn's handwritten digits are a CSV inside its wheel (`sklearn/datasets/data/digits.csv.gz`: 1,797 rows of
64 pixel values 0..16, then the label). `sklearn.datasets.load_digits` reads that file with `np.loadtxt`; importing
scikit-learn to call it imports SciPy too, about 2.5 s of start-up on every rank of every launch here (and an import
storm on a cluster's shared file system), against 0.15 s for the read itself. So the file is read here, the same
way, and `load_digits` is the fallback where a scikit-learn keeps it elsewhere. tests/unit/test_data.py checks the
two give the same arrays, bit for bit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

DIGITS_CSV = ("datasets", "data", "digits.csv.gz")
"""Where, under the installed `sklearn` package, the digits file lies."""


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as `load_digits()` gives them: pixels float64 (1797, 64) in 0..16, labels int64."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent.joinpath(*DIGITS_CSV)
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # the fallback: slower, the same data

    bunch = load_digits()
    return bunch.data, bunch.target.astype(np.int64)
