"""The evaluate stage: step-wise α_k / acc_k / MAT / retention of trained drafters on a tiny target."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from models.metrics import mat, step_counts
from stages import checkpoint as ckpt
from stages.common import Paths, StageError, TargetParams
from stages.evaluate import EvalParams, run, stepwise_masks, write_stepwise
from stages.train import DrafterParams, TrainParams, online_source
from stages.train import run as train_run
from test_train import Log, conversations, peaked_target


@pytest.fixture(scope="module")
def target():
    return peaked_target()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target):
    """Two short training runs (eagle3, kv_only) sharing one training set."""
    root = tmp_path_factory.mktemp("runs")
    src = online_source(target, conversations(n=4))
    dirs = []
    for variant in ("eagle3", "kv_only"):
        d = root / variant
        train_run(DrafterParams(variant=variant, draft_vocab_size=40),
                  TrainParams(max_steps=8, batch_size=2, lr=5e-3, precision="fp32", log_every=4),
                  d, Paths(root), Log(), target=TargetParams(), source=src, loaded_target=target)
        dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def held_out(target):
    return online_source(target, conversations(n=3, T=14, seed=1))


def test_rows_have_alpha_acc_mat_retention(tmp_path, target, trained, held_out):
    log = Log()
    rows = run(EvalParams(batch_size=2), trained, Paths(tmp_path), log, target=TargetParams(), source=held_out,
               loaded_target=target)
    assert [r["variant"] for r in rows] == ["eagle3", "kv_only"]
    for r in rows:
        for key in ("trial", "variant", "depth", "injection", "rope_fix", "init", "scale", "seed", "alpha", "acc",
                    "mat", "retention", "n_positions"):
            assert key in r, key
        K = 7
        assert len(r["alpha"]) == K and len(r["acc"]) == K
        assert all(0.0 <= a <= 1.0 for a in r["alpha"] if not math.isnan(a))
        assert r["alpha"][0] == r["acc"][0]
        assert r["mat"] == pytest.approx(mat(r["alpha"]))
        prod, expect = 1.0, 1.0
        for a in r["alpha"]:
            prod *= 0.0 if math.isnan(a) else a
            expect += prod
        assert r["mat"] == pytest.approx(expect) and 1.0 <= r["mat"] <= 1.0 + K
        if r["alpha"][0] > 0 and not math.isnan(r["alpha"][-1]):
            assert r["retention"] == pytest.approx(r["alpha"][-1] / r["alpha"][0])
        # every assistant token after the first two positions of each conversation is scored at step 0
        assert r["n_positions"] == sum(sum(m[2:]) for _, m in conversations(n=3, T=14, seed=1))
    # the α_k curve of each drafter reaches the report callback with step = k
    curves = [(s, m) for s, m in log.rows if s is not None]
    assert [s for s, _ in curves] == list(range(7)) * 2
    assert [m["alpha"] for _, m in curves[:7]] == rows[0]["alpha"]
    out = tmp_path / "metrics" / "stepwise" / "study.json"
    write_stepwise(rows, out)
    assert [r["trial"] for r in json.loads(out.read_text())] == ["eagle3", "kv_only"]


def ttt_counts(model, batch, W, steps: int = 7):
    """The training unroll's own counts (scored against the target's draft-vocabulary distribution)."""
    from models.ttt import ttt_unroll

    with torch.no_grad():
        return ttt_unroll(model, batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                          features=batch.features if model.config.uses_features else None,
                          target_kv=batch.kv if model.config.reads_kv else None, target_hidden=batch.last_hidden,
                          lm_head_weight=W, steps=steps).counts


def old_stepwise_masks(model, batch, W, steps: int, strict: bool = True):
    """stepwise_masks as it was: the full unroll's logits at every position, the target's full logits."""
    from models.ttt import ttt_unroll
    from stages.evaluate import _shift

    logits = torch.nn.functional.linear(batch.last_hidden.to(W.dtype), W)
    with torch.no_grad():
        out = ttt_unroll(model, batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                         features=batch.features if model.config.uses_features else None,
                         target_kv=batch.kv if model.config.reads_kv else None, target_logits=logits,
                         steps=steps, return_logits=True)
    top = logits.argmax(-1)
    scored = batch.loss_mask.bool() & batch.attention_mask.bool()
    correct, valid, agree = [], [], []
    for k, z in enumerate(out.logits):
        want = _shift(top, 1 + k, -1)
        v = _shift(scored, 2 + k, False)
        if not strict:
            v = v & _shift(model.t2d[top], 1 + k, False)
        correct.append(model.d2t[z.argmax(-1)] == want)
        valid.append(v)
        agree.append(_shift(batch.input_ids, 2 + k, -1) == want)
    return torch.stack(correct), torch.stack(valid), torch.stack(agree)


@pytest.mark.parametrize("strict", [True, False])
def test_stepwise_masks_equal_the_full_unrolls(target, trained, held_out, strict):
    """The loss-free unroll gives the masks and counts of the full unroll with full target logits (correct is
    only computed, and only meaningful, where valid); the cached top-1 gives the same again."""
    W = target.lm_head.weight
    batch = held_out.batch([0, 1, 2])
    cap = target.capture(batch.input_ids, attention_mask=batch.attention_mask.long())
    top = torch.nn.functional.linear(cap.last_hidden, W).max(-1)
    for run_dir in trained:
        model, _ = ckpt.load_drafter(run_dir, target)
        c0, v0, a0 = old_stepwise_masks(model, batch, W, 7, strict)
        c1, v1, a1, _ = stepwise_masks(model, batch, W, 7, strict)
        assert torch.equal(v1, v0) and torch.equal(a1, a0) and torch.equal(c1 & v1, c0 & v0)
        assert step_counts(c1, v1, a1) == step_counts(c0, v0, a0)
        batch.top1, batch.top1_logit = top.indices, top.values
        c2, v2, a2, _ = stepwise_masks(model, batch, W, 7, strict)
        batch.top1, batch.top1_logit = None, None
        assert torch.equal(v2, v0) and torch.equal(a2 & v2, a0 & v0) and torch.equal(c2, c1)


def test_strict_scoring_counts_out_of_vocabulary_as_misses(target, trained, held_out):
    """Without strictness the masks reproduce the TTT's own counts; strict scoring only adds misses."""
    model, _ = ckpt.load_drafter(trained[0], target)
    batch = held_out.batch([0, 1, 2])
    W = target.lm_head.weight
    correct, valid, _, out = stepwise_masks(model, batch, W, steps=7, strict=False)
    out.counts = ttt_counts(model, batch, W)
    assert step_counts(correct, valid) == out.counts
    s_correct, s_valid, _, _ = stepwise_masks(model, batch, W, steps=7, strict=True)
    assert torch.equal(s_correct, correct) and (s_valid >= valid).all()
    strict, loose = step_counts(s_correct, s_valid), out.counts
    assert strict.correct == loose.correct and all(a >= b for a, b in zip(strict.valid, loose.valid))


