"""Data sets and per-worker batches. Nothing here downloads: digits ships inside scikit-learn, Fashion-MNIST comes from
Debian's package dataset-fashion-mnist, the rest are files the user already has (`.npz`, MNIST IDX, CIFAR-10 binary) or
generated from a seed.

Every factory is a Hydra `_target_` (conf/data/<name>.yaml) taking keyword arguments of the same names.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from collsync.bundled import digits_arrays
from collsync.datacheck import MAX_CLASSES, check_split, too_many_classes
from collsync.datapath import existing
from collsync.idx import cache_dir, idx_files, read_idx

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
"""The arrays `npz` expects: features (any shape, first axis = rows) and integer labels 0..classes-1."""

FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
"""Where Debian's package dataset-fashion-mnist puts Fashion-MNIST's four gzipped IDX files: `fashion_mnist`'s
default path."""
_CIFAR_RECORD = 1 + 3 * 32 * 32  # one label byte, then 1024 red, 1024 green, 1024 blue bytes


class Dataset(NamedTuple):
    """Train and test tensors: float32 features, int64 labels in 0..classes-1."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int
    name: str
    shift: int = 0
    """Training batches are shifted by up to this many pixels each way (random shifts, zero fill; 0: none)."""
    image: tuple[int, ...] | None = None
    """The (C, H, W) shape a flattened row is shifted in (None: the rows are images already)."""

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample: (features,) when flattened, (C, H, W) for images."""
        return tuple(self.x_train.shape[1:])


_PARTS = ("train features", "train labels", "test features", "test labels")  # arrays without a file of their own


def _dataset(
    name: str,
    xtr: np.ndarray,
    ytr: np.ndarray,
    xte: np.ndarray,
    yte: np.ndarray,
    classes: int | None = None,
    arrays: Sequence[str] = _PARTS,
) -> Dataset:
    """The data checked whole, as torch tensors: no split empty, features numbers and finite, test rows of the
    training rows' shape (the model is built for that shape: `Dataset.input_shape`), labels whole numbers in
    [0, classes) in both splits. `classes` defaults to the largest training label + 1 (at most twice the distinct
    training labels). `arrays` names the four arrays (x_train, ...) in messages: their keys in an .npz, their files."""
    for (x, y), (xs, ys), part in (((xtr, ytr), arrays[:2], "train"), ((xte, yte), arrays[2:], "test")):
        check_split(name, part, x, y, xs, ys)
    if xte.shape[1:] != xtr.shape[1:]:
        raise ValueError(
            f"{name}: {arrays[2]} has rows of shape {xte.shape[1:]} but {arrays[0]} {xtr.shape[1:]}, the model's "
            f"input: both splits need rows of one shape"
        )
    top = int(ytr.max())
    if classes is None and (why := too_many_classes(top + 1, len(np.unique(ytr)), len(ytr))):
        raise ValueError(f"{name}: {arrays[1]} row {int(np.argmax(ytr == top))} holds label {top}, which makes {why}")
    source = "" if classes is not None else f" (the classes {arrays[1]} holds: its largest label + 1)"
    classes = top + 1 if classes is None else classes
    for y, ys in ((ytr, arrays[1]), (yte, arrays[3])):
        if (y >= classes).any():
            row = int(np.argmax(y >= classes))
            raise ValueError(f"{name}: {ys} row {row} holds label {y[row]:g}, outside [0, {classes}){source}")
    (x_train, x_test), (y_train, y_test) = (
        [torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)) for x in (xtr, xte)],
        [torch.from_numpy(y.astype(np.int64)) for y in (ytr, yte)],
    )
    return Dataset(x_train, y_train, x_test, y_test, classes, name)


def _check_seed(name: str, seed: int) -> None:
    # numpy's generators take seeds >= 0 only, and say so without naming the key.
    if seed < 0:
        raise ValueError(f"{name}: {seed=} must be >= 0")


def _split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, classes: int) -> Dataset:
    """A seeded (not stratified) split: a permutation from `seed`, the first round(rows * test_fraction) to test."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"{name}: {test_fraction=} must be in (0, 1)")
    _check_seed(name, seed)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = max(1, int(round(len(y) * test_fraction)))
    if n_test >= len(y):
        raise ValueError(f"{name}: {test_fraction=} leaves no training rows out of {len(y)}")
    test, train = order[:n_test], order[n_test:]
    return _dataset(name, x[train], y[train], x[test], y[test], classes)


