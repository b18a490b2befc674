"""Data sets, the local-file loaders (on real tiny files) and the per-worker batch rule."""

from __future__ import annotations

import gzip
import hashlib
import inspect
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from collsync import bundled
from collsync import data as data_module
from collsync import idx as idx_module
from collsync.data import (
    FASHION_MNIST_DIR,
    Batches,
    Dataset,
    cifar10,
    digits,
    fashion_mnist,
    mnist,
    npz,
    synthetic,
)

CONF = Path(__file__).resolve().parents[2] / "conf"


# --- bundled and generated data ---------------------------------------------------------------------------------


def test_digits_is_bundled_scaled_and_split_by_seed():
    data = digits()
    assert len(data.y_train) + len(data.y_test) == 1797
    assert len(data.y_test) == round(1797 * 0.25)
    assert data.classes == 10 and data.name == "digits" and data.input_shape == (64,)
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    assert float(data.x_train.min()) == 0.0 and float(data.x_train.max()) == 1.0  # 16 / 16
    assert set(data.y_train.tolist()) == set(range(10))
    images = digits(flatten=False)
    assert images.input_shape == (1, 8, 8)
    assert torch.equal(images.x_train.reshape(len(images.x_train), -1), data.x_train)
    assert torch.equal(digits().x_train, data.x_train)
    assert not torch.equal(digits(seed=1).y_train, data.y_train)
    with pytest.raises(ValueError, match=r"digits: test_fraction=1\.0 must be in \(0, 1\)"):
        digits(test_fraction=1.0)


