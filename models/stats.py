"""Intervals for step-wise metrics and decoding rates (DESIGN §4: every value carries a 95% interval).

Two sources of variation, handled each by a method that holds its level:

- **Conversations** (held-out conversations; e2e prompts for decoding rates): a bootstrap. A conversation's counts
  (`valid`, `correct`, `chain`, `chain_correct` per step k, see `models.metrics`) stay together, and a metric of a
  resample is the ratio of the resampled sums, exactly as the point estimate is the ratio of the full sums. With
  several seeds, every seed's counts enter each resample with weight one (seeds are not resampled here).
- **Seeds** (independent training runs of one setting): a t-interval with S - 1 degrees of freedom. Resampling 3
  seeds with replacement spans about the minimum to the maximum of the per-seed values (roughly 75% coverage, not
  95%), so each draw instead adds `Σ_s w_s (m_s - mean m)` over the per-seed metric values m_s of that draw, with
  `w_s = z_s / sqrt(S u)`, z ~ N(0, 1) per seed and u ~ χ²(S - 1) per draw (`seed_t_weights`). Given the per-seed
  values this term is exactly (s / sqrt(S)) · T(S - 1), the t-interval's pivot. A draw is thus the conversation
  bootstrap's value plus the seed term, and the percentile interval of the draws is the convolution of both parts:
  the bootstrap interval when seeds agree, the t-interval when the seed spread dominates (tests/test_stats.py
  measures its coverage on synthetic two-level data at 3 and 5 seeds).
- A difference between two settings is *paired*: both sides use the same conversation weights of a draw (they
  were evaluated on the same conversations). Their seeds are paired too when both ran the same seed labels (seed n
  of each side shares the data order and, for checkpoint-initialised trials, the parent run): both sides then take
  the same seed weights, so the seed term of the difference is the t-interval over the per-seed *differences*.
  Settings with different seed labels draw their seed terms independently (a Welch-like sum of both spreads).
- One seed: no seed term; a verdict resting on it says "one seed" (stages.findings).

A claim "A > B" holds when the interval of A - B lies above 0, fails when it lies below, and is inconclusive
otherwise (`decide`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

COUNT_FIELDS = ("valid", "correct", "chain", "chain_correct")
HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"


# -- the data --------------------------------------------------------------------------------------------------

@dataclass
class ConversationCounts:
    """Step counts of one setting: `data[seed, conversation, field, k]` (fields as COUNT_FIELDS), `ids` the
    conversations' ids (the same order for every seed), `seed_ids` the training seeds in the order of the seed
    axis (None: unknown, never paired)."""

    data: np.ndarray
    ids: list[str]
    seed_ids: list[str] | None = None

    @property
    def seeds(self) -> int:
        return self.data.shape[0]

    @property
    def steps(self) -> int:
        return self.data.shape[-1]

    def select(self, ids: list[str]) -> "ConversationCounts":
        """The same counts on conversations `ids`, in that order (a missing conversation is an error)."""
        where = {c: i for i, c in enumerate(self.ids)}
        missing = [c for c in ids if c not in where]
        if missing:
            raise ValueError(f"conversation {missing[0]!r} has no counts in this setting")
        return ConversationCounts(self.data[:, [where[c] for c in ids]], list(ids), self.seed_ids)

    def by_seed(self) -> "ConversationCounts":
        """The same counts with the seed axis in sorted seed order (as seed weights are indexed); unchanged when
        the seeds cannot be paired (unlabelled or repeated)."""
        if self.pairable_seeds is None:
            return self
        order = sorted(range(self.seeds), key=lambda i: self.seed_ids[i])
        return ConversationCounts(self.data[order], self.ids, [self.seed_ids[i] for i in order])

    @property
    def pairable_seeds(self) -> tuple[str, ...] | None:
        """The sorted seed labels when every seed is labelled once (what another setting must match to pair)."""
        if not self.seed_ids or len(set(self.seed_ids)) != self.seeds or any(s is None for s in self.seed_ids):
            return None
        return tuple(sorted(self.seed_ids))


def counts_array(per_seed: list, ids: list[str] | None = None, seeds: list | None = None) -> ConversationCounts:
    """From one entry per seed: either a list of `StepCounts` (one per conversation) or a packed
    `per_conversation` dict ({"ids", "valid": [[K]...], ...}, as the evaluate stage writes). Seeds must cover the
    same conversations; they are aligned by id. `seeds`: each entry's training seed (for pairing)."""
    labels = None if seeds is None else [None if x is None else str(x) for x in seeds]
    entries = []
    for entry in per_seed:
        if isinstance(entry, dict):
            rows = np.stack([np.asarray(entry[f], dtype=np.int64) for f in COUNT_FIELDS], 1)   # [C, F, K]
            conv = [str(i) for i in entry.get("ids") or range(rows.shape[0])]
        else:
            rows = np.asarray([[getattr(c, f) for f in COUNT_FIELDS] for c in entry], dtype=np.int64)
            conv = [str(i) for i in (ids or range(rows.shape[0]))]
        entries.append((conv, rows))
    first = entries[0][0]
    aligned = []
    for conv, rows in entries:
        if conv != first:
            where = {c: i for i, c in enumerate(conv)}
            if set(where) != set(first):
                raise ValueError("seeds of one setting were evaluated on different conversations")
            rows = rows[[where[c] for c in first]]
        aligned.append(rows)
    return ConversationCounts(np.stack(aligned), list(first), labels)


