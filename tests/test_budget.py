"""A study part's budget from its trials' measured rows: the rows of each trial's setting found wherever they ran
(its setting read as the report reads a row: a field a row lacks holds its default), replayed as one sweep."""
import json

import pytest

from pipeline.budget import replayed_parts, row_matches
from pipeline.config import load_config


def row(variant, seed=0, wall=None, **fields):
    """A stepwise row as evaluate writes it (a block drafter's own fields with it)."""
    block = {"block_size": fields.pop("block_size", 8)} if variant == "block" else {}
    return {"variant": variant, "depth": fields.pop("depth", 1), "injection": "linear", "rope_fix": False,
            "init": fields.pop("init", "ckpt"), "scale": "small", "seed": seed, "wall_s": wall, **block, **fields}


def test_a_trial_matches_the_rows_of_its_setting_as_the_report_reads_them():
    """A row written before fc_norm, norm_output and no_target existed lacks them: it is a row of the plain
    EAGLE-3 trial, not of EAGLE-3.1 (both norms on), nor of another seed; a block row of another block size or
    context is not the block trial's."""
    from pipeline.budget import setting_of
    from pipeline.plan import plan

    trials = {t.name: t for t in plan(load_config("smoke"), study="block")}
    old = row("eagle3")
    assert row_matches(old, setting_of(trials["eagle3"]))
    assert not row_matches(old, setting_of(trials["eagle3.1"]))
    assert row_matches({**old, "fc_norm": True, "norm_output": True}, setting_of(trials["eagle3.1"]))
    assert not row_matches({**old, "seed": 1}, setting_of(trials["eagle3"]))
    hidden = setting_of(trials["block-hidden"])
    assert row_matches(row("block", context="hidden"), hidden)
    assert not row_matches(row("block", context="kv"), hidden)
    assert not row_matches(row("block", context="hidden", block_size=16), hidden)


def test_a_trial_swept_beyond_the_setting_fields_matches_rows_of_those_values_only():
    """The scale study's large children (train.epochs, train.parent) are not the former design's large rows."""
    from pipeline.budget import setting_of
    from pipeline.plan import plan

    large = next(t for t in plan(load_config("study"), study="scale") if t.name.startswith("hybrid-large-epochs1"))
    want = setting_of(large)
    assert want["values"] == {"train.epochs": 1, "train.parent": {"scale": "small", "epochs": 1.5}}
    former = row("hybrid", scale="large", values={"drafter.variant": "hybrid", "train.scale": "large"})
    assert not row_matches(former, want)
    assert row_matches({**former, "values": large.values}, want)


def test_parts_replay_their_trials_rows_and_name_the_ones_without(tmp_path):
    cfg = load_config("smoke")   # block study: parts `blocks` (hidden, kv) and `autoregressive` (eagle3, eagle3.1)
    rows = [row("block", wall=600.0, context="hidden"), row("block", wall=900.0, context="kv"),
            row("eagle3", wall=300.0)]
    (tmp_path / "block.json").write_text(json.dumps(rows))
    got = replayed_parts(cfg, tmp_path)
    assert got["block/blocks"] == {"trials": 2, "decodes": True, "replayed_s": 900.0,   # two at a time
                                   "unwaved_s": 900.0}                              # no child: no wave to wait for
    assert got["block/autoregressive"]["missing"] == ["eagle3.1"]
    assert got["block/autoregressive"]["decodes"] is False   # the study decodes its block drafters only
    assert got["depth/(whole)"]["missing"]                              # no rows at all


def test_trials_not_run_yet_are_estimated_from_the_paces_of_their_setting(tmp_path):
    """The scale study's large part before it ran: its parent measured (the small part's EAGLE-3), its two children
    estimated at the seconds per step of the small children times their own steps (one epoch of twice the data)."""
    cfg = load_config("study")
    small = [row("eagle3", wall=960.0, scale="small", train_steps=960),
             row("hybrid", wall=1920.0, scale="small", train_steps=960),
             row("eagle3", wall=1440.0, scale="small", init="continued", train_steps=960)]
    (tmp_path / "scale.json").write_text(json.dumps(small))
    got = replayed_parts(cfg, tmp_path)
    assert got["scale/small-seed0"]["replayed_s"] == 960.0 + 1920.0
    large = got["scale/large-seed0"]
    assert large["missing"] == large["estimated"] and len(large["estimated"]) == 2
    # 640 steps per epoch at 3,000 conversations -> 1,280 at 6,000; the hybrid's 2 s per step after its parent
    assert large["estimated_s"] == 960.0 + 1280 * 2.0
    # another seed of measured settings: every trial estimated, at the same paces
    assert got["scale/small-seed1"]["estimated_s"] == 960.0 + 1920.0
    assert "estimated_s" not in got["depth/seed0-deep"]       # no row of any of its settings: no estimate


def test_a_control_without_rows_is_paced_like_the_drafter_of_its_shape_that_reads_the_target(tmp_path):
    """The control with context at depth 4 before it ran: estimated at the 4-layer KV-only drafter's seconds per
    step (same layers and attention widths); without that drafter's rows it stays unestimated."""
    cfg = load_config("study")
    (tmp_path / "depth.json").write_text(json.dumps([row("kv_only", depth=4, wall=3000.0, train_steps=960)]))
    deep = replayed_parts(cfg, tmp_path)["depth/seed0-deep"]
    assert deep["missing"] == ["kv_only-d4-no_target-token_context"] == deep["estimated"]
    assert deep["estimated_s"] == 3000.0                    # two slots: the control beside its drafter
    (tmp_path / "depth.json").write_text(json.dumps([row("kv_only", depth=2, wall=3000.0, train_steps=960)]))
    assert "estimated_s" not in replayed_parts(cfg, tmp_path)["depth/seed0-deep"]