def test_the_digits_read_without_scikit_learn_are_load_digits_bit_for_bit(monkeypatch):
    """collsync.bundled reads the CSV inside scikit-learn's wheel instead of importing it; the arrays are the ones
    load_digits returns, with the same dtypes, and where the file is not found load_digits itself is the answer."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    for pixels, labels in (bundled.digits_arrays(), _without_the_file(monkeypatch)):
        assert pixels.dtype == bunch.data.dtype and labels.dtype == np.int64
        assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)


def _without_the_file(monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    monkeypatch.setattr(bundled, "DIGITS_CSV", ("no", "such", "file.csv.gz"))
    return bundled.digits_arrays()


def test_synthetic_is_seeded_and_learnable():
    data = synthetic(samples=800, features=10, classes=5, noise=0.1, seed=3)
    assert data.input_shape == (10,) and data.classes == 5 and len(data.y_train) + len(data.y_test) == 800
    assert data.x_train.dtype == torch.float32
    again = synthetic(samples=800, features=10, classes=5, noise=0.1, seed=3)
    assert torch.equal(again.x_train, data.x_train) and torch.equal(again.y_test, data.y_test)
    assert not torch.equal(synthetic(samples=800, features=10, classes=5, seed=4).x_train, data.x_train)
    # Learnable: nearest class mean of the training rows classifies the test rows.
    means = torch.stack([data.x_train[data.y_train == k].mean(0) for k in range(5)])
    predicted = torch.cdist(data.x_test, means).argmin(1)
    assert (predicted == data.y_test).float().mean() > 0.95


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"samples": 5, "classes": 4}, r"synthetic: samples=5 must be >= 2 \* classes=8"),
        ({"classes": 1}, "synthetic: classes=1 must be >= 2"),
        ({"features": 0}, "synthetic: features=0 must be >= 1"),
        ({"noise": -0.5}, "synthetic: noise=-0.5 must be >= 0"),
        ({"test_fraction": 0.0}, "synthetic: test_fraction=0.0 must be in"),
    ],
)
def test_synthetic_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        synthetic(**kwargs)


# --- the batch rule -----------------------------------------------------------------------------------------------


def _rows(m: int) -> Dataset:
    """A data set whose features are the row numbers: batches show which rows they hold."""
    x = torch.arange(m, dtype=torch.float32).unsqueeze(1)
    return Dataset(x, torch.arange(m) % 3, x[:4], torch.arange(4) % 3, 3, "rows")


@pytest.mark.parametrize(("workers", "batch"), [(4, 6), (3, 5), (2, 16), (1, 7)])
def test_n_workers_tile_one_worker_at_n_times_the_batch(workers, batch):
    data = synthetic(samples=400, features=5, classes=3)
    many, one = Batches(data, workers, batch, seed=5), Batches(data, 1, workers * batch, seed=5)
    assert many.steps_per_epoch == one.steps_per_epoch
    for j in (0, 1, many.steps_per_epoch - 1, many.steps_per_epoch, 3 * many.steps_per_epoch + 2):
        x_big, y_big = one.batch(0, j)
        parts = [many.batch(w, j) for w in range(workers)]
        assert torch.equal(torch.cat([x for x, _ in parts]), x_big)  # bitwise, same order
        assert torch.equal(torch.cat([y for _, y in parts]), y_big)


def test_the_rule_is_exactly_the_documented_slice():
    m, n, b, seed = 103, 3, 4, 7
    batches = Batches(_rows(m), n, b, seed=seed)
    spe = m // (n * b)
    assert batches.steps_per_epoch == spe == 8
    for w in range(n):
        for j in (0, 5, spe, 2 * spe + 3):
            e, i = j // spe, j % spe
            perm = torch.randperm(m, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))
            x, y = batches.batch(w, j)
            assert x[:, 0].long().tolist() == perm[(i * n + w) * b : (i * n + w + 1) * b].tolist()
            assert torch.equal(y, x[:, 0].long() % 3)
            assert batches.epoch_of(j) == e


def test_workers_rows_are_disjoint_within_an_epoch_and_reshuffled_across():
    m, n, b = 100, 4, 5
    batches = Batches(_rows(m), n, b, seed=1)
    spe = batches.steps_per_epoch

    def epoch(e: int) -> list[int]:
        return [int(r) for j in range(e * spe, (e + 1) * spe) for w in range(n) for r in batches.batch(w, j)[0][:, 0]]

    first, second = epoch(0), epoch(1)
    assert len(first) == len(set(first)) == spe * n * b == 100
    assert len(set(second)) == 100 and first != second
    assert all(batches.epoch_of(j) == 1 for j in range(spe, 2 * spe))


def test_batches_are_seeded_and_order_free():
    data = _rows(64)
    a, b = Batches(data, 2, 4, seed=3), Batches(data, 2, 4, seed=3)
    forward = [a.batch(w, j)[0] for j in range(20) for w in range(2)]
    backward = [b.batch(w, j)[0] for j in reversed(range(20)) for w in reversed(range(2))][::-1]
    assert all(torch.equal(x, y) for x, y in zip(forward, backward, strict=True))
    assert not torch.equal(Batches(data, 2, 4, seed=4).batch(0, 0)[0], a.batch(0, 0)[0])


def test_batches_reject_bad_shapes():
    data = _rows(50)
    with pytest.raises(ValueError, match=r"50 training rows, fewer than workers x batch_size = 8 x 7"):
        Batches(data, 8, 7)
    with pytest.raises(ValueError, match="workers=0 must be >= 1"):
        Batches(data, 0, 4)
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        Batches(data, 2, 0)
    batches = Batches(data, 2, 4)
    with pytest.raises(ValueError, match=r"worker=2 outside 0\.\.1"):
        batches.batch(2, 0)
    with pytest.raises(ValueError, match="index=-1 must be >= 0"):
        batches.batch(0, -1)


# --- local files ----------------------------------------------------------------------------------------------------


def _idx(path: Path, array: np.ndarray, zipped: bool = False) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    with gzip.open(path, "wb") if zipped else open(path, "wb") as f:
        f.write(raw)


def _mnist_folder(folder: Path, zipped: bool = False) -> tuple[np.ndarray, np.ndarray]:
    folder.mkdir(exist_ok=True)
    images = (np.arange(4 * 28 * 28).reshape(4, 28, 28) % 256).astype(np.uint8)
    suffix = ".gz" if zipped else ""
    _idx(folder / f"train-images-idx3-ubyte{suffix}", images, zipped)
    _idx(folder / f"train-labels-idx1-ubyte{suffix}", np.array([1, 2, 3, 4]), zipped)
    _idx(folder / f"t10k-images-idx3-ubyte{suffix}", images[:2], zipped)
    _idx(folder / f"t10k-labels-idx1-ubyte{suffix}", np.array([0, 9]), zipped)
    return images, np.array([1, 2, 3, 4])


@pytest.mark.parametrize("zipped", [False, True], ids=["plain", "gz"])
def test_mnist_reads_idx_files(tmp_path, zipped):
    images, labels = _mnist_folder(tmp_path, zipped)
    data = mnist(str(tmp_path))
    assert data.name == "mnist" and data.classes == 10
    assert data.x_train.shape == (4, 784) and data.x_test.shape == (2, 784)
    assert data.x_train.dtype == torch.float32 and data.y_train.tolist() == labels.tolist()
    assert data.y_test.tolist() == [0, 9]
    expected = torch.from_numpy(images.reshape(4, -1).astype(np.float32) / 255.0)
    assert torch.equal(data.x_train, expected)
    assert float(data.x_train[0, 255]) == 1.0 and float(data.x_train[0, 0]) == 0.0
    assert mnist(str(tmp_path), flatten=False).input_shape == (1, 28, 28)


def test_mnist_fails_clearly(tmp_path):
    _mnist_folder(tmp_path)
    labels = tmp_path / "t10k-labels-idx1-ubyte"
    labels.write_bytes(b"\x01\x02\x03\x04\x00")
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte' is not an IDX file .*magic 01020304"):
        mnist(str(tmp_path))
    labels.write_bytes(bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 1) + b"\x00" * 4)  # float32 IDX: not MNIST's
    with pytest.raises(ValueError, match=r"not an IDX file of unsigned bytes \(magic 00000d01\)"):
        mnist(str(tmp_path))
    labels.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + b"\x00\x01")  # says 5 labels, holds 2
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte' holds 2 bytes of data, its header says \[5\]"):
        mnist(str(tmp_path))
    _idx(labels, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"has 2 images but .*t10k-labels-idx1-ubyte' 3 labels"):
        mnist(str(tmp_path))
    labels.unlink()
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz' cannot be read"):
        mnist(str(tmp_path))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no t10k-labels-idx1-ubyte \(or t10k-labels-idx1-ubyte\.gz\)"):
        mnist(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        mnist(str(tmp_path / "nowhere"))


# Fashion-MNIST: MNIST's layout under its own factory, with a default folder and a cache of the decompressed files.

INSTALL = r"install Debian's package dataset-fashion-mnist \(as root: apt-get install dataset-fashion-mnist\)"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user cache moved into the test's folder: the folder the decompressed files go to."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "collsync"


def _gunzips(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files decompressed from here on (the cache answers the others)."""
    seen: list[Path] = []
    real = idx_module.gunzip

    def counted(path: Path, name: str) -> bytes:
        seen.append(path)
        return real(path, name)

    monkeypatch.setattr(idx_module, "gunzip", counted)
    return seen


