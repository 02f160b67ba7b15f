"""Attention backend chosen in one place: flash-attn when importable on CUDA, else PyTorch SDPA.

flash-attn only covers causal or unmasked attention over [B, T, H, D]; any explicit mask (tree attention,
the TTT prefix) goes through SDPA, whose own flash/efficient kernels serve on GPU.

`causal_with_lse` / `causal_with_lse_backward` are the kernel pair under the drafters' fused attention
(`models.layers`): causal attention that also returns its log-sum-exp, and the backward that takes an output and
log-sum-exp it did not compute itself (the merged ones of a joint softmax). PyTorch's own kernels serve: on CPU its
flash kernel, on CUDA its flash kernel (fp16/bf16, head dim <= 256) or its memory-efficient kernel (fp32); none of
them materialises the n x n scores.
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


def causal_lse_kernel(q: torch.Tensor) -> str | None:
    """The kernel `causal_with_lse` runs for queries like q: 'cpu_flash', 'cuda_flash', 'cuda_efficient', or None
    where there is none (another device, or float64 on CUDA)."""
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type != "cuda":
        return None
    if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
        return "cuda_flash"
    if q.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return "cuda_efficient"
    return None


def causal_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Causal attention of q, k, v [B, H, n, D] (one dtype, heads already expanded): (output [B, H, n, D],
    log-sum-exp [B, H, n] fp32, the kernel's state for `causal_with_lse_backward`)."""
    kind = causal_lse_kernel(q)
    n = q.shape[-2]
    if kind == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, (kind,)
    if kind == "cuda_flash":
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (kind, cq, ck, mq, mk, seed, offset)
    if kind == "cuda_efficient":
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, True, scale=scale)
        # its log-sum-exp is padded along the queries (to a multiple of 32): keep the pad length for backward
        return out, lse[..., :n], (kind, seed, offset, lse.shape[-1])
    raise ValueError(f"causal_with_lse: no fused kernel for {q.dtype} on {q.device.type}")


def causal_with_lse_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, state: tuple, scale: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of causal attention for the output gradient g, given the output and log-sum-exp to use (the
    probabilities are exp(q k^T * scale - lse), the rowsum(g * out) term comes from `out`)."""
    kind = state[0]
    g, out = g.contiguous(), out.contiguous()
    if kind == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, True, scale=scale)
    if kind == "cuda_flash":
        _, cq, ck, mq, mk, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse.contiguous(), cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale)
    _, seed, offset, width = state
    padded = lse.new_zeros(lse.shape[:-1] + (width,))
    padded[..., :lse.shape[-1]] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], True, scale=scale)
    return dq, dk, dv
