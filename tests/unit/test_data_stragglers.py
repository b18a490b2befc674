"""Data loading, the per-worker batch rule, models and straggler draws."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from collsync.data import Batches, cifar10, digits, mnist, npz, synthetic
from collsync.models import cnn, mlp
from collsync.stragglers import (
    Stragglers,
    gamma_heterogeneous,
    gamma_homogeneous,
    order_statistic_mean,
    rare_delays,
)


def test_digits_is_bundled_and_scaled():
    data = digits()
    assert len(data.y_train) + len(data.y_test) == 1797
    assert data.classes == 10 and data.input_shape == (64,)
    assert 0.0 <= float(data.x_train.min()) and float(data.x_train.max()) <= 1.0
    assert digits(flatten=False).input_shape == (1, 8, 8)


def test_workers_batches_tile_one_big_batch_and_are_disjoint():
    data = synthetic(samples=400, features=5, classes=3)
    one = Batches(data, 1, 24, seed=5)
    four = Batches(data, 4, 6, seed=5)
    for j in (0, 3, four.steps_per_epoch + 1):
        x_big, y_big = one.batch(0, j)
        parts = [four.batch(w, j) for w in range(4)]
        assert torch.equal(torch.cat([x for x, _ in parts]), x_big)
        assert torch.equal(torch.cat([y for _, y in parts]), y_big)
    rows = [tuple(r.tolist()) for w in range(4) for j in range(four.steps_per_epoch) for r in four.batch(w, j)[0]]
    assert len(rows) == len(set(rows))
    assert not torch.equal(Batches(data, 4, 6, seed=6).batch(0, 0)[0], four.batch(0, 0)[0])
    with pytest.raises(ValueError, match="fewer than workers x batch_size"):
        Batches(data, 100, 10)


def _idx(path, array: np.ndarray, zipped: bool = False) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    (gzip.open if zipped else open)(path, "wb").write(raw)


def test_local_files_load_and_fail_clearly(tmp_path):
    images = np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256
    _idx(tmp_path / "train-images-idx3-ubyte.gz", images, zipped=True)
    _idx(tmp_path / "train-labels-idx1-ubyte", np.array([1, 2, 3]))
    _idx(tmp_path / "t10k-images-idx3-ubyte", images[:2])
    _idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([0, 9]))
    data = mnist(str(tmp_path))
    assert data.x_train.shape == (3, 784) and data.classes == 10
    assert float(data.x_train[0, 255]) == pytest.approx(255 / 255.0)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX file"):
        mnist(str(tmp_path))

    cifar = tmp_path / "cifar"
    cifar.mkdir()
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        record = np.concatenate([[7], np.full(3072, 51)]).astype(np.uint8)
        record.tofile(cifar / name)
    data = cifar10(str(cifar))
    assert data.x_train.shape == (5, 3, 32, 32) and int(data.y_test[0]) == 7
    assert float(data.x_train.max()) == pytest.approx(0.2)

    np.savez(tmp_path / "d.npz", x_train=np.zeros((4, 2)), y_train=np.array([0, 1, 0, 1]), x_test=np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"lacks array\(s\) \['y_test'\]"):
        npz(str(tmp_path / "d.npz"))
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        npz(str(tmp_path / "nope.npz"))


def test_models_are_seeded():
    a, b = mlp((64,), 10, seed=1), mlp((64,), 10, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(next(mlp((64,), 10, seed=2).parameters()), next(a.parameters()))
    assert cnn((1, 8, 8), 10)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ValueError, match="must be \\(C, H, W\\)"):
        cnn((64,), 10)


def test_gamma_models_match_their_moments_and_are_order_free():
    homo = gamma_homogeneous(mean=2.0, v_task=0.1, v_mach=0.1).sampler(4, seed=0)
    draws = np.array([homo.compute_time(w, i) for w in range(4) for i in range(2000)])
    assert abs(draws.mean() - 2.0) < 0.5  # q itself is one gamma draw around the mean
    assert 0.05 < draws.std() / draws.mean() < 0.2
    hetero = gamma_heterogeneous(mean=1.0, v_mach=0.6).sampler(200, seed=1)
    means = np.array(hetero.machine_means)
    assert 0.4 < means.std() / means.mean() < 0.8
    forward = [hetero.compute_time(3, i) for i in range(300)]
    backward = [hetero.compute_time(3, i) for i in reversed(range(300))][::-1]
    assert forward == backward
    assert hetero.compute_time(3, 5) == gamma_heterogeneous(mean=1.0, v_mach=0.6).sampler(200, seed=1).compute_time(
        3, 5
    )
    assert order_statistic_mean(hetero, 8, 1, 50) < order_statistic_mean(hetero, 8, 8, 50)


def test_rare_delays_and_validation():
    sampler = rare_delays(delay_prob=0.01, delay=4.0).sampler(2, seed=0)
    late = sum(sampler.message_delay(0, i) == 4.0 for i in range(20_000))
    assert 120 < late < 290
    with pytest.raises(ValueError, match="delay_prob=1.5"):
        Stragglers(delay_prob=1.5)
    with pytest.raises(ValueError, match="v_mach=0"):
        gamma_heterogeneous(v_mach=0)
    with pytest.raises(ValueError, match="compute='weird'"):
        Stragglers(compute="weird")
