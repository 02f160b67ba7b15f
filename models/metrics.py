"""Step-wise drafter metrics (DESIGN §4): acc_k, α_k, MAT, retention, aggregatable over batches.

From per-step masks over the same positions -- `valid[k]` (step k is scored there) and `correct[k]` (the
drafter's top-1 at step k equals the target's top-1) -- count:
- acc_k = #(valid_k & correct_k) / #valid_k  (unconditional, teacher-forced);
- α_k   = #(chain_k & correct_k) / #chain_k, where chain_k = valid_0..k all true and correct_0..k-1 all true
  (a position enters step k's acceptance only if the chain of drafts before it was accepted); α_0 = acc_0.
Counts add over batches, so α over a data set is the ratio of summed counts, not a mean of batch ratios.
An empty denominator gives NaN for that step.

MAT (step-wise, chain) = 1 + Σ_{i<K} Π_{j<=i} α_j (a NaN α counts as 0: nothing got that far).
Retention = α_{K-1} / α_0 (α_6/α_0 for K = 7); NaN when α_0 is 0 or NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class StepCounts:
    """Per-step counters (lists of K ints)."""

    valid: list[int]
    correct: list[int]
    chain: list[int]
    chain_correct: list[int]

    @classmethod
    def zeros(cls, k: int) -> "StepCounts":
        return cls([0] * k, [0] * k, [0] * k, [0] * k)

    @property
    def steps(self) -> int:
        return len(self.valid)

    def __add__(self, other: "StepCounts") -> "StepCounts":
        if other.steps != self.steps:
            raise ValueError(f"StepCounts: cannot add {other.steps} steps to {self.steps}")
        return StepCounts(*[[a + b for a, b in zip(x, y)] for x, y in
                            ((self.valid, other.valid), (self.correct, other.correct),
                             (self.chain, other.chain), (self.chain_correct, other.chain_correct))])

    @property
    def acc(self) -> list[float]:
        return [c / v if v else math.nan for c, v in zip(self.correct, self.valid)]

    @property
    def alpha(self) -> list[float]:
        return [c / v if v else math.nan for c, v in zip(self.chain_correct, self.chain)]

    def to_dict(self) -> dict:
        return {"valid": self.valid, "correct": self.correct, "chain": self.chain,
                "chain_correct": self.chain_correct}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCounts":
        return cls(list(d["valid"]), list(d["correct"]), list(d["chain"]), list(d["chain_correct"]))


def step_counts(correct: torch.Tensor, valid: torch.Tensor) -> StepCounts:
    """correct, valid: bool `[K, ...]` over the same positions (step first). Returns the counts."""
    if correct.shape != valid.shape:
        raise ValueError(f"step_counts: correct {tuple(correct.shape)} and valid {tuple(valid.shape)} differ")
    K = correct.shape[0]
    correct = correct.reshape(K, -1).bool()
    valid = valid.reshape(K, -1).bool()
    ok = correct & valid
    chain = valid.cumprod(0).bool()
    prev_ok = torch.ones_like(ok[:1])
    prev = torch.cat([prev_ok, ok[:-1].cumprod(0).bool()], 0)   # steps 0..k-1 all correct
    chain = chain & prev
    return StepCounts(valid=valid.sum(1).tolist(), correct=ok.sum(1).tolist(), chain=chain.sum(1).tolist(),
                      chain_correct=(chain & correct).sum(1).tolist())


def mat(alpha: list[float]) -> float:
    """Mean accepted tokens of a chain draft: 1 + Σ_i Π_{j<=i} α_j."""
    total, prod = 1.0, 1.0
    for a in alpha:
        prod *= 0.0 if math.isnan(a) else a
        total += prod
    return total


def retention(alpha: list[float]) -> float:
    """α_{K-1} / α_0."""
    if not alpha or math.isnan(alpha[0]) or alpha[0] == 0:
        return math.nan
    return alpha[-1] / alpha[0]


def summary(counts: StepCounts) -> dict:
    """acc, alpha (lists), mat and retention in one dict (the evaluate stage's row fields)."""
    a = counts.alpha
    return {"acc": counts.acc, "alpha": a, "mat": mat(a), "retention": retention(a)}
