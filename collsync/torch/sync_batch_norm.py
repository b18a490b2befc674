"""Batch normalisation with statistics over every worker's batch (Horovod's `SyncBatchNorm`, on the CPU too).

In training, the mean and variance of each channel are those of the union of the workers' batches: one
allreduce of (count, sum, sum of squares) forward, one of (sum dy, sum dy * x_hat) backward, so outputs,
input gradients and running statistics equal those of `torch.nn.BatchNorm` on the concatenated batch (running
variance unbiased over the global count, as torch's). In evaluation, or with one worker, it is `_BatchNorm`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from collsync.torch import ops
from collsync.torch._world import state


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dims = [0] + list(range(2, x.dim()))
        local = torch.stack(
            [
                torch.full((x.shape[1],), x.numel() / x.shape[1], dtype=torch.float64),
                x.sum(dims, dtype=torch.float64),
                (x.to(torch.float64) ** 2).sum(dims),
            ]
        )
        total = ops.allreduce_(local, op=ops.Sum)
        count, mean64 = total[0], total[1] / total[0]
        var64 = (total[2] / count - mean64**2).clamp_min(0)
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean, var = mean64.to(x.dtype), var64.to(x.dtype)
        invstd = torch.rsqrt(var + eps)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        out = xhat if weight is None else xhat * weight.view(shape) + bias.view(shape)  # type: ignore[union-attr]
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count = float(count[0])
        return out, mean, var, count[0]

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        dims = [0] + list(range(2, dout.dim()))
        shape = [1, -1] + [1] * (dout.dim() - 2)
        dbias = dout.sum(dims)
        dweight = (dout * xhat).sum(dims)
        sums = ops.allreduce_(torch.stack([dbias, dweight]).to(torch.float64), op=ops.Sum).to(dout.dtype)
        g = invstd if weight is None else invstd * weight
        dx = g.view(shape) * (dout - (sums[0] / ctx.count).view(shape) - xhat * (sums[1] / ctx.count).view(shape))
        if weight is None:
            return dx, None, None, None
        return dx, dweight, dbias, None


class SyncBatchNorm(_BatchNorm):
    """`torch.nn.BatchNorm1d/2d/3d` whose training statistics span every worker (same arguments as Horovod's)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or state("SyncBatchNorm").comm.Get_size() == 1:
            return super().forward(input)
        out, mean, var, count = _SyncBatchNormFn.apply(input, self.weight, self.bias, self.eps)
        if self.track_running_stats:
            with torch.no_grad():
                tracked = self.num_batches_tracked
                assert tracked is not None  # track_running_stats registers it
                tracked.add_(1)
                if self.momentum is None:
                    m = 1.0 / float(tracked)
                else:
                    m = self.momentum
                n = count.item()
                self.running_mean.mul_(1 - m).add_(mean, alpha=m)  # type: ignore[union-attr]
                self.running_var.mul_(1 - m).add_(var * (n / max(n - 1, 1)), alpha=m)  # type: ignore[union-attr]
        return out