def digits(test_fraction: float = 0.25, seed: int = 0, flatten: bool = True, shift: int = 0) -> Dataset:
    """scikit-learn's bundled handwritten digits: 1,797 8x8 images, 10 classes, pixels (0..16) scaled to [0, 1].

    `flatten=False` gives (1, 8, 8) images for the CNN. `shift=s` augments the training batches with random shifts
    of up to s pixels each way (`Batches.batch`; the test set is never shifted): with s = 1 a digit moves by an
    eighth of the image, which makes the task harder to fit and so gradients stay informative longer, where stale
    ones can hurt.
    """
    if not (isinstance(shift, int) and 0 <= shift < 8):
        raise ValueError(f"digits: {shift=} must be an integer in 0..7 (pixels of an 8x8 image)")
    pixels, labels = digits_arrays()  # the data ships inside scikit-learn's wheel: no download
    x = pixels.astype(np.float32) / 16.0
    if not flatten:
        x = x.reshape(-1, 1, 8, 8)
    data = _split("digits", x, labels, test_fraction, seed, classes=10)
    return data._replace(shift=shift, image=(1, 8, 8) if flatten else None) if shift else data


def random_shift(x: torch.Tensor, shift: int, image: tuple[int, ...] | None, gen: torch.Generator) -> torch.Tensor:
    """Each row of `x` moved by (dy, dx) drawn uniformly from -shift..shift, zero filled: the random shifts of the
    digits augmentation. Rows are (C, H, W) images, or flat rows of the shape `image`."""
    if shift == 0 or len(x) == 0:
        return x
    imgs = x.reshape(len(x), *image) if image is not None else x
    h, w = imgs.shape[-2:]
    padded = torch.nn.functional.pad(imgs, (shift, shift, shift, shift))
    offsets = torch.randint(0, 2 * shift + 1, (len(x), 2), generator=gen)
    out = torch.stack([padded[i, ..., oy : oy + h, ox : ox + w] for i, (oy, ox) in enumerate(offsets.tolist())])
    return out.reshape(x.shape)


def synthetic(
    samples: int = 2000,
    features: int = 20,
    classes: int = 4,
    noise: float = 0.1,
    seed: int = 0,
    test_fraction: float = 0.25,
) -> Dataset:
    """Gaussian clusters: `classes` random centres c_k ~ N(0, 4/features I), x = c_y + noise * N(0, I).

    The centres sit about 2 apart and the noise is small by default, so the task is learnable by an MLP in a few
    hundred steps; raise `noise` to make it harder. The first `classes` rows are the centres themselves, so every
    class is present.
    """
    if features < 1:
        raise ValueError(f"synthetic: {features=} must be >= 1")
    if classes < 2:
        raise ValueError(f"synthetic: {classes=} must be >= 2")
    if classes > MAX_CLASSES:
        raise ValueError(f"synthetic: {classes=} must be <= {MAX_CLASSES} (the output layer grows with it)")
    if samples < 2 * classes:
        raise ValueError(f"synthetic: {samples=} must be >= 2 * classes={2 * classes}")
    if not noise >= 0:
        raise ValueError(f"synthetic: {noise=} must be >= 0")
    _check_seed("synthetic", seed)
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, features)) / np.sqrt(features) * 2.0
    y = rng.integers(0, classes, size=samples)
    x = centres[y] + noise * rng.normal(size=(samples, features))
    y[:classes] = np.arange(classes)
    x[:classes] = centres
    return _split("synthetic", x, y, test_fraction, seed, classes=classes)


