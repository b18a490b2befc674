"""Parameters as one flat buffer: `ParamBuffer` (a list of parameters and one contiguous buffer for their
gradients) and `FlatModel` (a torch.nn.Module whose parameters and gradients are views into two flat buffers).

Runtimes move one contiguous tensor per step (a single MPI_Put, one Iallreduce bucket list, one copy in the
simulator) instead of a list of per-layer tensors; rules see one vector. `collsync.torch` holds the user's
parameters in a `ParamBuffer` (they stay the user's tensors; gradients are copied in, or reduced in place where
`p.grad` is pointed at the buffer); `collsync-train` builds a `FlatModel`, whose parameters live in the buffers.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from collsync.types import Flat


class ParamBuffer:
    """Parameters of one dtype and one contiguous buffer `buf` for their gradients, back to back in the given order.

    `views[i]` is parameter i's slice of `buf`. `flag`: one more element after the gradients, 1 from a worker that
    steps and 0 from one that joined, so a reduction of the buffer itself says whether anyone still steps (join
    without a reduction of its own).
    """

    def __init__(
        self, params: list[torch.Tensor], *, flag: bool = False, sparse_as_dense: bool = False, sparse: bool = False
    ) -> None:
        if not params:
            raise ValueError("ParamBuffer: no parameters")
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.starts = [0, *itertools.accumulate(self.sizes)][:-1]
        self.numel = sum(self.sizes)
        self.flag = flag
        self.sparse_as_dense = sparse_as_dense
        # With `sparse`, a sparse gradient is held aside here (parameter index -> gradient) and its slice is zero:
        # the caller reduces it on its own (Horovod allgathers a sparse gradient's indices and values).
        self.sparse_aside = sparse and not sparse_as_dense
        self.sparse: dict[int, torch.Tensor] = {}
        self.buf: Flat = torch.zeros(self.numel + int(flag), dtype=params[0].dtype)
        self.views = [self.buf[a : a + n] for a, n in zip(self.starts, self.sizes, strict=True)]

    def grads(self, active: bool = True) -> Flat:
        """The gradients into the buffer (a missing gradient counts as zero; all zero once this worker joined)."""
        if self.flag:
            self.buf[-1] = float(active)
        if not active:
            self.buf.zero_()
            return self.buf
        for i, (p, view) in enumerate(zip(self.params, self.views, strict=True)):
            if p.grad is None:
                view.zero_()
            elif p.grad.is_sparse and self.sparse_aside:
                view.zero_()
                self.sparse[i] = p.grad
            elif p.grad.is_sparse:
                if not self.sparse_as_dense:
                    raise NotImplementedError(
                        "DistributedOptimizer: sparse gradients are reduced only with sparse_as_dense=True"
                    )
                view.copy_(p.grad.detach().to_dense().reshape(-1))
            else:
                view.copy_(p.grad.detach().reshape(-1))
        return self.buf

    def set_grads(self, flat: Flat) -> None:
        """Every parameter's `.grad` from its slice of `flat` (copied: `flat` may be reused)."""
        for i, (p, a, n) in enumerate(zip(self.params, self.starts, self.sizes, strict=True)):
            src = flat[a : a + n].view_as(p)
            if i in self.sparse:
                continue  # held aside, reduced on its own
            if p.grad is None:
                p.grad = src.clone()
            elif p.grad.is_sparse:
                p.grad = src.clone().to_sparse()  # back to sparse for the update, as Horovod does
            else:
                p.grad.detach().copy_(src)

    def set_params(self, flat: Flat) -> None:
        """Every parameter from its slice of `flat`."""
        with torch.no_grad():
            for p, a, n in zip(self.params, self.starts, self.sizes, strict=True):
                p.copy_(flat[a : a + n].view_as(p))

    def read_params(self) -> Flat:
        """The parameters into the buffer (which is returned; the gradients there are overwritten)."""
        for p, view in zip(self.params, self.views, strict=True):
            view.copy_(p.detach().reshape(-1))
        return self.buf

    def bind_grads(self) -> None:
        """Point every `.grad` back at its slice of the buffer where autograd replaced it (it was None, or
        `create_graph=True` made a new tensor), so a reduction of the buffer is where the optimizer reads it."""
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view.view_as(p)


class FlatModel:
    """Rebinds every trainable parameter of `module` to a slice of `self.params`, and every `.grad` to a slice of
    `self.grads` (the `ParamBuffer` `self.buffer`'s gradient buffer).

    `layers` lists (name, start, stop) for each parameter tensor, for layer-wise statistics and rules.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("FlatModel: the module has no trainable parameters")
        self.buffer = ParamBuffer([p for _, p in named])
        self.grads: Flat = self.buffer.buf
        self.params: Flat = torch.zeros_like(self.grads)
        self.layers: list[tuple[str, int, int]] = []
        with torch.no_grad():
            for (name, p), start, n in zip(named, self.buffer.starts, self.buffer.sizes, strict=True):
                view = self.params[start : start + n]
                view.copy_(p.reshape(-1))
                p.data = view.view_as(p)
                self.layers.append((name, start, start + n))
        self.buffer.bind_grads()

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
        self.buffer.bind_grads()
