"""Shared by the drafter/TTT tests: a tiny target's capture and the naive step-by-step reference."""
from __future__ import annotations

import torch

from models.build import build_drafter
from models.drafter import DraftCache, Drafter
from models.drafter_config import DrafterConfig

VARIANT_GRID = (
    [dict(variant="eagle3", depth=1), dict(variant="eagle3", depth=2)]
    + [dict(variant="kv_only", injection=i, rope_fix=r, depth=d)
       for i in ("linear", "head_concat") for r in (False, True) for d in (1, 2)]
    + [dict(variant="hybrid", depth=1), dict(variant="hybrid", depth=2, rope_fix=True),
       dict(variant="hybrid", depth=1, injection="head_concat"), dict(variant="cross_only", depth=1)]
    # EAGLE-3.1's normalisations, and the no-target control
    + [dict(variant="eagle3", depth=2, fc_norm=True, norm_output=True), dict(variant="hybrid", depth=1, norm_output=True),
       dict(variant="cross_only", depth=1, fc_norm=True), dict(variant="kv_only", depth=2, no_target=True)]
)

# block drafters: every context source, both injections, rope_fix, depth 1 and 2, EAGLE-3.1's fc_norm
BLOCK_GRID = (
    [dict(variant="block", context="hidden", depth=1), dict(variant="block", context="hidden", depth=2, fc_norm=True)]
    + [dict(variant="block", context="kv", injection=i, rope_fix=r, depth=d)
       for i, r, d in (("linear", False, 1), ("linear", True, 2), ("head_concat", False, 2))]
    + [dict(variant="block", context="both", depth=1), dict(variant="block", context="both", depth=2, rope_fix=True)]
)


def tiny(arch: str = "llama", **kw):
    """A tiny target whose query heads divide evenly by its KV heads and by 3 layers' KV heads."""
    from models.target import tiny_target

    args = dict(num_layers=6, hidden_size=48, num_heads=6, num_kv_heads=2, vocab_size=64)
    args.update(kw)
    return tiny_target(arch, **args)


def capture(target, B: int = 2, T: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (B, T), generator=g).to(target.device)
    cap = target.capture(ids, with_logits=True)
    return ids, torch.cat(cap.features, -1), cap.kv, cap.logits


def make_drafter(target, seed: int = 0, draft_vocab_size: int = 0, **kw) -> Drafter:
    """A drafter of any variant (block ones too) with the target's embedding and perturbed norms."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(target, draft_vocab_size=draft_vocab_size, **kw)
    d = build_drafter(cfg)
    d.load_target_weights(target.embed_tokens.weight)
    # perturb the norms and the injection so that every parameter matters in the comparisons
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or ".inject." in name:
                p.add_(0.1 * torch.randn_like(p))
    return d.eval()


@torch.no_grad()
def naive_logits(drafter: Drafter, input_ids, features, target_kv, steps: int) -> torch.Tensor:
    """Decode-style reference: for each t, the drafter's step-0 entry then a chain of k steps, one token a call,
    through `Drafter.step` with one cache (chains dropped with `select`, the target prefix growing by one).
    Returns [K, B, T, V_draft], NaN where token t+1+k does not exist."""
    B, T = input_ids.shape
    cfg = drafter.config
    dev = input_ids.device
    out = torch.full((steps, B, T, cfg.draft_vocab_size), float("nan"), device=dev)
    fused = drafter.fuse(features) if cfg.uses_features else None
    cache = DraftCache()
    for t in range(T - 1):
        cache.select(torch.arange(t, device=dev))                       # keep the step-0 entries of positions < t
        kv = [(k[:, :, :t + 1], v[:, :, :t + 1]) for k, v in target_kv] if cfg.reads_kv else None
        h = fused[:, t:t + 1] if fused is not None else None
        for k in range(steps):
            if t + 1 + k > T - 1:
                break
            mask = torch.ones(B, 1, len(cache) + 1, dtype=torch.bool, device=dev)
            pos = torch.full((B, 1), t + 1 + k, device=dev)
            logits, h = drafter.step(input_ids[:, t + 1 + k:t + 2 + k], h, pos, cache, mask, kv, None)
            out[k, :, t] = logits[:, 0]
    return out


def assert_same_with_grads(fused: torch.Tensor, plain: torch.Tensor, leaves: tuple, grad: torch.Tensor,
                           **tol) -> None:
    """Two attention outputs agree, and so do their gradients with respect to `leaves` for the output gradient
    `grad` (a fused kernel path against the masked joint softmax)."""
    torch.testing.assert_close(fused, plain, **tol)
    for a, b in zip(torch.autograd.grad(fused, leaves, grad), torch.autograd.grad(plain, leaves, grad)):
        torch.testing.assert_close(a, b, **tol)
