"""MNIST's IDX files (Fashion-MNIST's too): finding the four in a folder, reading one (gzipped or not), and the
cache that keeps each gzipped file decompressed between runs, checked by size and sha256 and written atomically.
`collsync.data` builds its datasets from them."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from collsync.datapath import existing

MNIST_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def cache_dir() -> Path:
    """Where decompressed data files are kept between runs: $XDG_CACHE_HOME/collsync, else ~/.cache/collsync."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "collsync"


def gunzip(path: Path, name: str) -> bytes:
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a truncated file ends in EOFError
        raise ValueError(f"{name}: {str(path)!r} cannot be read ({e})") from e


def write_atomic(path: Path, data: bytes) -> None:
    """`data` in `path` by a temporary file renamed over it: a reader (another rank, say) sees the old file or the
    new one whole, and two writers of the same bytes cannot interleave."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cachedgunzip(path: Path, name: str, cache: Path) -> bytes:
    """The decompressed bytes of the gzipped `path`, decompressed once and kept in `cache`.

    A cached copy is used only where its size and sha256 match the ones recorded beside it when it was written, so
    a truncated or damaged copy is decompressed and written again. The copy's name holds a hash of the source's
    path, size and modification time: a changed source (a new version of the package) gets a copy of its own. Where
    `cache` cannot be written the bytes are still returned: the next load decompresses again, nothing else.
    """
    stat = path.stat()
    source = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    copy = cache / f"{path.name.removesuffix('.gz')}-{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    record = copy.with_name(copy.name + ".json")
    try:
        expected = json.loads(record.read_text())
        if copy.stat().st_size == expected["size"]:  # a truncated copy costs no read
            raw = copy.read_bytes()
            if len(raw) == expected["size"] and hashlib.sha256(raw).hexdigest() == expected["sha256"]:
                return raw
    except (OSError, ValueError, KeyError, TypeError):  # no copy yet, or its record unreadable: decompress again
        pass
    raw = gunzip(path, name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        write_atomic(copy, raw)  # the copy before its record: a record never vouches for a copy not yet written
        entry = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest(), "source": str(path)}
        write_atomic(record, (json.dumps(entry) + "\n").encode())
    except OSError:
        pass
    return raw


def read_idx(path: Path, name: str = "mnist", cache: Path | None = None) -> np.ndarray:
    """An IDX file of unsigned bytes: magic 0x00 0x00 0x08 <ndim>, ndim big-endian uint32 sizes, then the data.

    A gzipped file is decompressed in memory, or once into `cache` (see `cached_gunzip`) where one is given."""
    if path.suffix == ".gz":
        raw = gunzip(path, name) if cache is None else _cachedgunzip(path, name, cache)
    else:
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ValueError(f"{name}: {str(path)!r} cannot be read ({e})") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] == 0:
        raise ValueError(f"{name}: {str(path)!r} is not an IDX file of unsigned bytes (magic {raw[:4].hex()})")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{name}: {str(path)!r} is truncated inside its {ndim}-dimension header")
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{name}: {str(path)!r} holds {data.size} bytes of data, its header says {dims.tolist()}")
    return data.reshape(dims)


def find_idx(folder: Path, stem: str, name: str = "mnist") -> Path:
    # The original names, gzipped or not, and the "train-images.idx3-ubyte" spelling some mirrors use.
    dotted = stem.replace("-idx", ".idx")
    for file in (stem, f"{stem}.gz", dotted, f"{dotted}.gz"):
        if (folder / file).is_file():
            return folder / file
    raise FileNotFoundError(f"{name}: path={str(folder)!r} has no {stem} (or {stem}.gz)")


def idx_files(name: str, path: str) -> list[Path]:
    """The four IDX files of MNIST's layout in the folder `path`, in `MNIST_STEMS`' order."""
    folder = existing(name, Path(path))
    return [find_idx(folder, stem, name) for stem in MNIST_STEMS]
