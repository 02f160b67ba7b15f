"""The draft vocabulary (DESIGN §5): the N most frequent target tokens among the loss-masked training tokens.

`d2t[i]` is the target id of draft index i (the ids themselves, ascending; EAGLE-3 stores `d2t[i] - i`
instead), `t2d` is a bool mask over the target vocabulary. N = 0 or N >= vocab size means the full vocabulary
(d2t = arange). Ties in frequency, and the fill when fewer than N distinct tokens were seen, go to the lower
id, so the vocabulary is deterministic. The train stage saves both tensors in model.safetensors (the drafter
keeps them as buffers, see `Drafter.set_vocab`).
"""
from __future__ import annotations

import torch


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
    """Add the loss-masked tokens of a batch ([B, T] or [T]) to `counts` ([vocab_size] int64) and return it."""
    if input_ids.shape != loss_mask.shape:
        raise ValueError(f"count_tokens: input_ids {tuple(input_ids.shape)} and loss_mask "
                         f"{tuple(loss_mask.shape)} differ")
    ids = input_ids[loss_mask.to(torch.bool)].reshape(-1).long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"count_tokens: token ids outside 0..{vocab_size - 1}")
    c = torch.bincount(ids.cpu(), minlength=vocab_size)
    return c if counts is None else counts + c


def build_draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`size` ids by count -> (d2t [N] long ascending, t2d [V] bool). size 0 or >= V: the full vocabulary."""
    V = counts.numel()
    if size < 0:
        raise ValueError(f"draft_vocab_size={size}: must be >= 0")
    if size == 0 or size >= V:
        return torch.arange(V), torch.ones(V, dtype=torch.bool)
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-counts.long(), stable=True).indices
    d2t = torch.sort(order[:size]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t] = True
    return d2t, t2d


def coverage(counts: torch.Tensor, d2t: torch.Tensor) -> float:
    """Fraction of the counted tokens that the draft vocabulary contains."""
    total = int(counts.sum())
    return float(counts[d2t].sum()) / total if total else float("nan")


def to_eagle3_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's on-disk form: d2t[i] - i."""
    return d2t - torch.arange(d2t.numel(), device=d2t.device)
