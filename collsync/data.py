"""Data sets and per-worker batches. Nothing here downloads: digits ships inside scikit-learn, the rest are files the
user already has (`.npz`, MNIST IDX, CIFAR-10 binary) or generated from a seed.
"""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch


class Dataset(NamedTuple):
    """Train and test tensors (float32 features, int64 labels)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int
    name: str

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _check_fraction(name: str, test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"{name}: {test_fraction=} must be in (0, 1)")


def _split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> Dataset:
    _check_fraction(name, test_fraction)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = max(1, int(round(len(y) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    return Dataset(
        torch.from_numpy(np.ascontiguousarray(x[train], dtype=np.float32)),
        torch.from_numpy(y[train].astype(np.int64)),
        torch.from_numpy(np.ascontiguousarray(x[test], dtype=np.float32)),
        torch.from_numpy(y[test].astype(np.int64)),
        int(y.max()) + 1,
        name,
    )


def digits(test_fraction: float = 0.25, seed: int = 0, flatten: bool = True) -> Dataset:
    """scikit-learn's bundled handwritten digits: 1,797 8x8 images, 10 classes, pixel values scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = bunch.data.astype(np.float32) / 16.0
    if not flatten:
        x = x.reshape(-1, 1, 8, 8)
    return _split("digits", x, bunch.target, test_fraction, seed)


def synthetic(
    samples: int = 2000,
    features: int = 20,
    classes: int = 4,
    noise: float = 0.1,
    seed: int = 0,
    test_fraction: float = 0.25,
) -> Dataset:
    """Gaussian clusters around `classes` random centres in `features` dimensions, with isotropic `noise`."""
    if samples < 2 * classes:
        raise ValueError(f"synthetic: {samples=} must be >= 2 * classes={2 * classes}")
    if features < 1 or classes < 2:
        raise ValueError(f"synthetic: {features=} must be >= 1 and {classes=} >= 2")
    if noise < 0:
        raise ValueError(f"synthetic: {noise=} must be >= 0")
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, features)) / np.sqrt(features) * 2.0
    y = rng.integers(0, classes, size=samples)
    x = centres[y] + noise * rng.normal(size=(samples, features))
    y[:classes] = np.arange(classes)  # every class present
    x[:classes] = centres
    return _split("synthetic", x, y, test_fraction, seed)


