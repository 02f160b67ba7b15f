"""Bootstrap intervals for step-wise metrics and decoding rates (DESIGN §4: every value carries a 95% interval).

The unit of resampling is a held-out conversation (an e2e prompt for decoding rates): its counts (`valid`,
`correct`, `chain`, `chain_correct` per step k, see `models.metrics`) stay together, and a metric of a resample
is the ratio of the resampled sums, exactly as the point estimate is the ratio of the full sums.

- One setting, one seed: conversations are drawn with replacement (multinomial weights).
- Several seeds of one setting (independent training runs): each draw also resamples the seeds with replacement,
  so the interval covers run-to-run variation as well as the choice of conversations.
- A difference between two settings is *paired*: both sides use the same conversation weights of a draw (they
  were evaluated on the same conversations). Their seeds are paired too when both ran the same seed labels: seed
  n of each side shares the data order and, for trials initialised from an EAGLE-3 checkpoint, the parent run, so
  a draw takes the same seeds on both sides (pass the same `seed_weights`). Settings with different seed labels
  are resampled independently. Pairing never biases a difference (each side alone is resampled as before); it
  only keeps what the two sides share out of the difference's spread.

Intervals are percentile intervals of `draws` resamples. A claim "A > B" holds when the interval of A - B lies
above 0, fails when it lies below, and is inconclusive otherwise (`decide`).
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


def pooled(counts: ConversationCounts, conv_weights: np.ndarray, rng: np.random.Generator,
           seed_weights: np.ndarray | None = None) -> np.ndarray:
    """Resampled sums [draws, field, k]: seeds drawn with replacement per draw (by `seed_weights` [draws, seeds]
    when given, to pair with another setting on the same seeds; else from `rng`), conversations by
    `conv_weights`."""
    per_seed = np.einsum("rc,scfk->rsfk", conv_weights, counts.data.astype(np.float64))   # [R, S, F, K]
    S = counts.seeds
    if S == 1:
        return per_seed[:, 0]
    seed_w = multinomial_weights(S, conv_weights.shape[0], rng) if seed_weights is None else seed_weights
    if seed_w.shape != (conv_weights.shape[0], S):
        raise ValueError(f"seed weights of shape {seed_w.shape} for {S} seeds and {conv_weights.shape[0]} draws")
    return np.einsum("rs,rsfk->rfk", seed_w, per_seed)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _mat(rates: np.ndarray) -> np.ndarray:
    """1 + Σ_i Π_{j<=i} rate_j over the last axis (NaN counts as 0)."""
    return 1.0 + np.cumprod(np.nan_to_num(rates, nan=0.0), -1).sum(-1)


@dataclass
class Draws:
    """Metrics of every resample (axis 0), plus the point estimates from the full data."""

    acc: np.ndarray            # [R, K]
    alpha: np.ndarray          # [R, K]
    chains: np.ndarray         # [R, K]

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

    def metric(self, name: str) -> np.ndarray:
        """A metric by name: acc_k, alpha_k, step_mat, chain_mat, step_retention, chain_retention -> [R]."""
        if name.startswith(("acc_", "alpha_")):
            family, k = name.rsplit("_", 1)
            arr = self.acc if family == "acc" else self.alpha
            return arr[:, int(k)] if int(k) < arr.shape[1] else np.full(arr.shape[0], np.nan)
        return getattr(self, name)


def draws_from_sums(sums: np.ndarray) -> Draws:
    """[R, field, k] summed counts -> metrics per resample."""
    v, c, ch, chc = (sums[:, i] for i in range(len(COUNT_FIELDS)))
    return Draws(acc=_ratio(c, v), alpha=_ratio(chc, ch), chains=ch)


def bootstrap_counts(counts: ConversationCounts, draws: int = 2000, seed: int = 0,
                     conv_weights: np.ndarray | None = None, seed_weights: np.ndarray | None = None) -> Draws:
    """Resampled metrics of one setting (pass `conv_weights`, and `seed_weights` over its seeds in sorted label
    order, to pair it with another setting)."""
    rng = np.random.default_rng(seed)
    if conv_weights is None:
        conv_weights = multinomial_weights(len(counts.ids), draws, rng)
    if seed_weights is not None:
        counts = counts.by_seed()
    return draws_from_sums(pooled(counts, conv_weights, rng, seed_weights))


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
    With num, den of shape [seeds, n] the sums run over seeds too, each draw taking the seeds by `seed_weights`
    [R, seeds] (drawn with replacement, shared with any setting run on the same seeds)."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if num.ndim == 1:
        return _ratio(weights @ num, weights @ den)
    if seed_weights is None or seed_weights.shape != (weights.shape[0], num.shape[0]):
        raise ValueError(f"seed weights of shape {getattr(seed_weights, 'shape', None)} for {num.shape[0]} seeds "
                         f"and {weights.shape[0]} draws")
    per_seed = lambda x: weights @ x.T                   # noqa: E731  [R, seeds]
    return _ratio(np.einsum("rs,rs->r", seed_weights, per_seed(num)),
                  np.einsum("rs,rs->r", seed_weights, per_seed(den)))
