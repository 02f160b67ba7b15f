"""Step-wise metrics: acc_k vs α_k, aggregation over batches, MAT and retention, on hand-made cases."""
import math

import pytest
import torch

from models.metrics import StepCounts, mat, retention, step_counts, summary


def _t(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_hand_made_chain():
    # 4 positions, 3 steps
    correct = _t([[1, 1, 1, 0],
                  [1, 0, 1, 1],
                  [0, 1, 1, 1]])
    valid = torch.ones_like(correct)
    c = step_counts(correct, valid)
    assert c.acc == [0.75, 0.75, 0.75]
    # step 1 conditions on step 0 correct (positions 0,1,2): correct at 0 and 2 -> 2/3
    # step 2 conditions on steps 0,1 correct (positions 0,2): correct at 2 only -> 1/2
    assert c.alpha == pytest.approx([0.75, 2 / 3, 0.5])
    assert c.chain == [4, 3, 2] and c.chain_correct == [3, 2, 1]
    assert mat(c.alpha) == pytest.approx(1 + 0.75 + 0.75 * 2 / 3 + 0.75 * 2 / 3 * 0.5)
    assert retention(c.alpha) == pytest.approx(0.5 / 0.75)


def test_invalid_steps_leave_the_chain():
    correct = _t([[1, 1], [1, 1], [1, 0]])
    valid = _t([[1, 1], [0, 1], [1, 1]])
    c = step_counts(correct, valid)
    # position 0 is not scored at step 1, so it cannot enter step 2's acceptance either
    assert c.valid == [2, 1, 2] and c.chain == [2, 1, 1]
    assert c.alpha == [1.0, 1.0, 0.0]
    assert c.acc == [1.0, 1.0, 0.5]


def test_alpha_relations_to_acc():
    g = torch.Generator().manual_seed(0)
    correct = torch.rand(7, 500, generator=g) < 0.7
    valid = torch.ones_like(correct)
    c = step_counts(correct, valid)
    assert c.alpha[0] == c.acc[0]
    # Π_{j<=k} α_j = fraction of positions whose first k+1 steps are all correct
    prod = 1.0
    for k, a in enumerate(c.alpha):
        prod *= a
        assert prod == pytest.approx(correct[:k + 1].all(0).float().mean().item())
        assert prod <= c.acc[k] + 1e-12
    # independent errors: α_k ~ acc_k
    assert c.alpha[3] == pytest.approx(c.acc[3], abs=0.1)
    # perfectly dependent errors (a position is right at every step or none): α_k = 1 for k > 0
    dep = (torch.rand(1, 200, generator=g) < 0.6).expand(7, 200)
    d = step_counts(dep, torch.ones_like(dep))
    assert d.alpha[1:] == [1.0] * 6 and mat(d.alpha) == pytest.approx(1 + 7 * d.alpha[0])


def test_counts_aggregate_like_one_batch():
    g = torch.Generator().manual_seed(1)
    correct = torch.rand(4, 300, generator=g) < 0.6
    valid = torch.rand(4, 300, generator=g) < 0.9
    whole = step_counts(correct, valid)
    parts = step_counts(correct[:, :100], valid[:, :100]) + step_counts(correct[:, 100:], valid[:, 100:])
    assert parts == whole
    assert StepCounts.from_dict(whole.to_dict()) == whole
    assert StepCounts.zeros(4) + whole == whole
    with pytest.raises(ValueError, match="steps"):
        whole + StepCounts.zeros(3)


def test_edge_cases():
    c = step_counts(_t([[0, 0], [1, 1]]), _t([[1, 1], [1, 1]]))
    assert c.alpha[0] == 0 and math.isnan(c.alpha[1])          # nothing reached step 1
    assert mat(c.alpha) == 1.0
    assert math.isnan(retention(c.alpha))
    s = summary(step_counts(_t([[1], [1]]), _t([[1], [1]])))
    assert s["mat"] == 3.0 and s["retention"] == 1.0 and s["alpha"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="differ"):
        step_counts(_t([[1]]), _t([[1, 1]]))


def test_chain_stops_where_the_data_leaves_the_targets_greedy_path():
    """A chain goes past step j only if the drafter was right *and* the data token fed to step j+1 is the target's
    top-1 there; step accuracy ignores agreement."""
    correct = _t([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    valid = torch.ones_like(correct)
    agree = _t([[1, 0, 1], [1, 1, 1], [1, 1, 1]])    # position 1's data leaves the greedy path after step 0
    c = step_counts(correct, valid, agree)
    assert c.acc == [1.0, 1.0, 2 / 3]
    assert c.chain == [3, 2, 2] and c.chain_correct == [3, 2, 1]
    assert c.agree == [2, 3, 3] and c.agreement == pytest.approx(2 / 3)
    assert step_counts(correct, valid).chain == [3, 3, 3]       # without agree: the data is the greedy path
    s = summary(c)
    assert s["step_mat"] == pytest.approx(mat(c.acc)) and s["chain_mat"] == pytest.approx(mat(c.alpha))
    assert s["step_retention"] == pytest.approx(2 / 3) and s["chains"] == [3, 2, 2]
    assert StepCounts.from_dict(c.to_dict()) == c