def test_a_study_without_rows_is_paced_by_its_settings_rows_in_other_studies(tmp_path):
    """block_lr sweeps the learning rate of the block study's drafters: before it ran, its trials are estimated at
    the block rows' seconds per step (a learning rate changes no step's cost)."""
    cfg = load_config("study")
    block = [row("block", depth=2, context=c, wall=3000.0, train_steps=1000) for c in ("hidden", "kv", "both")]
    (tmp_path / "block.json").write_text(json.dumps(block))
    got = replayed_parts(cfg, tmp_path)["block_lr/lr-hidden"]
    assert sorted(got["estimated"]) == sorted(got["missing"]) and len(got["missing"]) == 3
    assert got["estimated_s"] > 0


def test_estimates_prefer_paces_measured_here_beside_other_trials(tmp_path):
    """A step's time differs between machines and between a trial alone on every CPU and two side by side: a setting's rows measured on this machine at a trial's own share of threads (1 in the study
    profile) set its pace, before rows measured alone here, before rows from elsewhere or without a record."""
    cfg = load_config("study")
    here = "2 CPU cores (AMD EPYC, native bf16), 23 GiB RAM, no GPU"
    block = [row("block", depth=2, context="both", wall=1000.0, train_steps=1000),                # unrecorded
             row("block", depth=2, context="both", wall=2000.0, train_steps=1000, machine="another", threads=1.0)]
    (tmp_path / "block.json").write_text(json.dumps(block))

    def lr_both(machine):
        return replayed_parts(cfg, tmp_path, machine)["block_lr/lr-both"]["estimated_s"]

    everywhere = lr_both(here)                              # nothing measured here: every row's pace, 1.5 s a step
    alone = block + [row("block", depth=2, context="both", wall=3000.0, train_steps=1000, machine=here, threads=1.9)]
    (tmp_path / "block.json").write_text(json.dumps(alone))
    assert lr_both(here) == pytest.approx(everywhere * 3.0 / 1.5)
    beside = alone + [row("block", depth=2, context="both", wall=4000.0, train_steps=1000, machine=here, threads=1.0)]
    (tmp_path / "block.json").write_text(json.dumps(beside))
    assert lr_both(here) == pytest.approx(everywhere * 4.0 / 1.5)
    assert lr_both(None) == pytest.approx(everywhere * (1.0 + 2.0 + 3.0 + 4.0) / 4 / 1.5)   # no machine named


def test_the_training_a_part_has_left_is_its_unfinished_trials_replayed_at_their_paces(tmp_path):
    """`kvshot repro --dry-run`: the scale study's large part with its parent finished has its two children left,
    one after the other's wave (the same replay as the report's); nothing left is 0, a trial without a pace None."""
    from pipeline.budget import rows_in, training_left_s
    from pipeline.plan import plan

    cfg = load_config("study")
    (tmp_path / "scale.json").write_text(json.dumps([row("hybrid", wall=1920.0, scale="small", train_steps=960)]))
    (tmp_path / "block.json").write_text(json.dumps([row("block", wall=50.0, context="kv")]))
    rows = rows_in(tmp_path, tmp_path / "missing")
    assert len(rows) == 2
    large = [t for t in plan(cfg, study="scale") if "large" in t.name and t.config.train.seed == 0]
    hybrid = [t for t in large if t.variant == "hybrid"]
    assert training_left_s(cfg, hybrid, rows) == 1280 * 2.0     # one epoch of 6,000 conversations at 2 s a step
    assert training_left_s(cfg, [], rows) == 0.0
    assert training_left_s(cfg, large, rows) is None           # EAGLE-3 continued has no pace here


def test_a_part_replays_trials_other_studies_trained_and_paces_eagle3_1_like_eagle3(tmp_path):
    """The block study's autoregressive part at seed 0 on a new split: EAGLE-3, KV-only, the hybrid and EAGLE-3
    continued are the depth and hybrid studies' trials (adopted by fingerprint), so their times there are measured
    ones; EAGLE-3.1, trained nowhere yet, is paced like EAGLE-3 (its norms add no layer)."""
    cfg = load_config("study")
    (tmp_path / "depth.json").write_text(json.dumps([row("eagle3", wall=1000.0, train_steps=1000),
                                                     row("kv_only", depth=4, wall=3000.0, train_steps=1000)]))
    (tmp_path / "hybrid.json").write_text(json.dumps([row("hybrid", wall=2000.0, train_steps=1000),
                                                      row("eagle3", init="continued", wall=1500.0, train_steps=1000)]))
    got = replayed_parts(cfg, tmp_path)["block/ar-seed0"]
    assert got["missing"] == got["estimated"] == ["eagle3.1"]
    # EAGLE-3.1: 1,000 steps (the rows' steps) at EAGLE-3's 1 s a step. Wave 1: KV-only (3,000 s) beside EAGLE-3
    # then EAGLE-3.1; wave 2, after it: the hybrid (2,000 s) beside EAGLE-3 continued (1,500 s)
    assert got["estimated_s"] == pytest.approx(3000.0 + 2000.0)
    assert replayed_parts(cfg, tmp_path / "nowhere")["block/ar-seed0"]["missing"] == [
        "eagle3", "eagle3.1", "kv_only-d4", "hybrid-ckpt", "eagle3-continued"]
