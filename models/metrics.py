"""Step-wise drafter metrics (DESIGN §4): two families, never mixed, aggregatable over batches.

From per-step masks over the same positions -- `valid[k]` (step k is scored there), `correct[k]` (the drafter's
top-1 at step k equals the target's top-1) and, optionally, `agree[k]` (the teacher-forced data token that step
k+1 is fed equals the target's greedy top-1 there) -- count:

- **step accuracy** acc_k = #(valid_k & correct_k) / #valid_k: unconditional, teacher-forced, with the drafter's
  own hidden states: the per-step accuracy EAGLE-3 / SpecForge log and the paper's α_k (flat for a drafter
  without target information, falling for one that drifts);
  step MAT = 1 + Σ_{i<K} Π_{j<=i} acc_j, step retention = acc_{K-1} / acc_0;
- **chain acceptance** α_k = #(chain_k & correct_k) / #chain_k, where chain_k = valid_0..k all true and, for
  every j < k, correct_j and agree_j: a position enters step k only if every earlier draft was accepted *and* the
  data token fed after it is the token decoding would have accepted (so the teacher-forced chain is the chain
  tree decoding sees); α_0 = acc_0. Chain MAT and chain retention as above from α; `chain` holds the number of
  chains alive at each k.

Counts add over batches and over conversations, so a metric over a data set is the ratio of summed counts, not a
mean of batch ratios (and the per-conversation counts are what `models.stats` resamples for intervals). An empty
denominator gives NaN for that step; a NaN counts as 0 in a MAT (nothing got that far).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FIELDS = ("valid", "correct", "chain", "chain_correct")


@dataclass
class StepCounts:
    """Per-step counters (lists of K ints); `agree` counts valid positions whose next data token is the target's
    greedy top-1 (empty when unknown)."""

    valid: list[int]
    correct: list[int]
    chain: list[int]
    chain_correct: list[int]
    agree: list[int] = field(default_factory=list)

    @classmethod
    def zeros(cls, k: int) -> "StepCounts":
        return cls([0] * k, [0] * k, [0] * k, [0] * k, [0] * k)

    @property
    def steps(self) -> int:
        return len(self.valid)

    def __add__(self, other: "StepCounts") -> "StepCounts":
        if other.steps != self.steps:
            raise ValueError(f"StepCounts: cannot add {other.steps} steps to {self.steps}")
        agree = [a + b for a, b in zip(self.agree, other.agree)] if self.agree and other.agree else []
        return StepCounts(*[[a + b for a, b in zip(getattr(self, f), getattr(other, f))] for f in FIELDS], agree)

    @property
    def acc(self) -> list[float]:
        return [c / v if v else math.nan for c, v in zip(self.correct, self.valid)]

    @property
    def alpha(self) -> list[float]:
        return [c / v if v else math.nan for c, v in zip(self.chain_correct, self.chain)]

    @property
    def agreement(self) -> float:
        """Share of scored step-0 positions where the data token after the draft is the target's greedy token."""
        return self.agree[0] / self.valid[0] if self.agree and self.valid and self.valid[0] else math.nan

    def to_dict(self) -> dict:
        out = {f: getattr(self, f) for f in FIELDS}
        if self.agree:
            out["agree"] = self.agree
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "StepCounts":
        return cls(*[list(d[f]) for f in FIELDS], list(d.get("agree") or []))


def step_counts(correct: torch.Tensor, valid: torch.Tensor, agree: torch.Tensor | None = None) -> StepCounts:
    """correct, valid (and agree): bool `[K, ...]` over the same positions (step first). Returns the counts.

    Without `agree` the data is taken to be the target's own greedy continuation everywhere."""
    if correct.shape != valid.shape or (agree is not None and agree.shape != valid.shape):
        raise ValueError(f"step_counts: correct {tuple(correct.shape)}, valid {tuple(valid.shape)}"
                         + ("" if agree is None else f" and agree {tuple(agree.shape)}") + " differ")
    K = correct.shape[0]
    correct = correct.reshape(K, -1).bool()
    valid = valid.reshape(K, -1).bool()
    agree = torch.ones_like(valid) if agree is None else agree.reshape(K, -1).bool()
    ok = correct & valid
    accepted = ok & agree                                        # the chain goes on past step j
    prev = torch.cat([torch.ones_like(ok[:1]), accepted[:-1].cumprod(0).bool()], 0)   # steps 0..k-1 accepted
    chain = valid.cumprod(0).bool() & prev
    return StepCounts(valid=valid.sum(1).tolist(), correct=ok.sum(1).tolist(), chain=chain.sum(1).tolist(),
                      chain_correct=(chain & correct).sum(1).tolist(), agree=(valid & agree).sum(1).tolist())


def mat(alpha: list[float]) -> float:
    """Mean accepted tokens of a chain draft: 1 + Σ_i Π_{j<=i} α_j (the step MAT when given acc_k)."""
    total, prod = 1.0, 1.0
    for a in alpha:
        prod *= 0.0 if a is None or math.isnan(a) else a
        total += prod
    return total


def retention(alpha: list[float]) -> float:
    """α_{K-1} / α_0 (acc_{K-1} / acc_0 for the step family)."""
    if not alpha or alpha[0] is None or math.isnan(alpha[0]) or alpha[0] == 0:
        return math.nan
    last = alpha[-1]
    return math.nan if last is None else last / alpha[0]


def summary(counts: StepCounts) -> dict:
    """Both families' fields of an evaluate row: acc, step_mat, step_retention; alpha, chain_mat,
    chain_retention, chains (α_k's denominators); `mat`/`retention` are the chain ones (kept for old readers)."""
    acc, a = counts.acc, counts.alpha
    return {"acc": acc, "step_mat": mat(acc), "step_retention": retention(acc),
            "alpha": a, "chain_mat": mat(a), "chain_retention": retention(a), "chains": list(counts.chain),
            "mat": mat(a), "retention": retention(a), "agreement": counts.agreement}
