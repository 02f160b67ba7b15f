"""Losslessness checks on decoded token lists (what the e2e stage reports as `exact_match` and `lossless`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def first_divergence(reference: list[int], output: list[int]) -> int | None:
    """Index of the first position where the two token lists differ (a length mismatch counts); None if equal."""
    for i, (a, b) in enumerate(zip(reference, output)):
        if a != b:
            return i
    return None if len(reference) == len(output) else min(len(reference), len(output))


def exact_match(reference: list[int], output: list[int]) -> bool:
    return first_divergence(reference, output) is None


@dataclass
class LosslessCheck:
    lossless: bool           # identical, or the first divergence sits at a near-tie of the reference's logits
    exact: bool
    divergence: int | None   # index into the generated tokens
    gap: float | None        # reference's logit(top-1) - logit(output token) at the divergence


def lossless_at_near_tie(reference: list[int], reference_logits: list[torch.Tensor] | torch.Tensor,
                         output: list[int], tolerance: float) -> LosslessCheck:
    """Greedy losslessness up to rounding: outputs must agree until a first divergence where the token the output
    chose scores within `tolerance` of the reference's top-1 in the reference's own logits (bf16 near-tie).

    `reference_logits[i]` [V] are plain greedy's logits when it chose `reference[i]`. A divergence that is only a
    length difference (one run stopped earlier) is lossless only if the shorter one ended at the same point.
    """
    d = first_divergence(reference, output)
    if d is None:
        return LosslessCheck(True, True, None, 0.0)
    if d >= len(reference) or d >= len(output):
        return LosslessCheck(False, False, d, None)
    row = reference_logits[d].float()
    gap = float(row.max() - row[output[d]])
    return LosslessCheck(gap <= tolerance, False, d, gap)