def _exists(name: str, path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{name}: path={str(path)!r} does not exist")
    return path


def npz(path: str, flatten: bool = True) -> Dataset:
    """A local .npz holding arrays `x_train`, `y_train`, `x_test`, `y_test` (labels 0..classes-1)."""
    file = _exists("npz", Path(path))
    with np.load(file) as arrays:
        missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in arrays]
        if missing:
            raise ValueError(f"npz: path={str(file)!r} lacks array(s) {missing}")
        xs = {k: arrays[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    if flatten:
        xs["x_train"] = xs["x_train"].reshape(len(xs["x_train"]), -1)
        xs["x_test"] = xs["x_test"].reshape(len(xs["x_test"]), -1)
    return _dataset("npz", xs["x_train"], xs["y_train"], xs["x_test"], xs["y_test"])


def _dataset(name: str, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray) -> Dataset:
    if len(xtr) != len(ytr) or len(xte) != len(yte):
        raise ValueError(f"{name}: features and labels differ in length ({len(xtr)}/{len(ytr)}, {len(xte)}/{len(yte)})")
    return Dataset(
        torch.from_numpy(np.ascontiguousarray(xtr, dtype=np.float32)),
        torch.from_numpy(ytr.astype(np.int64)),
        torch.from_numpy(np.ascontiguousarray(xte, dtype=np.float32)),
        torch.from_numpy(yte.astype(np.int64)),
        int(max(ytr.max(), yte.max())) + 1,
        name,
    )


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST's format): magic 0x0000 08 <ndim>, big-endian dims, unsigned bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"mnist: {str(path)!r} is not an IDX file of unsigned bytes (magic {raw[:4].hex()})")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(int)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"mnist: {str(path)!r} holds {data.size} bytes of data, its header says {dims.tolist()}")
    return data.reshape(dims)


def mnist(path: str, flatten: bool = True) -> Dataset:
    """MNIST from a local folder with the four IDX files (plain or .gz), scaled to [0, 1]."""
    folder = _exists("mnist", Path(path))
    arrays = []
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        candidates = [folder / stem, folder / f"{stem}.gz", folder / stem.replace("-idx", ".idx")]
        found = next((c for c in candidates if c.exists()), None)
        if found is None:
            raise FileNotFoundError(f"mnist: path={str(folder)!r} has no {stem} (or {stem}.gz)")
        arrays.append(_read_idx(found))
    xtr, ytr, xte, yte = arrays
    xtr, xte = xtr.astype(np.float32) / 255.0, xte.astype(np.float32) / 255.0
    shape = (-1,) if flatten else (1, xtr.shape[1], xtr.shape[2])
    return _dataset("mnist", xtr.reshape(len(xtr), *shape), ytr, xte.reshape(len(xte), *shape), yte)


def cifar10(path: str, flatten: bool = False) -> Dataset:
    """CIFAR-10's binary version from a local folder: data_batch_1..5.bin and test_batch.bin, 3,073-byte records."""
    folder = _exists("cifar10", Path(path))

    def read(name: str) -> tuple[np.ndarray, np.ndarray]:
        file = folder / name
        if not file.exists():
            raise FileNotFoundError(f"cifar10: path={str(folder)!r} has no {name}")
        raw = np.fromfile(file, dtype=np.uint8)
        if raw.size % 3073:
            raise ValueError(f"cifar10: {str(file)!r} is {raw.size} bytes, not a whole number of 3073-byte records")
        records = raw.reshape(-1, 3073)
        return records[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0, records[:, 0]

    train = [read(f"data_batch_{i}.bin") for i in range(1, 6)]
    xte, yte = read("test_batch.bin")
    xtr, ytr = np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train])
    if flatten:
        xtr, xte = xtr.reshape(len(xtr), -1), xte.reshape(len(xte), -1)
    return _dataset("cifar10", xtr, ytr, xte, yte)


class Batches:
    """Worker `w`'s `j`-th mini-batch, the same on every runtime.

    Each epoch e draws one permutation perm_e of the training rows from a generator seeded by (seed, e), shared by
    all workers. With n workers of batch b and spe = M // (n b) steps per epoch, worker w's j-th batch is
    perm_e[(i n + w) b : (i n + w + 1) b] with e = j // spe, i = j % spe. Within an epoch workers' rows are
    disjoint, and the n workers' j-th batches together are exactly one worker's j-th batch at batch n b: so BSP
    with n workers at batch B/n computes the same mean gradient as one worker at batch B.
    """

    def __init__(self, dataset: Dataset, workers: int, batch_size: int, seed: int = 0) -> None:
        rows = len(dataset.y_train)
        if workers < 1 or batch_size < 1:
            raise ValueError(f"data: {workers=} and {batch_size=} must be >= 1")
        self.steps_per_epoch = rows // (workers * batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"data: {dataset.name} has {rows} training rows, fewer than workers x batch_size = "
                f"{workers} x {batch_size}"
            )
        self.dataset, self.workers, self.batch_size, self.seed = dataset, workers, batch_size, seed
        self._perm = lru_cache(maxsize=64)(self._permutation)

    def _permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset.y_train), generator=gen)

    def epoch_of(self, index: int) -> int:
        return index // self.steps_per_epoch

    def batch(self, worker: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= worker < self.workers:
            raise ValueError(f"data: {worker=} outside 0..{self.workers - 1}")
        e, i = divmod(index, self.steps_per_epoch)
        b = self.batch_size
        start = (i * self.workers + worker) * b
        rows = self._perm(e)[start : start + b]
        return self.dataset.x_train[rows], self.dataset.y_train[rows]
