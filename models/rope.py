"""Rotary position embeddings in the HF Llama convention (rotate_half over split halves).

The drafters rotate and un-rotate with the same cos/sin the target uses, so an injected target key can be
taken back to its un-rotated form exactly (the `rope_fix` option of the KV-reading drafters).
"""
from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., seq, head_dim] by cos/sin broadcastable to it."""
    return x * cos + rotate_half(x) * sin


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope`: rotation by the negative angle."""
    return x * cos - rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin tables for integer positions; `inv_freq` may be copied from the target for exact agreement."""

    def __init__(self, head_dim: int, theta: float = 10000.0, inv_freq: torch.Tensor | None = None,
                 attention_scaling: float = 1.0):
        super().__init__()
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq.detach().float().clone(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., seq] (long) -> cos, sin [..., seq, head_dim] in `dtype`."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
