"""Building blocks every drafter shares: RMSNorm, SwiGLU MLP, and attention over blocks of keys.

`attend` is the one attention routine of the project's drafters. A query set attends over a list of key
blocks with one joint softmax:

- a *dense* block holds S keys that every query may see, subject to a bool mask `[B, 1|H, n, S]`
  (True = attend); the TTT unroll uses one dense block for the T x T causal prefix, decoding uses dense
  blocks for the cached prefix and the drafter's own entries;
- a *diag* block holds exactly one key per query (`[B, H, n, hd]`): query i sees only key i. The TTT unroll
  uses diag blocks for the chain of the drafter's own draft tokens at the same position, so it never builds a
  (K*T) x (K*T) mask or score matrix: the diagonal keys cost O(T) dot products.

The blocks are merged with a shared running max (the log-sum-exp merge), which is exactly the softmax over the
concatenated keys. Scores and the softmax run in fp32 even under bf16 autocast.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import attend as backend_attend

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the statistic in fp32 without an fp32 copy of x; the output keeps x's dtype (bf16 under autocast)
        ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).pow(2) / x.shape[-1]
        return x * torch.rsqrt(ms + self.eps).to(x.dtype) * self.weight.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward, Llama layout (gate_proj, up_proj, down_proj)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class KeyBlock:
    """Keys/values one query set attends to. Heads already expanded to the query heads.

    dense: k, v `[B, H, S, hd]`, mask `[B, 1|H, n, S]` bool or None (all visible).
    diag:  k, v `[B, H, n, J, hd]`, J keys private to each query (its own chain in the TTT unroll).
    """

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None
    diag: bool = False


def head_map(num_heads: int, num_kv_heads: int, device=None) -> torch.Tensor:
    """Which KV head each query head reads: floor(h * Hkv / H) (HF's GQA grouping when H % Hkv == 0)."""
    return (torch.arange(num_heads, device=device) * num_kv_heads) // num_heads


def expand_heads(x: torch.Tensor, hmap: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, ...] -> [B, H, ...] following `hmap` (a no-op when the map is the identity)."""
    if x.shape[1] == hmap.numel() and bool((hmap == torch.arange(hmap.numel(), device=hmap.device)).all()):
        return x
    return x.index_select(1, hmap.to(x.device))


def attend(q: torch.Tensor, blocks: list[KeyBlock], scale: float | None = None) -> torch.Tensor:
    """Joint-softmax attention of q `[B, H, n, hd]` over the union of `blocks`; returns `[B, H, n, hd]`.

    The scores of all blocks share one softmax (one fused pass over [n, S + J], fp32 inside the kernel); the
    dense part is a matmul in q's dtype (bf16 under autocast, as EAGLE-3 trainers do), the diag part an fp32
    elementwise product, so nothing grows with the square of (blocks x n).
    """
    if not blocks:
        raise ValueError("attend: no key blocks given")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if len(blocks) == 1 and not blocks[0].diag:
        # one dense key set (decoding: the cached prefix and the tree): the kernel backend serves it
        return backend_attend(q, blocks[0].k, blocks[0].v, mask=blocks[0].mask, scale=scale)
    q = q * scale
    scores = []
    for b in blocks:
        if b.diag:
            s = (q.float().unsqueeze(-2) * b.k.float()).sum(-1).to(q.dtype)
        else:
            s = q @ b.k.transpose(-1, -2)
        if b.mask is not None:
            s = s.masked_fill_(~b.mask, torch.finfo(s.dtype).min)
        scores.append(s)
    p = torch.softmax(scores[0] if len(scores) == 1 else torch.cat(scores, -1), -1, dtype=torch.float32)
    out = None
    off = 0
    for s, b in zip(scores, blocks):
        w = p[..., off:off + s.shape[-1]]
        off += s.shape[-1]
        part = (w.unsqueeze(-1) * b.v.float()).sum(-2) if b.diag else (w.to(b.v.dtype) @ b.v).float()
        out = part if out is None else out + part
    return out.to(q.dtype)
