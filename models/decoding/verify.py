"""Target side of speculative decoding: prefill, one-forward tree verification, greedy acceptance, cache compaction.

Batch 1. The target's DynamicCache always holds exactly the accepted tokens; the root of the next tree (the last
emitted token) is not in it yet, so every verification forward starts at the root.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.decoding.tree import DraftTree
from models.target import Target, TargetCapture


@dataclass
class Verified:
    """One verification: the target's view of every tree node and what it accepts."""

    capture: TargetCapture   # features/KV/last hidden of the n tree nodes (cache = past + n)
    argmax: torch.Tensor     # [n] target's greedy next token after each node
    path: torch.Tensor       # [a + 1] accepted node indices, root first
    bonus: int               # target's next token after the accepted path
    logits: torch.Tensor     # [n, V]


def cache_length(cache) -> int:
    return cache.get_seq_length()


def prefill(target: Target, prompt_ids: torch.Tensor) -> tuple[TargetCapture, torch.Tensor]:
    """Run the prompt [T] through the target; returns the capture (with cache) and the last position's logits [V]."""
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt_ids: expected a non-empty 1D tensor of token ids, got shape {tuple(prompt_ids.shape)}")
    cap = target.capture(prompt_ids[None].to(target.device), keep_cache=True)
    return cap, target.logits(cap.last_hidden[0, -1]).float()


def tree_attention_mask(tree: DraftTree, past: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, past + n] additive mask: every node sees the whole cache plus its own ancestors (and itself)."""
    n = tree.size
    allowed = torch.cat([torch.ones(n, past, dtype=torch.bool, device=tree.tokens.device), tree.ancestor_mask()], 1)
    mask = torch.zeros(n, past + n, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def verify(target: Target, tree: DraftTree, cache) -> Verified:
    """Score every tree node in ONE target forward (tree mask, positions past + depth) and accept greedily."""
    past = cache_length(cache)
    dev = target.device
    tokens = tree.tokens.to(dev)
    cap = target.capture(tokens[None], attention_mask=tree_attention_mask(tree, past, target.dtype).to(dev),
                         position_ids=tree.positions(past).to(dev)[None], past_key_values=cache, keep_cache=True)
    logits = target.logits(cap.last_hidden[0])
    pred = logits.max(-1).indices          # the first maximum, as argmax; several times faster in bf16
    path, bonus = accept(tree, pred)
    return Verified(capture=cap, argmax=pred, path=path, bonus=bonus, logits=logits)


def accept(tree: DraftTree, target_argmax: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Longest root path whose every draft token equals the target's argmax at its parent; plus the bonus token.

    Returns (path node indices [a + 1], root first; bonus target id). Lossless under greedy decoding by
    construction: each accepted token is exactly what the target emits given the accepted prefix.
    """
    pred = target_argmax.to(tree.tokens.device)
    if tree.size == 1:
        return torch.zeros(1, dtype=torch.long, device=pred.device), int(pred[0])
    correct = torch.ones(tree.size, dtype=torch.bool, device=pred.device)
    correct[1:] = tree.tokens[1:] == pred[tree.parents[1:]]
    amask = tree.ancestor_mask()
    ok = ~(amask & ~correct[None, :]).any(1)              # node and all its ancestors correct
    best = int(torch.where(ok, tree.depths, -1).argmax())
    path = amask[best].nonzero().flatten()                 # ancestors precede descendants in a flat tree
    return path, int(pred[best])


def compact_cache(cache, past: int, path: torch.Tensor) -> None:
    """Keep the first `past` cache entries plus the accepted tree nodes `path` (indices into the verified tree)."""
    total = cache_length(cache)
    n_keep = past + path.numel()
    contiguous = bool((path == torch.arange(path.numel(), device=path.device)).all())
    if contiguous:  # a chain-shaped acceptance: dropping the tail is enough
        if n_keep < total:
            cache.crop(n_keep - total)
        return
    # only the tail moves: the accepted nodes are copied down to past, past + 1, ... and the rest cropped
    for layer in cache.layers:
        if getattr(layer, "sliding_window", None):
            raise ValueError("compact_cache: sliding-window cache layers are not supported")
        src = (past + path).to(layer.keys.device)
        layer.keys[..., past:n_keep, :] = layer.keys.index_select(-2, src)
        layer.values[..., past:n_keep, :] = layer.values.index_select(-2, src)
    cache.crop(n_keep - total)
