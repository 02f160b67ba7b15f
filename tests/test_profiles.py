"""Every profile's every study, smoke-tested at tiny sizes: each planned trial (controls included) resolves, and
each distinct drafter setting trains a few steps, evaluates and is checkpointed by the real train stage on a tiny
target. The full DAG runs on the smoke profile in tests/test_repro.py; this covers the other profiles' grids."""
from __future__ import annotations

import json

import pytest

from pipeline.config import load_config, profile_path
from pipeline.parts import check_parts
from pipeline.plan import plan
from stages.common import Paths, TargetParams
from stages.evaluate import EvalParams
from stages.evaluate import run as evaluate
from stages.train import online_source
from stages.train import run as train
from test_train import Log, conversations, peaked_target

PROFILES = sorted(p.stem for p in profile_path("smoke").parent.glob("*.yaml")) + ["default"]


def _settings(profile: str) -> list:
    """The trials of every study of a profile, one per distinct drafter setting (seeds and data scales aside)."""
    cfg = load_config(profile)
    seen, out = set(), []
    for study in cfg.studies:
        for trial in plan(cfg, study=study):
            d = trial.config.drafter
            key = json.dumps(d.model_dump(), sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(trial)
    return out


@pytest.mark.parametrize("profile", PROFILES)
def test_every_study_of_the_profile_plans(profile):
    cfg = load_config(profile)
    assert cfg.studies, profile
    for study in cfg.studies:
        trials = plan(cfg, study=study)
        assert trials and len({t.name for t in trials}) == len(trials), study
        names = {t.name for t in trials}
        assert all(t.depends_on in names for t in trials if t.depends_on), study
        # every checkpoint-initialised hybrid / cross-only gets its compute-matched baseline in the same plan
        ckpt = [t for t in trials if t.variant in ("hybrid", "cross_only") and t.config.drafter.init == "ckpt"]
        continued = [t for t in trials if t.variant == "eagle3" and t.config.drafter.init == "continued"]
        assert {c.depends_on for c in ckpt} <= {c.depends_on for c in continued}, study
        check_parts(trials, cfg, study)   # run part by part, the study would finish


@pytest.fixture(scope="module")
def tiny():
    target = peaked_target()
    return target, online_source(target, conversations(n=4, T=16)), online_source(target, conversations(n=2, seed=1))


@pytest.mark.parametrize("profile", PROFILES)
def test_every_drafter_setting_of_the_profile_trains_and_evaluates_at_tiny_size(tmp_path, tiny, profile):
    target, source, held_out = tiny
    for trial in _settings(profile):
        drafter = trial.config.drafter.model_copy(update={"draft_vocab_size": 40})
        params = trial.config.train.model_copy(update={"max_steps": 2, "batch_size": 2, "precision": "fp32",
                                                       "log_every": 1, "continue_from": None})
        parent = tmp_path / profile / "parent"
        if trial.depends_on and not (parent / "model.safetensors").is_file():
            base = drafter.model_copy(update={"variant": "eagle3", "init": "ckpt", "no_target": False})
            train(base, params, parent, Paths(tmp_path), Log(), target=TargetParams(), source=source,
                  loaded_target=target)
        run_dir = tmp_path / profile / trial.name
        summary = train(drafter, params, run_dir, Paths(tmp_path), Log(), target=TargetParams(), source=source,
                        loaded_target=target, init_from=parent if trial.depends_on else None)
        assert summary["finished"], trial.name
        (row,) = evaluate(EvalParams(batch_size=2), [run_dir], Paths(tmp_path), Log(), target=TargetParams(),
                          source=held_out, loaded_target=target)
        assert row["variant"] == drafter.variant and len(row["acc"]) >= 1, trial.name


def _shape(cfg, study: str) -> list[tuple]:
    """What a study's plan is, sizes aside: each trial's name, values, role, parent, baseline and parts."""
    trials = plan(cfg, study=study)
    parts = check_parts(trials, cfg, study)
    return [(t.name, json.dumps(t.values, sort_keys=True), t.role, t.depends_on, t.baseline,
             sorted(p for p, members in parts.items() if t in members)) for t in trials]


@pytest.mark.parametrize("profile", PROFILES)
def test_a_fast_dev_run_plans_the_same_trials_at_the_smoke_sizes(profile):
    """`kvshot repro --fast-dev-run`: every study, trial, parent, role and part of the profile, at the smoke
    profile's sizes and in fp32, under a name (so a workspace) of its own."""
    from pipeline.config import flatten
    from pipeline.fast_dev_run import SIZE_KEYS, shrink, workspace_name

    cfg, smoke_cfg = load_config(profile), load_config("smoke")
    smoke = flatten(smoke_cfg)
    name = workspace_name(profile)
    assert name == f"{profile}-fast-dev-run" and workspace_name(f"/x/{profile}.yaml") == name
    small = shrink(cfg, name)
    tree = flatten(small)
    assert small.profile == name and small.target.dtype == "float32" and small.train.precision == "fp32"
    assert all(tree[key] == smoke[key] for key in SIZE_KEYS)
    assert list(small.data.scales) == list(cfg.data.scales)          # the names studies use, smoke's sizes
    assert sorted(small.data.scales.values())[:2] == sorted(smoke_cfg.data.scales.values())[:len(cfg.data.scales)]
    assert all(s.max_conversations == 60 for s in small.data.sources.values())
    assert small.train.epochs == cfg.train.epochs and small.e2e.paper_tree == cfg.e2e.paper_tree
    assert {k: s.model_dump(exclude={"validation"}) for k, s in small.studies.items()} == \
        {k: s.model_dump(exclude={"validation"}) for k, s in cfg.studies.items()}
    for study in cfg.studies:
        assert _shape(small, study) == _shape(cfg, study), study