def _copies(cache: Path, stem: str) -> list[Path]:
    """The cached decompressed copies of the file `stem` (not their .json records)."""
    return [p for p in cache.glob(f"{stem}-*") if p.suffix != ".json"]


def test_fashion_mnist_defaults_to_the_debian_packages_folder() -> None:
    assert FASHION_MNIST_DIR == "/usr/share/datasets/fashion-mnist"
    assert inspect.signature(fashion_mnist).parameters["path"].default == FASHION_MNIST_DIR


def test_fashion_mnist_reads_the_idx_layout_as_mnist_does(tmp_path: Path, cache: Path) -> None:
    _mnist_folder(tmp_path / "f", zipped=True)
    data = fashion_mnist(str(tmp_path / "f"))
    same = mnist(str(tmp_path / "f"))
    assert data.name == "fashion_mnist" and data.classes == 10 and data.input_shape == (784,)
    for a, b in zip(data[:4], same[:4], strict=True):
        assert torch.equal(a, b)
    assert fashion_mnist(str(tmp_path / "f"), flatten=False).input_shape == (1, 28, 28)
    assert torch.equal(fashion_mnist(str(tmp_path / "f"), cache=False).x_train, data.x_train)


@pytest.mark.parametrize("where", ["folder", "file"])
def test_fashion_mnist_missing_names_the_package_and_its_install_command(tmp_path: Path, where: str) -> None:
    if where == "folder":
        path, missing = tmp_path / "nowhere", r"path='[^']*nowhere' does not exist"
    else:
        _mnist_folder(tmp_path, zipped=True)
        (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
        path, missing = tmp_path, r"path='[^']*' has no t10k-images-idx3-ubyte \(or t10k-images-idx3-ubyte\.gz\)"
    with pytest.raises(FileNotFoundError) as caught:
        fashion_mnist(str(path))
    message = str(caught.value)
    assert "\n" not in message
    assert re.match(rf"fashion_mnist: {missing}: {INSTALL}, or set data\.path to a folder holding", message), message


def test_a_truncated_fashion_mnist_file_is_named(tmp_path: Path, cache: Path) -> None:
    _mnist_folder(tmp_path / "f", zipped=True)
    file = tmp_path / "f" / "train-images-idx3-ubyte.gz"
    file.write_bytes(file.read_bytes()[:-20])  # the end of the stream lost, as a download cut short
    with pytest.raises(ValueError, match=r"^fashion_mnist: '[^']*train-images-idx3-ubyte\.gz' cannot be read \("):
        fashion_mnist(str(tmp_path / "f"))
    assert not _copies(cache, "train-images-idx3-ubyte"), "a file that did not decompress was cached"


def test_fashion_mnist_decompresses_once_then_reads_the_cache(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _mnist_folder(tmp_path / "f", zipped=True)
    gunzipped = _gunzips(monkeypatch)
    first = fashion_mnist(str(tmp_path / "f"))
    assert len(gunzipped) == 4
    copies = [copy for stem in idx_module.MNIST_STEMS for copy in _copies(cache, stem)]
    assert len(copies) == 4
    for copy in copies:
        record = json.loads(copy.with_name(copy.name + ".json").read_text())
        raw = copy.read_bytes()
        assert record["size"] == len(raw) and record["sha256"] == hashlib.sha256(raw).hexdigest()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")], "a temporary file was left behind"
    again = fashion_mnist(str(tmp_path / "f"))
    assert len(gunzipped) == 4  # nothing decompressed the second time
    assert torch.equal(again.x_train, first.x_train) and torch.equal(again.y_test, first.y_test)


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "record"])
def test_a_damaged_cache_is_rebuilt(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    _mnist_folder(tmp_path / "f", zipped=True)
    first = fashion_mnist(str(tmp_path / "f"))
    (copy,) = _copies(cache, "train-images-idx3-ubyte")
    good = copy.read_bytes()
    if damage == "truncated":
        copy.write_bytes(good[: len(good) // 2])
    elif damage == "corrupt":  # same size, one pixel changed: only the hash tells
        copy.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    else:
        copy.with_name(copy.name + ".json").write_text("{not json")
    gunzipped = _gunzips(monkeypatch)
    again = fashion_mnist(str(tmp_path / "f"))
    assert [p.name for p in gunzipped] == ["train-images-idx3-ubyte.gz"]  # that file alone decompressed again
    assert torch.equal(again.x_train, first.x_train)
    assert copy.read_bytes() == good
    fashion_mnist(str(tmp_path / "f"))
    assert len(gunzipped) == 1  # and read from the cache again afterwards


def test_a_changed_source_gets_a_copy_of_its_own(tmp_path: Path, cache: Path) -> None:
    _mnist_folder(tmp_path / "f", zipped=True)
    fashion_mnist(str(tmp_path / "f"))
    _idx(tmp_path / "f" / "train-labels-idx1-ubyte.gz", np.array([4, 3, 2, 1]), zipped=True)
    assert fashion_mnist(str(tmp_path / "f")).y_train.tolist() == [4, 3, 2, 1]
    assert len(_copies(cache, "train-labels-idx1-ubyte")) == 2


def test_fashion_mnist_loads_where_the_cache_cannot_be_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _mnist_folder(tmp_path / "f", zipped=True)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # its collsync folder cannot be made
    assert fashion_mnist(str(tmp_path / "f")).x_train.shape == (4, 784)


def test_the_cache_folder_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert idx_module.cache_dir() == tmp_path / "collsync"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: relative paths are invalid
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert idx_module.cache_dir() == tmp_path / "home" / ".cache" / "collsync"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert idx_module.cache_dir() == tmp_path / "home" / ".cache" / "collsync"


def _cifar_folder(folder: Path, per_file: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for f, name in enumerate(names):
        records = []
        for r in range(per_file):
            label = (f * per_file + r) % 10
            # Red plane 51, green plane 102, blue plane 255: the channel order must survive the reshape.
            planes = np.concatenate([np.full(1024, 51), np.full(1024, 102), np.full(1024, 255)])
            records.append(np.concatenate([[label], planes]))
        np.concatenate(records).astype(np.uint8).tofile(folder / name)


def test_cifar10_reads_binary_records(tmp_path):
    _cifar_folder(tmp_path / "c")
    data = cifar10(str(tmp_path / "c"))
    assert data.name == "cifar10" and data.classes == 10
    assert data.x_train.shape == (10, 3, 32, 32) and data.x_test.shape == (2, 3, 32, 32)
    assert data.y_train.tolist() == list(range(10)) and data.y_test.tolist() == [0, 1]
    assert float(data.x_train[:, 0].min()) == float(data.x_train[:, 0].max()) == pytest.approx(0.2)
    assert float(data.x_train[:, 1].max()) == pytest.approx(0.4) and float(data.x_train[:, 2].max()) == 1.0
    assert cifar10(str(tmp_path / "c"), flatten=True).input_shape == (3072,)
    # The folder that holds the extracted archive works too.
    _cifar_folder(tmp_path / "outer" / "cifar-10-batches-bin")
    assert cifar10(str(tmp_path / "outer")).x_train.shape == (10, 3, 32, 32)


def test_cifar10_fails_clearly(tmp_path):
    _cifar_folder(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(b"\x00" * 3000)
    with pytest.raises(ValueError, match=r"test_batch\.bin' is 3000 bytes, not a whole number of 3073-byte records"):
        cifar10(str(tmp_path))
    np.concatenate([[12], np.zeros(3072)]).astype(np.uint8).tofile(tmp_path / "test_batch.bin")
    with pytest.raises(ValueError, match=r"test_batch\.bin' has label 12"):
        cifar10(str(tmp_path))
    (tmp_path / "data_batch_3.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no data_batch_3\.bin"):
        cifar10(str(tmp_path))


def test_npz_reads_the_documented_keys(tmp_path):
    rng = np.random.default_rng(0)
    x_train, x_test = rng.random((6, 2, 3)), rng.random((3, 2, 3))
    file = tmp_path / "d.npz"
    np.savez(file, x_train=x_train, y_train=np.array([0, 1, 2, 0, 1, 4]), x_test=x_test, y_test=np.array([1.0, 0, 2]))
    data = npz(str(file))
    assert data.name == "npz" and data.classes == 5 and data.input_shape == (6,)
    assert torch.equal(data.x_train, torch.from_numpy(x_train.reshape(6, -1).astype(np.float32)))
    assert data.y_test.dtype == torch.int64 and data.y_test.tolist() == [1, 0, 2]
    assert npz(str(file), flatten=False).input_shape == (2, 3)


def test_npz_fails_clearly(tmp_path):
    file = tmp_path / "d.npz"
    np.savez(file, x_train=np.zeros((4, 2)), y_train=np.array([0, 1, 0, 1]), x_test=np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"d\.npz' lacks array\(s\) \['y_test'\]"):
        npz(str(file))
    with pytest.raises(FileNotFoundError, match=r"npz: path='.*nope\.npz' does not exist"):
        npz(str(tmp_path / "nope.npz"))
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(ValueError, match=r"one\.npy' holds a single array"):
        npz(str(tmp_path / "one.npy"))
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"junk\.npz' is not a readable \.npz archive"):
        npz(str(tmp_path / "junk.npz"))
    np.savez(file, x_train=np.zeros((2, 2)), y_train=np.array([0, -1]), x_test=np.zeros((1, 2)), y_test=np.array([0]))
    with pytest.raises(ValueError, match="train labels must be >= 0"):
        npz(str(file))
    np.savez(file, x_train=np.zeros((3, 2)), y_train=np.array([0, 1]), x_test=np.zeros((1, 2)), y_test=np.array([0]))
    with pytest.raises(ValueError, match="must have the same rows"):
        npz(str(file))


# --- configs ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["digits", "synthetic", "npz", "mnist", "fashion_mnist", "cifar10"])
def test_data_configs_name_the_factory_kwargs(option):
    cfg = OmegaConf.load(CONF / "data" / f"{option}.yaml")
    assert cfg._target_ == f"collsync.data.{option}"
    params = inspect.signature(getattr(data_module, option)).parameters
    for key in cfg:
        if key == "_target_":
            continue
        assert key in params
        if OmegaConf.is_missing(cfg, key):
            assert params[key].default is inspect.Parameter.empty  # a required value stays required
        else:
            assert cfg[key] == params[key].default


def test_data_fashion_mnist_resolves_to_the_debian_folder_and_says_how_to_install_it(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from collsync import schema
    from collsync.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["data=fashion_mnist"])
        moved = compose(config_name="config", overrides=["data=fashion_mnist", f"data.path={tmp_path / 'none'}"])
    schema.check(cfg)
    assert cfg.data.path == FASHION_MNIST_DIR and cfg.data.cache is True
    # Hydra wraps the error (collsync-train prints its message alone: tests/integration/test_bad_inputs.py).
    with pytest.raises(Exception, match=rf"'[^']*none' does not exist: {INSTALL}, or set data\.path"):
        instantiate(moved.data)


# --- the data checked whole at load ---------------------------------------------------------------------------------


def _npz(path: Path, **arrays: np.ndarray) -> str:
    ok = {"x_train": np.zeros((6, 4)), "y_train": np.arange(6) % 3, "x_test": np.zeros((2, 4)), "y_test": np.arange(2)}
    np.savez(path, **{**ok, **arrays})
    return str(path)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        # The cases: features of another width in the test split, a test label beyond the classes.
        ({"x_test": np.zeros((2, 2))}, r"d\.npz': x_test has rows of shape \(2,\) but x_train \(4,\), the model's"),
        ({"y_test": np.array([1, 42])}, r"d\.npz': y_test row 1 holds label 42, outside \[0, 3\) \(the classes y_tra"),
        ({"x_test": np.zeros((0, 4)), "y_test": np.zeros(0)}, r"the test split is empty \(x_test and y_test have 0"),
        ({"y_train": np.array([0, 1, 2, 1, -1, -2])}, r"train labels must be >= 0 \(found -2; y_train row 4 holds -1"),
        ({"y_test": np.array([0.0, 1.5])}, r"test labels must be whole numbers \(got dtype float64; y_test row 1 "),
        (
            {"y_train": np.array([0, 1, 2, 1, np.inf, 0])},
            r"train labels must be whole .*y_train row 4 holds inf",
        ),
        ({"x_test": np.array([[0, 0, 0, 0], [0, 0, np.nan, 0]])}, r"test features hold non-finite .* in x_test row 1"),
    ],
    ids=["width", "test-label", "empty-test", "negative", "fraction", "infinite", "nan"],
)
def test_npz_is_checked_whole_naming_the_array_and_row(tmp_path: Path, arrays: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        npz(_npz(tmp_path / "d.npz", **arrays))


def test_npz_image_rows_must_match_too(tmp_path: Path) -> None:
    file = _npz(tmp_path / "d.npz", x_train=np.zeros((6, 1, 4, 4)), x_test=np.zeros((2, 1, 4, 3)))
    with pytest.raises(ValueError, match=r"x_test has rows of shape \(1, 4, 3\) but x_train \(1, 4, 4\)"):
        npz(file, flatten=False)
    with pytest.raises(ValueError, match=r"x_test has rows of shape \(12,\) but x_train \(16,\)"):
        npz(file)
    assert npz(_npz(tmp_path / "ok.npz")).classes == 3  # the training labels' largest + 1


def test_mnist_is_checked_whole_naming_the_file(tmp_path: Path) -> None:
    _mnist_folder(tmp_path)
    _idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([3, 12]))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte' row 1 holds label 12, outside \[0, 10\)$"):
        mnist(str(tmp_path))
    _idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([3, 1]))
    _idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((2, 20, 20)))
    for flatten, shapes in ((True, r"\(400,\) but .*train-images-idx3-ubyte' \(784,\)"), (False, r"\(1, 20, 20\)")):
        with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte' has rows of shape " + shapes):
            mnist(str(tmp_path), flatten=flatten)


@pytest.mark.parametrize("make", [lambda: digits(), lambda: digits(flatten=False), lambda: synthetic(samples=100)])
def test_bundled_and_generated_data_pass_the_checks(make) -> None:
    data = make()
    assert data.x_test.shape[1:] == data.x_train.shape[1:] == data.input_shape
    for y in (data.y_train, data.y_test):
        assert len(y) > 0 and 0 <= int(y.min()) and int(y.max()) < data.classes
