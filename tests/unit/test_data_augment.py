"""Random shifts of the digits (data.shift): every training batch moved by up to `shift` pixels, the same on every
runtime for the same (seed, worker, index); the test set untouched."""

from __future__ import annotations

import pytest
import torch

from collsync.data import Batches, digits, random_shift


def test_shifted_batches_are_shifts_of_the_plain_ones() -> None:
    plain, shifted = digits(flatten=False), digits(flatten=False, shift=1)
    assert torch.equal(plain.x_test, shifted.x_test) and torch.equal(plain.x_train, shifted.x_train)
    a, b = Batches(plain, 4, 16, seed=3), Batches(shifted, 4, 16, seed=3)
    moved = 0
    for worker, index in ((0, 0), (3, 5), (1, 200)):
        (xa, ya), (xb, yb) = a.batch(worker, index), b.batch(worker, index)
        assert torch.equal(ya, yb) and xb.shape == xa.shape == (16, 1, 8, 8)
        for img, out in zip(xa, xb, strict=True):
            # Some shift (dy, dx) in -1..1 maps the plain image onto the shifted one (zero fill at the edge).
            padded = torch.nn.functional.pad(img, (1, 1, 1, 1))
            matches = [
                (dy, dx) for dy in range(3) for dx in range(3) if torch.equal(padded[:, dy : dy + 8, dx : dx + 8], out)
            ]
            assert matches, "a shifted image is not a shift of its source"
            moved += (1, 1) not in matches
    assert moved > 20  # of 48 images, about 8 in 9 move


def test_shifts_are_reproducible_and_differ_across_batches() -> None:
    data = digits(shift=1)  # flat rows: shifted as 8x8 images
    b1, b2 = Batches(data, 2, 32, seed=0), Batches(data, 2, 32, seed=0)
    assert torch.equal(b1.batch(1, 7)[0], b2.batch(1, 7)[0])
    assert not torch.equal(b1.batch(1, 7)[0], b1.batch(1, 7 + b1.steps_per_epoch)[0])  # same rows, new shifts
    assert b1.batch(0, 0)[0].shape == (32, 64)
    # Mass is kept or lost at the border only, never created.
    x = b1.batch(0, 3)[0]
    plain = Batches(digits(), 2, 32, seed=0).batch(0, 3)[0]
    assert torch.all(x.sum(1) <= plain.sum(1) + 1e-5)


def test_random_shift_zero_is_the_identity() -> None:
    x = torch.rand(4, 1, 8, 8)
    assert random_shift(x, 0, None, torch.Generator().manual_seed(0)) is x


@pytest.mark.parametrize("shift", [-1, 8])
def test_bad_shift_is_refused_naming_it(shift: int) -> None:
    with pytest.raises(ValueError, match=f"digits: shift={shift} must be an integer in 0..7"):
        digits(shift=shift)
