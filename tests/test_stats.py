"""Bootstrap intervals (models.stats): coverage on synthetic Bernoulli data, paired differences, seeds, decisions."""
import numpy as np
import pytest

from models.metrics import StepCounts
from models.stats import (FAILS, HOLDS, INCONCLUSIVE, ConversationCounts, bootstrap_counts, counts_array, decide,
                          interval, multinomial_weights, point, ratio_draws, seed_differences, seed_t_weights)


def synthetic(p: list[float], n_conv: int, rng, tokens=(5, 40)) -> ConversationCounts:
    """Conversations of random length, each position correct with probability p[k] at step k (independent)."""
    K = len(p)
    data = np.zeros((1, n_conv, 4, K), dtype=np.int64)
    for c in range(n_conv):
        n = rng.integers(*tokens)
        hits = rng.random((K, n)) < np.asarray(p)[:, None]
        data[0, c, 0] = n
        data[0, c, 1] = hits.sum(1)
        data[0, c, 2] = n
        data[0, c, 3] = hits.sum(1)
    return ConversationCounts(data, [str(i) for i in range(n_conv)])


def test_interval_covers_a_known_p_at_the_stated_rate():
    """The 95% interval of acc_0 covers the true p in 90-99% of 200 synthetic data sets."""
    rng = np.random.default_rng(0)
    p, hits = 0.37, 0
    for i in range(200):
        counts = synthetic([p], n_conv=60, rng=rng)
        lo, hi = interval(bootstrap_counts(counts, draws=400, seed=i).acc[:, 0])
        hits += lo <= p <= hi
    assert 0.90 <= hits / 200 <= 0.99, hits


def test_paired_difference_is_tighter_than_unpaired_and_decides():
    """Two drafters on the same conversations, one slightly better on every conversation: the paired interval of
    the difference excludes 0 although the two single intervals overlap."""
    rng = np.random.default_rng(1)
    base = synthetic([0.5], n_conv=80, rng=rng, tokens=(5, 200))
    better = ConversationCounts(base.data.copy(), base.ids)
    better.data[0, :, 1] = np.minimum(better.data[0, :, 0], base.data[0, :, 1] + 1)
    better.data[0, :, 3] = better.data[0, :, 1]
    w = multinomial_weights(80, 1000, np.random.default_rng(2))
    a, b = bootstrap_counts(better, conv_weights=w), bootstrap_counts(base, conv_weights=w)
    verdict, (lo, hi) = decide(a.acc[:, 0] - b.acc[:, 0])
    assert verdict == HOLDS and lo > 0
    ia, ib = interval(a.acc[:, 0]), interval(b.acc[:, 0])
    assert ia[0] < ib[1]                                          # the single intervals overlap
    assert decide(b.acc[:, 0] - a.acc[:, 0])[0] == FAILS
    assert decide(a.acc[:, 0] - a.acc[:, 0][::-1])[0] == INCONCLUSIVE


def test_seeds_widen_the_interval_and_align_by_conversation():
    rng = np.random.default_rng(3)
    one = synthetic([0.4, 0.3], n_conv=50, rng=rng)
    lucky = ConversationCounts(one.data.copy(), one.ids)
    lucky.data[0, :, 1] = np.minimum(lucky.data[0, :, 0], lucky.data[0, :, 1] + 3)
    three = ConversationCounts(np.concatenate([one.data, lucky.data, one.data]), one.ids)
    w1 = interval(bootstrap_counts(one, draws=800).metric("acc_0"))
    w3 = interval(bootstrap_counts(three, draws=800).metric("acc_0"))
    assert (w3[1] - w3[0]) > (w1[1] - w1[0])
    # packed per-conversation dicts in another order are aligned by id
    packed = [{"ids": one.ids, **{f: one.data[0, :, i].tolist() for i, f in enumerate(("valid", "correct", "chain",
                                                                                        "chain_correct"))}}]
    rev = [{k: v[::-1] for k, v in packed[0].items()}]
    both = counts_array(packed + rev)
    assert np.array_equal(both.data[0], both.data[1])
    sc = [StepCounts([3, 2], [1, 1], [3, 1], [1, 0]), StepCounts([2, 2], [2, 0], [2, 2], [2, 0])]
    arr = counts_array([sc])
    assert point(arr).acc[0].tolist() == [0.6, 0.25] and point(arr).step_mat[0] == pytest.approx(1 + 0.6 + 0.15)
    with pytest.raises(ValueError, match="different conversations"):
        counts_array([packed[0], {**packed[0], "ids": [f"x{i}" for i in range(50)]}])