# -- resampling ------------------------------------------------------------------------------------------------

def multinomial_weights(n: int, draws: int, rng: np.random.Generator) -> np.ndarray:
    """[draws, n] float: how often each of n units is drawn in each resample of size n."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=draws).astype(np.float64)


def seed_t_weights(seeds: int, draws: int, rng: np.random.Generator) -> np.ndarray:
    """[draws, seeds]: weights w with Σ_s w_s (m_s - mean m) ~ (sd(m) / sqrt(S)) · T(S - 1) for any per-seed values
    m (module docstring). Shared by two settings on the same seeds, they give the t pivot of the paired
    differences. Zero for one seed (no seed term)."""
    if seeds < 2:
        return np.zeros((draws, max(seeds, 1)))
    z = rng.standard_normal((draws, seeds))
    u = rng.chisquare(seeds - 1, size=(draws, 1))
    return z / np.sqrt(seeds * u)


def seed_term(per_seed: np.ndarray, seed_weights: np.ndarray) -> np.ndarray:
    """[R]: Σ_s w_rs (m_rs - mean_s m_rs) for per-seed values m [R, S] (NaN where a seed's value is undefined)."""
    dev = per_seed - per_seed.mean(1, keepdims=True)
    return np.einsum("rs,rs->r", seed_weights, dev)


def per_seed_sums(counts: ConversationCounts, conv_weights: np.ndarray) -> np.ndarray:
    """Resampled sums per seed [draws, seeds, field, k]: conversations drawn by `conv_weights` [draws, conv]."""
    return np.einsum("rc,scfk->rsfk", conv_weights, counts.data.astype(np.float64))


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _mat(rates: np.ndarray) -> np.ndarray:
    """1 + Σ_i Π_{j<=i} rate_j over the last axis (NaN counts as 0)."""
    return 1.0 + np.cumprod(np.nan_to_num(rates, nan=0.0), -1).sum(-1)


@dataclass
class Draws:
    """Metrics of every resample (axis 0). `acc`, `alpha`, `chains` are the conversation bootstrap's (seeds pooled
    with weight one); `metric()` adds the seed term where `per_seed` (the same metrics per seed, arrays
    [R * S, K]) and `seed_weights` [R, S] are set."""

    acc: np.ndarray            # [R, K]
    alpha: np.ndarray          # [R, K]
    chains: np.ndarray         # [R, K]
    per_seed: "Draws | None" = None
    seed_weights: np.ndarray | None = None

    @property
    def step_mat(self) -> np.ndarray:
        return _mat(self.acc)

    @property
    def chain_mat(self) -> np.ndarray:
        return _mat(self.alpha)

    @property
    def step_retention(self) -> np.ndarray:
        return _ratio(self.acc[:, -1], self.acc[:, 0])

    @property
    def chain_retention(self) -> np.ndarray:
        return _ratio(self.alpha[:, -1], self.alpha[:, 0])

    def pooled_metric(self, name: str) -> np.ndarray:
        """A metric by name over the pooled resamples: acc_k, alpha_k, step_mat, chain_mat, step_retention,
        chain_retention -> [R] (the conversation part alone)."""
        if name.startswith(("acc_", "alpha_")):
            family, k = name.rsplit("_", 1)
            arr = self.acc if family == "acc" else self.alpha
            return arr[:, int(k)] if int(k) < arr.shape[1] else np.full(arr.shape[0], np.nan)
        return getattr(self, name)

    def seed_values(self, name: str) -> np.ndarray | None:
        """[R, S]: the metric of each seed in each resample (None: one seed or no per-seed draws)."""
        if self.per_seed is None or self.seed_weights is None:
            return None
        return self.per_seed.pooled_metric(name).reshape(self.seed_weights.shape)

    def metric(self, name: str) -> np.ndarray:
        """The metric's draws: the conversation bootstrap plus, with several seeds, the seed t term."""
        base = self.pooled_metric(name)
        values = self.seed_values(name)
        return base if values is None else base + seed_term(values, self.seed_weights)


def draws_from_sums(sums: np.ndarray) -> Draws:
    """[R, field, k] summed counts -> metrics per resample."""
    v, c, ch, chc = (sums[:, i] for i in range(len(COUNT_FIELDS)))
    return Draws(acc=_ratio(c, v), alpha=_ratio(chc, ch), chains=ch)


def resample(counts: ConversationCounts, conv_weights: np.ndarray, seed_weights: np.ndarray | None = None,
             rng: np.random.Generator | None = None) -> Draws:
    """Draws of one setting: conversations by `conv_weights` [R, conv]; with several seeds, the seed term by
    `seed_weights` [R, seeds] (in sorted seed-label order when it pairs with another setting; else drawn from
    `rng`)."""
    sums = per_seed_sums(counts, conv_weights)                           # [R, S, F, K]
    draws = draws_from_sums(sums.sum(1))
    S = counts.seeds
    if S == 1:
        return draws
    R = conv_weights.shape[0]
    w = seed_t_weights(S, R, rng or np.random.default_rng(0)) if seed_weights is None else seed_weights
    if w.shape != (R, S):
        raise ValueError(f"seed weights of shape {w.shape} for {S} seeds and {R} draws")
    draws.per_seed = draws_from_sums(sums.reshape(R * S, *sums.shape[2:]))
    draws.seed_weights = w
    return draws


def bootstrap_counts(counts: ConversationCounts, draws: int = 2000, seed: int = 0,
                     conv_weights: np.ndarray | None = None, seed_weights: np.ndarray | None = None) -> Draws:
    """Resampled metrics of one setting (pass `conv_weights`, and `seed_weights` over its seeds in sorted label
    order, to pair it with another setting)."""
    rng = np.random.default_rng(seed)
    if conv_weights is None:
        conv_weights = multinomial_weights(len(counts.ids), draws, rng)
    if seed_weights is not None:
        counts = counts.by_seed()
    return resample(counts, conv_weights, seed_weights, rng)


def point(counts: ConversationCounts) -> Draws:
    """The full-data metrics (all seeds and conversations once) as a one-draw `Draws`."""
    return draws_from_sums(counts.data.sum((0, 1))[None].astype(np.float64))


# -- intervals and decisions -----------------------------------------------------------------------------------

def interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the resampled values; (nan, nan) when it is undefined: fewer than 20 draws, or more
    than (1 - level) / 2 of them undefined (an α_k whose chains live in a handful of conversations is undefined
    whenever the resample misses them: its interval is not the spread of the draws that happen to hit them)."""
    x = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(x)
    if x.size < 20 or (~finite).mean() > (1 - level) / 2:
        return math.nan, math.nan
    x = x[finite]
    lo, hi = np.quantile(x, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def decide(diff_draws: np.ndarray, level: float = 0.95) -> tuple[str, tuple[float, float]]:
    """A claim "difference > 0": holds when the interval lies above 0, fails below it, else inconclusive."""
    lo, hi = interval(diff_draws, level)
    if math.isnan(lo):
        return INCONCLUSIVE, (lo, hi)
    if lo > 0:
        return HOLDS, (lo, hi)
    if hi < 0:
        return FAILS, (lo, hi)
    return INCONCLUSIVE, (lo, hi)


def ratio_draws(num: np.ndarray, den: np.ndarray, weights: np.ndarray,
                seed_weights: np.ndarray | None = None) -> np.ndarray:
    """Resampled Σnum / Σden over units (prompts) with weights [R, n] (τ = Σ accepted+1 / Σ rounds, tokens/s).
    With num, den of shape [seeds, n] the sums run over every seed (weight one), and each draw adds the seed t term
    of the per-seed ratios by `seed_weights` [R, seeds] (`seed_t_weights`, shared with any setting decoded on the
    same seeds)."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if num.ndim == 1:
        return _ratio(weights @ num, weights @ den)
    if seed_weights is None or seed_weights.shape != (weights.shape[0], num.shape[0]):
        raise ValueError(f"seed weights of shape {getattr(seed_weights, 'shape', None)} for {num.shape[0]} seeds "
                         f"and {weights.shape[0]} draws")
    n_r, d_r = weights @ num.T, weights @ den.T                                       # [R, seeds]
    pooled_ratio = _ratio(n_r.sum(1), d_r.sum(1))
    if num.shape[0] == 1:
        return pooled_ratio
    return pooled_ratio + seed_term(_ratio(n_r, d_r), seed_weights)


def seed_differences(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Per-seed differences a_s - b_s over the seed labels both sides ran (a, b: label -> value)."""
    return {s: a[s] - b[s] for s in sorted(a, key=_label_order) if s in b}


def _label_order(label: str) -> tuple:
    return (0, int(label), "") if str(label).isdigit() else (1, 0, str(label))
