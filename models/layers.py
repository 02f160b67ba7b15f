"""Building blocks every drafter shares: RMSNorm, SwiGLU MLP, and attention over blocks of keys.

`attend` is the one attention routine of the project's drafters. A query set attends over a list of key
blocks with one joint softmax:

- a *dense* block holds S keys that every query may see, subject to a bool mask `[B, 1|H, n, S]`
  (True = attend), or `causal` (query i sees keys 0..i); the TTT unroll uses one causal block for the T x T
  prefix, decoding uses masked dense blocks for the cached prefix and the drafter's own entries;
- a *diag* block holds exactly one key per query (`[B, H, n, hd]`): query i sees only key i. The TTT unroll
  uses diag blocks for the chain of the drafter's own draft tokens at the same position, so it never builds a
  (K*T) x (K*T) mask or score matrix: the diagonal keys cost O(T) dot products.

The blocks share one softmax, exactly the softmax over the concatenated keys; scores and the softmax run in fp32
even under bf16 autocast. The TTT unroll's pair (causal prefix, diag chain) has a fused path on CPU and CUDA
(`_CausalChainAttention`, which takes several causal prefixes too): the prefix runs in a PyTorch flash or
memory-efficient kernel (`models.attention.causal_with_lse`), which skips the masked half and never materialises
the [n, n] scores, and the chain is merged in by log-sum-exp.

`attend_block` is the block drafters' variant: n rows of J queries each (an anchor's block), every query of a row
sees the row's dense blocks (the context) and all J keys of its own row (bidirectional within the block). On CPU
with causal context blocks it is fused too (`_CausalBlockAttention`): the context through the flash kernel once
per block offset j, the row's own J x J scores as one batched matmul, merged by log-sum-exp.

A dense block may also serve a *subset* of its layout's queries (`rows`): the TTT unroll runs its later steps only
at the positions that carry loss, so n queries (flat positions b * S + s of the block's [B, S] layout) attend to the
full causal prefix of their own sequence. On CPU and CUDA the queries are scattered into the [B, S] layout for
the flash kernel alone (attention is a small share of the work; the projections and the MLP run on the n rows only).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import attend as backend_attend
from models.attention import causal_lse_kernel, causal_with_lse, causal_with_lse_backward

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

    dense: k, v `[B, H, S, hd]`, mask `[B, 1|H, n, S]` bool or None (all visible); causal=True instead of a
           mask: S == n and query i sees keys 0..i.
    diag:  k, v `[B, H, n, J, hd]`, J keys private to each query (its own chain in the TTT unroll).
    rows (dense, first block only): the queries are the flat positions `rows` (b * S + s, ascending) of the
           block's [B, S] layout, q `[1, H, n, hd]` with n = len(rows), diag blocks alongside in the same order;
           `causal` (query (b, s) sees keys (b, <= s)) or a layout mask `[B|1, 1|H, S, S]` says what each sees.
    """

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None
    diag: bool = False
    causal: bool = False
    rows: torch.Tensor | None = None

    def dense_mask(self) -> torch.Tensor | None:
        """The block's mask as a tensor (the causal triangle built on demand)."""
        if self.causal:
            n = self.k.shape[-2]
            return torch.ones(n, n, dtype=torch.bool, device=self.k.device).tril()
        return self.mask


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
    if blocks[0].rows is not None:
        return _attend_rows(q, blocks, scale)
    if len(blocks) == 1 and not blocks[0].diag:
        # one dense key set (decoding: the cached prefix and the tree): the kernel backend serves it
        b = blocks[0]
        return backend_attend(q, b.k, b.v, mask=b.mask, is_causal=b.causal, scale=scale)
    if not any(b.diag for b in blocks):
        # several dense sets (decoding's cross branch: target prefix + own entries): one kernel call over their union
        k = torch.cat([b.k.to(q.dtype) for b in blocks], -2)
        v = torch.cat([b.v.to(q.dtype) for b in blocks], -2)
        masks = [b.dense_mask() for b in blocks]
        mask = None if all(m is None for m in masks) else _union_mask(q, blocks, masks)
        return backend_attend(q, k, v, mask=mask, scale=scale)
    if (len(blocks) >= 2 and blocks[-1].diag and all(b.causal and not b.diag for b in blocks[:-1])
            and causal_lse_kernel(q) is not None and all(b.k.shape[-2] == q.shape[-2] for b in blocks[:-1])):
        kv = [t.to(q.dtype) for b in blocks[:-1] for t in (b.k, b.v)]
        return _CausalChainAttention.apply(q, blocks[-1].k, blocks[-1].v, scale, None, *kv)
    q = q * scale
    scores = []
    for b in blocks:
        if b.diag:
            s = (q.float().unsqueeze(-2) * b.k.float()).sum(-1).to(q.dtype)
        else:
            s = q @ b.k.transpose(-1, -2)
        mask = None if b.diag else b.dense_mask()
        if mask is not None:
            s = s.masked_fill_(~mask, torch.finfo(s.dtype).min)
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