def npz(path: str, flatten: bool = True) -> Dataset:
    """A local .npz holding the arrays `x_train`, `y_train`, `x_test`, `y_test` (see `NPZ_KEYS`).

    Features may have any per-row shape (flattened unless `flatten=False`); labels are whole numbers
    0..classes-1, and `classes` is the largest label + 1. Write one with `np.savez(path, x_train=..., ...)`.
    """
    file = existing("npz", Path(path))
    where = f"npz: path={str(file)!r}"
    if file.is_dir():
        raise ValueError(f"{where} is a folder, not an .npz archive of {list(NPZ_KEYS)}")
    # Look at the first bytes before numpy does: on anything but a zip or .npy it suggests unpickling the file.
    try:
        with open(file, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise ValueError(f"{where} cannot be read ({e.strerror})") from e
    if not head:
        raise ValueError(f"{where} is empty (0 bytes), not an .npz archive of {list(NPZ_KEYS)}")
    if not head.startswith((b"PK", b"\x93NUMPY")):
        raise ValueError(
            f"{where} is not a readable .npz archive (a zip of {list(NPZ_KEYS)} written by np.savez): it starts "
            f"with {head!r}"
        )
    try:
        arrays = np.load(file, allow_pickle=False)  # never unpickle a user's file
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{where} is not a readable .npz archive ({type(e).__name__}: {e})") from e
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise ValueError(f"{where} holds a single array, not an .npz archive of {list(NPZ_KEYS)}")
    with arrays:
        missing = [k for k in NPZ_KEYS if k not in arrays.files]
        if missing:
            raise ValueError(f"{where} lacks array(s) {missing}; it has {arrays.files}")
        loaded = []
        for key in NPZ_KEYS:
            try:
                loaded.append(arrays[key])
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # truncated, or object arrays (pickles)
                raise ValueError(f"{where}: array {key!r} cannot be read ({type(e).__name__}: {e})") from e
        xtr, ytr, xte, yte = loaded
    if xtr.ndim < 1 or xte.ndim < 1:
        raise ValueError(f"{where}: x_train {xtr.shape} and x_test {xte.shape} must have one row per sample")
    if flatten:  # the row size spelled out: -1 cannot be inferred for a split of 0 rows
        xtr, xte = (x.reshape(len(x), math.prod(x.shape[1:])) for x in (xtr, xte))
    return _dataset(where, xtr, ytr, xte, yte, arrays=NPZ_KEYS)._replace(name="npz")


def _idx_dataset(name: str, files: list[Path], flatten: bool, cache: Path | None = None) -> Dataset:
    """Images and labels from four IDX files (train images, train labels, test images, test labels), pixels scaled
    to [0, 1], 10 classes; every message names `name` and the file."""
    xtr, ytr, xte, yte = (read_idx(f, name, cache) for f in files)
    for images, labels, fi, fl in ((xtr, ytr, files[0], files[1]), (xte, yte, files[2], files[3])):
        if images.ndim != 3 or labels.ndim != 1:
            raise ValueError(
                f"{name}: {str(fi)!r} must hold 3-D images and {str(fl)!r} 1-D labels "
                f"(got {images.ndim}-D and {labels.ndim}-D)"
            )
        if len(images) != len(labels):
            raise ValueError(f"{name}: {str(fi)!r} has {len(images)} images but {str(fl)!r} {len(labels)} labels")
    # Each split in its own image size: `_dataset` reports a mismatch, naming the files.
    xtr, xte = (x.reshape(len(x), *((math.prod(x.shape[1:]),) if flatten else (1, *x.shape[1:]))) for x in (xtr, xte))
    names = [repr(str(f)) for f in files]
    return _dataset(name, _scaled(xtr), ytr, _scaled(xte), yte, 10, names)


def _scaled(pixels: np.ndarray) -> np.ndarray:
    """Byte pixels as float32 in [0, 1], divided in place: one float copy of the images, not two."""
    x = pixels.astype(np.float32)
    x /= 255.0
    return x


def mnist(path: str, flatten: bool = True) -> Dataset:
    """MNIST from a local folder with the four IDX files (plain or .gz), pixels scaled to [0, 1], 10 classes.

    Any data set in MNIST's IDX layout and file names loads the same way; Fashion-MNIST has a factory of its own
    (`fashion_mnist`: a default folder, a cache). `flatten=False` gives (1, 28, 28) images.
    """
    return _idx_dataset("mnist", idx_files("mnist", path), flatten)


def fashion_mnist(path: str = FASHION_MNIST_DIR, flatten: bool = True, cache: bool = True) -> Dataset:
    """Fashion-MNIST (Zalando's 28x28 grey images of clothing, 60,000 training and 10,000 test, 10 classes) from the
    folder Debian's package dataset-fashion-mnist installs, or any folder with its four IDX files (plain or .gz).

    Pixels are scaled to [0, 1]; `flatten=False` gives (1, 28, 28) images. With `cache`, each gzipped file is
    decompressed once into the user cache (`cache_dir()`) and read from there afterwards, checked by size and
    sha256: a run, and every rank of it, starts without decompressing 30 MB. Where the files are missing, the one
    line says how to install the package.
    """
    name = "fashion_mnist"
    try:
        files = idx_files(name, path)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{e}: install Debian's package {FASHION_MNIST_PACKAGE} (as root: apt-get install {FASHION_MNIST_PACKAGE}),"
            f" or set data.path to a folder holding Fashion-MNIST's four IDX files"
        ) from None
    return _idx_dataset(name, files, flatten, cache_dir() if cache else None)