def test_ratio_draws_and_too_few_values():
    w = multinomial_weights(4, 300, np.random.default_rng(0))
    tau = ratio_draws([10, 20, 30, 40], [5, 10, 15, 20], w)
    assert np.allclose(tau, 2.0)
    assert np.isnan(interval(np.full(10, 0.5))[0])
    assert decide(np.full(5, 1.0))[0] == INCONCLUSIVE


def test_seeds_shared_by_two_settings_pair_the_difference():
    """Three seeds whose run-to-run spread is shared by both settings (seed n: the same parent checkpoint), one
    setting a little better at every seed: resampling the seeds together decides the difference; resampling them
    independently leaves it to the seed spread."""
    rng = np.random.default_rng(4)
    base = synthetic([0.5], n_conv=120, rng=rng, tokens=(20, 60))
    seeds = []
    for shift in (-6, 0, 6):                       # a large seed effect, common to both settings
        d = base.data.copy()
        d[0, :, 1] = np.clip(d[0, :, 1] + shift, 0, d[0, :, 0])
        seeds.append(d)
    b = ConversationCounts(np.concatenate(seeds), base.ids, ["0", "1", "2"])
    a = ConversationCounts(b.data.copy(), base.ids, ["2", "0", "1"])
    a.data[:, :, 1] = np.minimum(a.data[:, :, 0], a.data[:, :, 1] + 1)
    a.data[:] = a.data[[2, 0, 1]]                   # the seed axis in another order: aligned by label
    a.data[:, :, 3] = a.data[:, :, 1]
    w = multinomial_weights(120, 1000, np.random.default_rng(5))
    sw = seed_t_weights(3, 1000, np.random.default_rng(6))
    paired = bootstrap_counts(a, conv_weights=w, seed_weights=sw).metric("acc_0") - \
        bootstrap_counts(b, conv_weights=w, seed_weights=sw).metric("acc_0")
    assert decide(paired)[0] == HOLDS
    apart = bootstrap_counts(a, conv_weights=w, seed=1).metric("acc_0") - \
        bootstrap_counts(b, conv_weights=w, seed=2).metric("acc_0")
    assert decide(apart)[0] == INCONCLUSIVE
    assert a.pairable_seeds == b.pairable_seeds == ("0", "1", "2")
    assert ConversationCounts(b.data, b.ids, ["0", "0", "1"]).pairable_seeds is None
    unlabelled = ConversationCounts(b.data, b.ids, [None, "1", "0"])      # a row from before seeds were recorded
    assert unlabelled.pairable_seeds is None and unlabelled.by_seed() is unlabelled
    with pytest.raises(ValueError, match="seed weights"):
        bootstrap_counts(a, conv_weights=w, seed_weights=sw[:, :2])


# -- coverage at few seeds -------------------------------------------------------------------------------------

def two_level(effect: float, seeds: int, rng, n_conv: int = 60, seed_sd: float = 0.04) -> tuple:
    """Two settings on the same conversations and paired seeds: conversation difficulty shared by both, a seed
    effect per seed and setting (training-run variation, sd `seed_sd`: it dominates), true difference `effect`."""
    difficulty = rng.normal(0, 0.08, n_conv)
    valid = rng.integers(150, 250, n_conv)
    def one(shift: float) -> np.ndarray:
        data = np.zeros((seeds, n_conv, 4, 1), dtype=np.int64)
        for s in range(seeds):
            p = np.clip(0.45 + shift + rng.normal(0, seed_sd) + difficulty, 0.01, 0.99)
            hits = rng.binomial(valid, p)
            data[s, :, 0, 0] = data[s, :, 2, 0] = valid
            data[s, :, 1, 0] = data[s, :, 3, 0] = hits
        return data
    ids, labels = [str(i) for i in range(n_conv)], [str(s) for s in range(seeds)]
    return ConversationCounts(one(effect), ids, labels), ConversationCounts(one(0.0), ids, labels)