def test_bad_inputs_are_one_line_stage_errors(tmp_path, target, trained, held_out):
    with pytest.raises(StageError, match="no trained drafter") as e:
        run(EvalParams(), [tmp_path / "missing"], Paths(tmp_path), Log(), target=TargetParams(), source=held_out,
            loaded_target=target)
    assert "\n" not in str(e.value)
    with pytest.raises(StageError, match="eval: no feature cache") as e:
        run(EvalParams(), trained, Paths(tmp_path), Log(), target=TargetParams(), loaded_target=target)
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(StageError, match="no assistant turn") as e:
        run(EvalParams(data=str(bad)), trained, Paths(tmp_path), Log(), target=TargetParams(), loaded_target=target)
    assert "\n" not in str(e.value)


def test_eval_data_jsonl_runs_the_target_on_any_conversations(tmp_path, embedded_tokenizer):
    """eval.data=PATH: conversations in the DESIGN §10 schema, tokenised with the target's chat template."""
    from models.target import tiny_target
    from stages.features import tokenize_conversation

    tgt = tiny_target("llama", num_layers=6, hidden_size=48, num_heads=6, num_kv_heads=2,
                      vocab_size=len(embedded_tokenizer), tokenizer=embedded_tokenizer)
    run_dir = tmp_path / "runs" / "eagle3"
    train_run(DrafterParams(variant="eagle3", draft_vocab_size=64), TrainParams(max_steps=1, precision="fp32"),
              run_dir, Paths(tmp_path), Log(), target=TargetParams(),
              source=online_source(tgt, conversations(n=2)), loaded_target=tgt)
    rows = [{"id": "a", "source": "mine", "messages": [{"role": "user", "content": "Name three colours."},
                                                        {"role": "assistant", "content": "Red, green and blue."}]},
            {"id": "b", "source": "mine", "messages": [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "2+2?"},
                                                        {"role": "assistant", "content": "Four."}]}]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = Log()
    out = run(EvalParams(data=str(path)), [run_dir], Paths(tmp_path), log, target=TargetParams(), loaded_target=tgt)
    masks = [tokenize_conversation(embedded_tokenizer, r["messages"])[1] for r in rows]
    assert len(out) == 1 and len(out[0]["alpha"]) == 7
    assert out[0]["n_positions"] == sum(sum(m[2:]) for m in masks) > 0
    one = run(EvalParams(data=str(path), max_conversations=1), [run_dir], Paths(tmp_path), Log(),
              target=TargetParams(), loaded_target=tgt)
    assert one[0]["n_positions"] == sum(masks[0][2:])


def test_reads_the_eval_feature_cache(tmp_path, target, trained):
    from test_train import write_cache

    convs = conversations(n=3, T=14, seed=1)
    write_cache(tmp_path / "data" / "features" / "eval", target, convs, name="eval")
    paths = Paths(tmp_path)
    rows = run(EvalParams(), trained[:1], paths, Log(), target=TargetParams(), loaded_target=target)
    assert rows[0]["n_positions"] == sum(sum(m[2:]) for _, m in convs)
    # the same conversations run online give the same counts (fp32 cache)
    online = run(EvalParams(), trained[:1], paths, Log(), target=TargetParams(), loaded_target=target,
                 source=online_source(target, convs))
    assert online[0]["counts"] == rows[0]["counts"]
    few = run(EvalParams(max_conversations=2, max_len=10), trained[:1], paths, Log(), target=TargetParams(),
              loaded_target=target)
    assert few[0]["n_positions"] == sum(sum(m[2:10]) for _, m in convs[:2])


def test_rows_keep_per_conversation_counts_and_both_families(tmp_path, target, trained, held_out, capsys):
    rows = run(EvalParams(batch_size=2), trained[:1], Paths(tmp_path), Log(), target=TargetParams(),
               source=held_out, loaded_target=target)
    r = rows[0]
    per = r["per_conversation"]
    assert len(per["ids"]) == len(held_out) == len(per["valid"])
    for f in ("valid", "correct", "chain", "chain_correct"):
        assert [sum(c[k] for c in per[f]) for k in range(7)] == r["counts"][f]
    assert r["step_mat"] == pytest.approx(mat(r["acc"])) and r["chain_mat"] == pytest.approx(mat(r["alpha"]))
    assert r["chains"] == r["counts"]["chain"] and 0 <= r["agreement"] <= 1
    assert r["acc_6_se"] >= 0 and "alpha_6_se" in r
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "acc_6" in out and "(se" in out
