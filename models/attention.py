"""Attention backend chosen in one place: flash-attn when importable on CUDA, else PyTorch SDPA.

flash-attn only covers causal or unmasked attention over [B, T, H, D]; any explicit mask (tree attention,
the TTT prefix) goes through SDPA, whose own flash/efficient kernels serve on GPU.
"""
from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def backend(device_type: str) -> str:
    """'flash_attn' or 'sdpa' for a device type; logged once per device type."""
    choice = "sdpa"
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        choice = "flash_attn"
    log.info("attention backend on %s: %s", device_type, choice)
    return choice


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """q [B, H, Tq, D], k/v [B, Hkv, Tk, D] (GQA groups expanded here) -> [B, H, Tq, D].

    `mask` is boolean (True = attend) or additive float, broadcastable to [B, H, Tq, Tk].
    """
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if mask is None and q.is_cuda and backend("cuda") == "flash_attn" and q.dtype in (torch.float16, torch.bfloat16):
        from flash_attn import flash_attn_func

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                              causal=is_causal)
        return out.transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale)
