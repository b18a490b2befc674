"""Small models for the bundled and local data sets: an MLP and a small CNN, float32, initialised from a seed.

The configs (conf/model/*.yaml) are partial (`_partial_: true`): the CLI supplies `input_shape` and `classes` from
the data set and `seed` from the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn


def _init(module: nn.Module, seed: int) -> nn.Module:
    """Re-initialise every Linear and Conv2d from a private generator: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for
    weights and biases, the bound of PyTorch's own default (kaiming_uniform with a = sqrt(5)).

    A private generator makes the same seed give bit-identical weights whatever the global RNG state (several ranks,
    several runs in one process), and the draw order is the module order, so it never depends on anything else.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                bound = 1.0 / math.sqrt(m.weight[0].numel())
                m.weight.uniform_(-bound, bound, generator=gen)
                if m.bias is not None:
                    m.bias.uniform_(-bound, bound, generator=gen)
    return module


def _seeded(make: Callable[[], list[nn.Module]], seed: int) -> nn.Module:
    # Layer constructors draw PyTorch's default init from the global RNG; fork it so that building a model leaves
    # the caller's random stream where it was (the weights are redrawn from `seed` anyway).
    with torch.random.fork_rng(devices=[]):
        layers = make()
    return _init(nn.Sequential(*layers), seed)


def _shape(name: str, input_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"{name}: input_shape={shape} must be non-empty with positive sizes")
    return shape


def mlp(input_shape: Sequence[int], classes: int, hidden: Sequence[int] = (64,), seed: int = 0) -> nn.Module:
    """Flatten -> [Linear -> ReLU] per entry of `hidden` -> Linear(classes); logits out."""
    shape = _shape("mlp", input_shape)
    widths = [int(h) for h in hidden]
    if classes < 2:
        raise ValueError(f"mlp: {classes=} must be >= 2")
    if any(h < 1 for h in widths):
        raise ValueError(f"mlp: hidden={widths} must hold positive widths")

    def make() -> list[nn.Module]:
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(shape)
        for h in widths:
            layers += [nn.Linear(width, h, dtype=torch.float32), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, classes, dtype=torch.float32))
        return layers

    return _seeded(make, seed)


def cnn(
    input_shape: Sequence[int],
    classes: int,
    channels: Sequence[int] = (16, 32),
    hidden: int = 64,
    seed: int = 0,
) -> nn.Module:
    """[Conv3x3 (padding 1) -> ReLU -> MaxPool2] per entry of `channels`, then Flatten -> Linear(hidden) -> ReLU ->
    Linear(classes); logits out.

    Needs image-shaped input (C, H, W): load the data with `flatten=false`. Pooling stops once a side is 1, so inputs
    as small as 1x8x8 (digits) work with any number of conv layers.
    """
    shape = _shape("cnn", input_shape)
    if len(shape) != 3:
        # Where the data are images the loader flattened, `flatten=false` is the fix; rows stored flat have no
        # image shape to give back, whatever `flatten` says.
        raise ValueError(
            f"cnn: input_shape={shape} must be (C, H, W): load image data with data.flatten=false; data stored as "
            f"flat rows of {shape[0] if len(shape) == 1 else shape} features have no image shape (save them as "
            "(N, C, H, W), or use model=mlp)"
        )
    widths = [int(c) for c in channels]
    if classes < 2:
        raise ValueError(f"cnn: {classes=} must be >= 2")
    if not widths or any(c < 1 for c in widths):
        raise ValueError(f"cnn: channels={widths} must hold at least one positive width")
    if hidden < 1:
        raise ValueError(f"cnn: {hidden=} must be >= 1")

    def make() -> list[nn.Module]:
        c, h, w = shape
        layers: list[nn.Module] = []
        for out in widths:
            layers += [nn.Conv2d(c, out, 3, padding=1, dtype=torch.float32), nn.ReLU()]
            if min(h, w) >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c = out
        layers += [
            nn.Flatten(),
            nn.Linear(c * h * w, hidden, dtype=torch.float32),
            nn.ReLU(),
            nn.Linear(hidden, classes, dtype=torch.float32),
        ]
        return layers

    return _seeded(make, seed)
