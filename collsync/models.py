"""Small models for the bundled and local data sets: an MLP and a small CNN, initialised from a seed."""

from __future__ import annotations

import math

import torch
from torch import nn


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    # Re-initialise every layer from a private generator: the same seed gives bit-identical weights whatever the
    # global RNG state (several ranks, several runs in one process).
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                fan_in = m.weight[0].numel()
                bound = 1.0 / math.sqrt(fan_in)
                m.weight.uniform_(-bound, bound, generator=gen)
                if m.bias is not None:
                    m.bias.uniform_(-bound, bound, generator=gen)
    return module


def mlp(input_shape: tuple[int, ...], classes: int, hidden: list[int] | None = None, seed: int = 0) -> nn.Module:
    """Flatten -> [Linear -> ReLU] x len(hidden) -> Linear(classes)."""
    hidden = [64] if hidden is None else list(hidden)
    if classes < 2:
        raise ValueError(f"mlp: {classes=} must be >= 2")
    if any(h < 1 for h in hidden):
        raise ValueError(f"mlp: {hidden=} must hold positive widths")
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return _seeded(nn.Sequential(*layers), seed)


def cnn(
    input_shape: tuple[int, ...], classes: int, channels: list[int] | None = None, hidden: int = 64, seed: int = 0
) -> nn.Module:
    """[Conv3x3 -> ReLU -> MaxPool2] per entry of `channels`, then Linear(hidden) -> ReLU -> Linear(classes).

    Needs image-shaped input (C, H, W): load the data with `flatten=false`.
    """
    channels = [16, 32] if channels is None else list(channels)
    if len(input_shape) != 3:
        raise ValueError(f"cnn: {input_shape=} must be (C, H, W); load the data with flatten=false")
    c, h, w = input_shape
    layers: list[nn.Module] = []
    for out in channels:
        layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU()]
        if min(h, w) >= 2:
            layers.append(nn.MaxPool2d(2))
            h, w = h // 2, w // 2
        c = out
    layers += [nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(), nn.Linear(hidden, classes)]
    return _seeded(nn.Sequential(*layers), seed)