def cifar10(path: str, flatten: bool = False) -> Dataset:
    """CIFAR-10's binary version from a local folder: data_batch_1..5.bin and test_batch.bin.

    Each record is 3,073 bytes: a label 0..9, then a 32x32 image as 1,024 red, 1,024 green, 1,024 blue bytes (row
    major), so a record reshapes directly to (3, 32, 32). Pixels are scaled to [0, 1]. `path` may also be the folder
    that holds the extracted `cifar-10-batches-bin`.
    """
    folder = existing("cifar10", Path(path))
    if not (folder / "data_batch_1.bin").exists() and (folder / "cifar-10-batches-bin").is_dir():
        folder = folder / "cifar-10-batches-bin"

    def read(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        parts = []
        for name in names:
            file = folder / name
            if not file.is_file():
                raise FileNotFoundError(f"cifar10: path={str(folder)!r} has no {name}")
            raw = np.fromfile(file, dtype=np.uint8)
            if raw.size == 0 or raw.size % _CIFAR_RECORD:
                raise ValueError(
                    f"cifar10: {str(file)!r} is {raw.size} bytes, not a whole number of {_CIFAR_RECORD}-byte records"
                )
            records = raw.reshape(-1, _CIFAR_RECORD)
            if records[:, 0].max() > 9:
                raise ValueError(f"cifar10: {str(file)!r} has label {records[:, 0].max()} (must be 0..9)")
            parts.append(records)
        # Join the bytes before converting: one float32 copy of the training set instead of two.
        records = np.concatenate(parts)
        x = records[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
        return (x.reshape(len(x), -1) if flatten else x), records[:, 0]

    xtr, ytr = read([f"data_batch_{i}.bin" for i in range(1, 6)])
    xte, yte = read(["test_batch.bin"])
    return _dataset("cifar10", xtr, ytr, xte, yte, classes=10)


class Batches:
    """Worker `w`'s `j`-th mini-batch, the same on every runtime.

    Each epoch e draws one permutation perm_e of the M training rows from a `torch.Generator` seeded with
    seed * 1_000_003 + e, shared by all workers. With n workers of batch b and spe = M // (n b) steps per epoch,
    worker w's j-th batch is

        perm_e[(i n + w) b : (i n + w + 1) b]    with e = j // spe, i = j % spe.

    Within an epoch workers' rows are disjoint, and the n workers' j-th batches concatenated in worker order are
    exactly one worker's j-th batch at batch n b (same rows, same order): so BSP with n workers at batch B/n computes
    the same mean gradient as one worker at batch B. The last M - spe n b rows of each permutation are skipped.
    """

    def __init__(self, dataset: Dataset, workers: int, batch_size: int, seed: int = 0) -> None:
        if workers < 1:
            raise ValueError(f"data: {workers=} must be >= 1")
        if batch_size < 1:
            raise ValueError(f"data: {batch_size=} must be >= 1")
        rows = len(dataset.y_train)
        self.steps_per_epoch = rows // (workers * batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"data: {dataset.name} has {rows} training rows, fewer than workers x batch_size = "
                f"{workers} x {batch_size}"
            )
        self.dataset, self.workers, self.batch_size, self.seed = dataset, workers, batch_size, seed
        # `batch` is called once per gradient: draw each epoch's permutation once. Workers drift apart by a few
        # epochs at most under async policies, so a small cache holds every epoch in use.
        self._perm = lru_cache(maxsize=64)(self._permutation)

    def _permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset.y_train), generator=gen)

    def epoch_of(self, index: int) -> int:
        """The epoch a worker's `index`-th batch belongs to."""
        return index // self.steps_per_epoch

    def batch(self, worker: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Worker `worker`'s `index`-th mini-batch (features, labels): new tensors, safe to modify."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"data: {worker=} outside 0..{self.workers - 1}")
        if index < 0:
            raise ValueError(f"data: {index=} must be >= 0")
        e, i = divmod(index, self.steps_per_epoch)
        b = self.batch_size
        start = (i * self.workers + worker) * b
        rows = self._perm(e)[start : start + b]
        x = self.dataset.x_train[rows]
        if self.dataset.shift:
            # Seeded by (seed, worker, index): the same shifts for the same batch on every runtime, and on a retry.
            gen = torch.Generator().manual_seed(((self.seed * 7919 + worker) * 1_000_003 + index) % (2**62))
            x = random_shift(x, self.dataset.shift, self.dataset.image, gen)
        return x, self.dataset.y_train[rows]