def _union_mask(q: torch.Tensor, blocks: list[KeyBlock], masks: list[torch.Tensor | None]) -> torch.Tensor:
    """The dense blocks' masks side by side, [B|1, H|1, n, sum S] (None = all visible)."""
    full = [torch.ones(1, 1, 1, b.k.shape[-2], dtype=torch.bool, device=q.device) if m is None
            else m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)) for b, m in zip(blocks, masks)]
    lead = (max(m.shape[0] for m in full), max(m.shape[1] for m in full), q.shape[-2])
    return torch.cat([m.expand(*lead, m.shape[-1]) for m in full], -1)


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, H, S, ...] -> [1, H, n, ...]: the flat positions `rows` (b * S + s) of a head-major layout."""
    b, s = rows.div(x.shape[2], rounding_mode="floor"), rows.remainder(x.shape[2])
    return x[b, :, s].transpose(0, 1).unsqueeze(0)      # advanced indexing puts the n rows first


def _put_rows(base: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A copy of `base` [B, H, S, ...] with its flat positions `rows` replaced by x [1, H, n, ...]."""
    out = base.clone()
    b, s = rows.div(base.shape[2], rounding_mode="floor"), rows.remainder(base.shape[2])
    out[b, :, s] = x[0].transpose(0, 1).to(out.dtype)
    return out


def _attend_rows(q: torch.Tensor, blocks: list[KeyBlock], scale: float) -> torch.Tensor:
    """attend() for n queries at flat positions `blocks[0].rows` of the prefix block's [B, S] layout."""
    prefix, rest = blocks[0], blocks[1:]
    if len(rest) > 1 or any(not b.diag for b in rest):
        raise ValueError("attend: a dense block with query rows takes at most one diag block beside it")
    chain = rest[0] if rest else None
    dt = q.dtype
    if prefix.causal and causal_lse_kernel(q) is not None:
        kc, vc = (chain.k, chain.v) if chain is not None else (None, None)
        return _CausalChainAttention.apply(q, kc, vc, scale, prefix.rows, prefix.k.to(dt), prefix.v.to(dt))
    # elsewhere (or under an explicit padding mask): per sequence, a masked dense block of its own keys plus the chain
    B, _, S, _ = prefix.k.shape
    rows = prefix.rows
    bounds = torch.searchsorted(rows, torch.arange(B + 1, device=rows.device) * S).tolist()
    outs = []
    for b in range(B):
        lo, hi = bounds[b], bounds[b + 1]
        if lo == hi:
            continue
        s = rows[lo:hi] - b * S
        if prefix.causal:
            mask = (torch.arange(S, device=s.device)[None, :] <= s[:, None])[None, None]
        else:
            m = prefix.mask
            mask = m[b if m.shape[0] > 1 else 0].index_select(-2, s)[None]
        own = [KeyBlock(prefix.k[b:b + 1], prefix.v[b:b + 1], mask)]
        if chain is not None:
            own.append(KeyBlock(chain.k[:, :, lo:hi], chain.v[:, :, lo:hi], diag=True))
        outs.append(attend(q[:, :, lo:hi], own, scale))
    return torch.cat(outs, 2) if outs else q.new_zeros(q.shape)


