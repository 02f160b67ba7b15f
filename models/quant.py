"""Weight-only int8 linears for decoding-time drafters (gpt-fast's int8 weight-only scheme).

A drafter's pass over a few tree nodes is bound by reading its weights: on CPU the target's forward evicts them
from cache every round, so halving their bytes (bf16 -> int8, one scale per output row) shortens drafting. Only the
proposals change; verification still accepts the target's own greedy tokens, so decoding stays lossless.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as int8 rows times a per-row scale (symmetric, absmax / 127)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def dequantized(self) -> torch.Tensor:
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type == "cpu" and x2.dtype in (torch.bfloat16, torch.float16, torch.float32):
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scales.to(x2.dtype))
        else:   # no fused kernel here: the same product through a dequantized copy
            y = F.linear(x2, self.dequantized().to(x2.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears_int8(module: nn.Module) -> nn.Module:
    """A copy of `module` with every nn.Linear replaced by an Int8Linear (the original is left untouched)."""
    out = copy.deepcopy(module)
    for name, child in list(out.named_modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(child, attr, Int8Linear(sub))
    return out
