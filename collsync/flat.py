"""A torch.nn.Module whose parameters and gradients are views into two flat buffers.

Runtimes move one contiguous tensor per step (a single MPI_Put, one Iallreduce bucket list, one copy in the
simulator) instead of a list of per-layer tensors; rules see one vector.
"""

from __future__ import annotations

import torch
from torch import nn

from collsync.types import Flat


class FlatModel:
    """Rebinds every parameter of `module` to a slice of `self.params`, and every `.grad` to a slice of `self.grads`.

    `layers` lists (name, start, stop) for each parameter tensor, for layer-wise statistics and rules.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("FlatModel: the module has no trainable parameters")
        dtype = named[0][1].dtype
        total = sum(p.numel() for _, p in named)
        self.params: Flat = torch.zeros(total, dtype=dtype)
        self.grads: Flat = torch.zeros(total, dtype=dtype)
        self.layers: list[tuple[str, int, int]] = []
        offset = 0
        with torch.no_grad():
            for name, p in named:
                n = p.numel()
                self.params[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.params[offset : offset + n].view_as(p)
                p.grad = self.grads[offset : offset + n].view_as(p)
                self.layers.append((name, offset, offset + n))
                offset += n

    @property
    def numel(self) -> int:
        return self.params.numel()

    def load(self, flat: Flat) -> None:
        """Copy a flat vector into the model's parameters (in place: the views stay valid)."""
        with torch.no_grad():
            self.params.copy_(flat)

    def zero_grad(self) -> None:
        self.grads.zero_()
        # Autograd may have replaced a .grad it found missing; put the views back.
        for p, (_, start, stop) in zip(self._trainable(), self.layers, strict=True):
            if p.grad is None or p.grad.data_ptr() != self.grads[start:stop].data_ptr():
                p.grad = self.grads[start:stop].view_as(p)

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]