class _CausalChainAttention(torch.autograd.Function):
    """attend() for [causal prefixes of n keys each, diag chain of J keys per query], fused (CPU and CUDA).

    Forward: each prefix through a PyTorch flash kernel (`causal_with_lse`: output and log-sum-exp), the chain as
    O(n*J) dot products, all merged by log-sum-exp. Backward: each prefix's kernel backward, handed the merged output
    and log-sum-exp, gives that prefix's gradients under the joint softmax exactly (its probabilities are
    exp(s - lse) and its rowsum(dO * O) term is the joint one), and the chain's gradients are written out.
    Nothing of size n x n is kept between forward and backward. The TTT unroll has one prefix (step 0's keys or the
    target's), a block drafter reading both context sources two.

    With `rows` the n queries are flat positions of the prefixes' [B, S] layout: they are scattered there (zero
    queries elsewhere) for the flash kernel, whose outputs are gathered back; in backward the other positions get a
    zero output gradient, so they add nothing to the keys' gradients. Without a chain (kc None) it is the causal
    prefixes alone. `kv` holds the prefixes' keys and values flat: k, v, k, v, ...
    """

    @staticmethod
    def forward(ctx, q, kc, vc, scale: float, rows, *kv):
        qf = q if rows is None else _put_rows(q.new_zeros(kv[0].shape[:3] + q.shape[-1:]), rows, q)
        full, outs, lses, states = [], [], [], []
        for k, v in zip(kv[0::2], kv[1::2]):
            o_f, lse_f, state = causal_with_lse(qf, k, v, scale)
            full.append((o_f, lse_f))
            outs.append(o_f if rows is None else take_rows(o_f, rows))
            lses.append(lse_f if rows is None else take_rows(lse_f, rows))
            states.append(state)
        lse, p2 = lses[0], None
        for other in lses[1:]:
            lse = torch.logaddexp(lse, other)
        if kc is not None:
            s2 = (q.float().unsqueeze(-2) * kc.float()).sum(-1).mul_(scale)          # [B, H, n, J]
            lse = torch.logaddexp(lse, torch.logsumexp(s2, -1))
            p2 = torch.exp(s2 - lse.unsqueeze(-1))
        if len(outs) == 1 and kc is None:
            out = outs[0]
        else:
            out = sum(torch.exp(l - lse).unsqueeze(-1) * o.float() for o, l in zip(outs, lses))
            if kc is not None:
                out = out + (p2.unsqueeze(-1) * vc.float()).sum(-2)
            out = out.to(q.dtype)
        # the kernels' backward reads the whole layout: the merged values at the rows, each kernel's own elsewhere
        layouts = [] if rows is None else [t for o_f, lse_f in full
                                           for t in (_put_rows(o_f, rows, out), _put_rows(lse_f, rows, lse))]
        ctx.save_for_backward(qf, kc, vc, out, lse, p2, rows, *kv, *layouts)
        ctx.scale, ctx.kernel_states = scale, states
        return out

    @staticmethod
    def backward(ctx, g):
        qf, kc, vc, out, lse, p2, rows, *rest = ctx.saved_tensors
        n_pre = len(ctx.kernel_states)
        kv, layouts = rest[:2 * n_pre], rest[2 * n_pre:]
        g = g.to(qf.dtype).contiguous()
        g_f = g if rows is None else _put_rows(qf.new_zeros(qf.shape), rows, g)
        dq, grads = None, []
        for i, state in enumerate(ctx.kernel_states):
            o_i, lse_i = (out, lse) if rows is None else (layouts[2 * i], layouts[2 * i + 1])
            dq_i, dk, dv = causal_with_lse_backward(g_f, qf, kv[2 * i], kv[2 * i + 1], o_i, lse_i, state, ctx.scale)
            dq_i = dq_i if rows is None else take_rows(dq_i, rows)
            dq = dq_i if dq is None else dq.float() + dq_i.float()
            grads += [dk, dv]
        q = qf if rows is None else take_rows(qf, rows)
        if kc is None:
            return dq.to(q.dtype), None, None, None, None, *grads
        gf = g.float()
        D = (gf * out.float()).sum(-1, keepdim=True)                             # rowsum(dO * O)
        ds2 = p2 * ((gf.unsqueeze(-2) * vc.float()).sum(-1) - D)                 # [B, H, n, J]
        dq = dq.float() + ctx.scale * (ds2.unsqueeze(-1) * kc.float()).sum(-2)
        dkc = (ctx.scale * ds2).unsqueeze(-1) * q.float().unsqueeze(-2)
        dvc = p2.unsqueeze(-1) * gf.unsqueeze(-2)
        return dq.to(q.dtype), dkc.to(kc.dtype), dvc.to(vc.dtype), None, None, *grads


