"""Horovod's gradient compression choices (`Compression.none`, `Compression.fp16`), re-exported by `_ops_base`."""

from __future__ import annotations

from typing import Any

import torch


class NoneCompressor:
    """No compression (Horovod's `Compression.none`)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 and come back in their own dtype (Horovod's `Compression.fp16`)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        return (tensor.to(torch.float16) if dtype.is_floating_point else tensor), dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """Horovod's compression choices for gradients on the wire."""

    none = NoneCompressor
    fp16 = FP16Compressor
