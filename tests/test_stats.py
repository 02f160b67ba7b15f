"""Bootstrap intervals (models.stats): coverage on synthetic Bernoulli data, paired differences, seeds, decisions."""
import numpy as np
import pytest

from models.metrics import StepCounts
from models.stats import (FAILS, HOLDS, INCONCLUSIVE, ConversationCounts, bootstrap_counts, counts_array, decide,
                          interval, multinomial_weights, point, ratio_draws)


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
    w1 = interval(bootstrap_counts(one, draws=800).acc[:, 0])
    w3 = interval(bootstrap_counts(three, draws=800).acc[:, 0])
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
    sw = multinomial_weights(3, 1000, np.random.default_rng(6))
    paired = bootstrap_counts(a, conv_weights=w, seed_weights=sw).acc[:, 0] - \
        bootstrap_counts(b, conv_weights=w, seed_weights=sw).acc[:, 0]
    assert decide(paired)[0] == HOLDS
    apart = bootstrap_counts(a, conv_weights=w, seed=1).acc[:, 0] - \
        bootstrap_counts(b, conv_weights=w, seed=2).acc[:, 0]
    assert decide(apart)[0] == INCONCLUSIVE
    assert a.pairable_seeds == b.pairable_seeds == ("0", "1", "2")
    assert ConversationCounts(b.data, b.ids, ["0", "0", "1"]).pairable_seeds is None
    unlabelled = ConversationCounts(b.data, b.ids, [None, "1", "0"])      # a row from before seeds were recorded
    assert unlabelled.pairable_seeds is None and unlabelled.by_seed() is unlabelled
    with pytest.raises(ValueError, match="seed weights"):
        bootstrap_counts(a, conv_weights=w, seed_weights=sw[:, :2])