def attend_block(q: torch.Tensor, blocks: list[KeyBlock], k_own: torch.Tensor, v_own: torch.Tensor,
                 scale: float | None = None) -> torch.Tensor:
    """Joint-softmax attention of n rows of J queries, q `[B, H, n, J, hd]`: each query sees the dense `blocks`
    (as a query set of n rows: causal = row i sees keys 0..i) and all J keys of its own row, k_own/v_own
    `[B, H, n, J, hd]`. Returns `[B, H, n, J, hd]`.

    CPU with causal blocks only: fused (`_CausalBlockAttention`). Elsewhere (other devices, masked blocks): one
    `attend` call per offset j with the row's keys as a diag block -- on CUDA with causal context blocks that is
    the fused chain kernel (`_CausalChainAttention`), otherwise the generic masked path; nothing of size (n*J)^2
    either way.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n = q.shape[2]
    if (blocks and all(b.causal and not b.diag for b in blocks) and q.device.type == "cpu"
            and all(b.k.shape[-2] == n for b in blocks)):
        dt = q.dtype
        kv = [t.to(dt) for b in blocks for t in (b.k, b.v)]
        return _CausalBlockAttention.apply(q, k_own.to(dt), v_own.to(dt), scale, *kv)
    own = KeyBlock(k_own, v_own, diag=True)
    return torch.stack([attend(q[:, :, :, j], blocks + [own], scale) for j in range(q.shape[3])], 3)


def _row_causal_mask(n: int, J: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [n*J, n] of n rows of J queries over n keys: query (i, j) sees keys 0..i (the flash kernel
    takes a mask of the query's dtype)."""
    row = torch.arange(n, device=device).repeat_interleave(J)
    hidden = torch.arange(n, device=device)[None, :] > row[:, None]
    return torch.zeros(n * J, n, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


class _CausalBlockAttention(torch.autograd.Function):
    """attend_block() on CPU for causal context blocks (each [B, H, n, hd], flat in `kv` as k, v, k, v, ...).

    Forward: per context block, the flash kernel once over all n*J queries (row i's J queries see keys 0..i: an
    additive [n*J, n] mask, `_row_causal_mask`; one call instead of one per offset j, its backward 2-3x faster on
    CPU) giving output and log-sum-exp; the rows' own scores s = q k_own^T as one batched [J, J] matmul per row; all
    merged by log-sum-exp. Backward: each flash backward, handed the merged output and log-sum-exp, gives that
    block's gradients under the joint softmax (as in `_CausalChainAttention`); the own part is written out, its
    probabilities recomputed from q and k_own. Kept for backward: q, k_own, v_own, the output and the log-sum-exp
    -- linear in J.
    """

    @staticmethod
    def forward(ctx, q, kc, vc, scale: float, *kv):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        acc = torch.promote_types(q.dtype, torch.float32)   # fp32 for bf16/fp32 inputs; float64 stays float64
        B, H, n, J, hd = q.shape
        q = q.contiguous()
        mask = _row_causal_mask(n, J, q.dtype, q.device)
        parts = []
        for i in range(0, len(kv), 2):
            o, lse_i = flash(q.view(B, H, n * J, hd), kv[i], kv[i + 1], 0.0, False, attn_mask=mask, scale=scale)
            parts.append((o.view(B, H, n, J, hd), lse_i.view(B, H, n, J)))
        # an enclosing bf16 autocast would run these fp32 matmuls in bf16: a custom Function's forward runs under the
        # caller's autocast, its backward (which recomputes the scores in fp32 from this lse) does not
        with torch.autocast(q.device.type, enabled=False):
            s = (q.to(acc) @ kc.to(acc).transpose(-1, -2)).mul_(scale)           # [B, H, n, J, J]
            lse = torch.logsumexp(s, -1)                                          # [B, H, n, J]
            for _, lse_i in parts:
                lse = torch.logaddexp(lse, lse_i)
            out = torch.exp(s - lse.unsqueeze(-1)) @ vc.to(acc)
            for o_i, lse_i in parts:
                out = out + torch.exp(lse_i - lse).unsqueeze(-1) * o_i.to(acc)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kc, vc, out, lse, *kv)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, kc, vc, out, lse, *kv = ctx.saved_tensors
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        acc = torch.promote_types(q.dtype, torch.float32)
        scale, J = ctx.scale, q.shape[3]
        g = g.to(q.dtype)
        gf = g.to(acc)
        p = torch.exp((q.to(acc) @ kc.to(acc).transpose(-1, -2)).mul_(scale) - lse.unsqueeze(-1))
        D = (gf * out.to(acc)).sum(-1, keepdim=True)                             # rowsum(dO * O)
        ds = p * (gf @ vc.to(acc).transpose(-1, -2) - D)                         # [B, H, n, J, J]
        dq = scale * (ds @ kc.to(acc))
        dkc = scale * (ds.transpose(-1, -2) @ q.to(acc))
        dvc = p.transpose(-1, -2) @ gf
        B, H, n, _, hd = q.shape
        mask = _row_causal_mask(n, J, q.dtype, q.device)
        flat = lambda x: x.contiguous().view(B, H, n * J, *x.shape[4:])     # noqa: E731  [B, H, n, J, ..] -> n*J rows
        grads = []
        for i in range(0, len(kv), 2):
            dq_i, dk, dv = flash_bwd(flat(g), flat(q), kv[i], kv[i + 1], flat(out), flat(lse), 0.0, False,
                                     attn_mask=mask, scale=scale)
            dq += dq_i.view(q.shape).to(acc)
            grads += [dk, dv]
        return (dq.to(q.dtype), dkc.to(kc.dtype), dvc.to(vc.dtype), None, *grads)