def coverage(seeds: int, method: str, reps: int = 400, draws: int = 400) -> float:
    """How often the 95% interval of A - B (acc_0) covers the true difference, over `reps` synthetic studies.
    Truth: the expected difference over conversations and training runs, `effect` (p is linear in the shifts, so
    clipping aside the population difference is exactly `effect`)."""
    rng = np.random.default_rng(seeds)
    effect, hits = 0.03, 0
    for _ in range(reps):
        a, b = two_level(effect, seeds, rng)
        w = multinomial_weights(len(a.ids), draws, rng)
        if method == "t":
            sw = seed_t_weights(seeds, draws, rng)
            diff = bootstrap_counts(a, conv_weights=w, seed_weights=sw).metric("acc_0") - \
                bootstrap_counts(b, conv_weights=w, seed_weights=sw).metric("acc_0")
        else:       # the former method: seeds drawn with replacement, paired
            sw = multinomial_weights(seeds, draws, rng)
            per = lambda c: np.einsum("rs,rc,sc->r", sw, w, c.data[:, :, 1, 0]) / \
                np.einsum("rs,rc,sc->r", sw, w, c.data[:, :, 0, 0])     # noqa: E731
            diff = per(a) - per(b)
        lo, hi = interval(diff)
        hits += lo <= effect <= hi
    return hits / reps


@pytest.mark.parametrize("seeds", [3, 5])
def test_seed_t_interval_holds_its_level_where_seeds_dominate(seeds):
    """At 3 and 5 seeds, with the between-seed spread dominating, the 95% interval covers the truth in 92-98% of
    400 synthetic studies; resampling the seeds with replacement (the former method) under-covers."""
    assert 0.92 <= coverage(seeds, "t") <= 0.98
    assert coverage(seeds, "multinomial") < 0.92


def test_seed_term_is_the_t_pivot_of_the_per_seed_values():
    """Σ_s w_s (m_s - mean m) with the seed weights is (sd / sqrt(S)) · T(S-1): its 97.5% quantile over many
    draws is t(0.975, S-1) · sd / sqrt(S) for fixed per-seed values; one seed gives no seed term."""
    m = np.array([0.074, 0.213, 0.152])
    w = seed_t_weights(3, 200_000, np.random.default_rng(0))
    term = w @ (m - m.mean())
    half = np.quantile(term, 0.975)
    assert half == pytest.approx(4.303 * m.std(ddof=1) / np.sqrt(3), rel=0.03)
    lo, hi = m.mean() - half, m.mean() + half
    assert lo < 0 < hi          # B's three per-seed differences: inconclusive by the t-interval
    assert not seed_t_weights(1, 10, np.random.default_rng(0)).any()
    assert seed_differences({"0": 0.5, "1": 0.7, "10": 0.1}, {"1": 0.6, "0": 0.4}) == pytest.approx({"0": 0.1, "1": 0.1})


# -- several claims decided together (stages.findings.family_wise) --------------------------------------------

def _normal_draws(mu: float, n: int = 20_000) -> np.ndarray:
    """Draws whose percentile interval at any level is mu ± z·1 (exact normal quantiles, no sampling noise)."""
    from statistics import NormalDist
    return mu + np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])


def _claims_at(means: dict[str, float | None]):
    """verdicts_at(level) for claims whose difference draws are N(mean, 1); None: not measured."""
    from stages.findings import MISSING, Verdict
    draws = {c: _normal_draws(m) for c, m in means.items() if m is not None}

    def at(level: float) -> list:
        return [Verdict(c, "", decide(draws[c], level)[0] if c in draws else MISSING, "") for c in means]
    return at


@pytest.mark.parametrize("means, want", [
    # A is decided at 1 - 0.05/3 (z 2.39), then B at 1 - 0.05/2 (z 2.24): Holm decides what Bonferroni (z 2.39
    # for every claim) would not
    ({"A": 5.0, "B": 2.3, "C": 0.5, "D": None}, {"A": HOLDS, "B": HOLDS, "C": INCONCLUSIVE}),
    # B holds alone (z 1.96) but not with two claims still open (z 2.24)
    ({"A": 5.0, "B": 2.1, "C": 0.5}, {"A": HOLDS, "B": INCONCLUSIVE, "C": INCONCLUSIVE}),
    # a claim that does not hold is decided like one that holds; an inconclusive one stays so
    ({"A": -5.0, "B": 3.0, "C": -1.0}, {"A": FAILS, "B": HOLDS, "C": INCONCLUSIVE}),
    # with nothing decided at the first step, nothing is decided
    ({"A": 2.2, "B": 2.2}, {"A": INCONCLUSIVE, "B": INCONCLUSIVE}),
])
def test_claims_decided_together_by_holms_step_down(means, want):
    from stages.findings import family_wise
    assert family_wise(_claims_at(means), 0.95) == want
    alone = {v.claim: v.verdict for v in _claims_at(means)(0.95) if v.claim in want}
    # never decides what the claim alone does not
    assert all(want[c] == INCONCLUSIVE or want[c] == alone[c] for c in want)
