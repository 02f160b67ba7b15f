"""The plan written down (`kvshot plan`, pipeline/plan_file.py): the planner's trials of every study, each with the
role, parent and parts the planner gave it, round-tripping through JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.parts import check_parts
from pipeline.plan import plan
from pipeline.plan_file import PlanFile, plan_file

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("profile", [None, "smoke", "study", "paper"])
def test_the_plan_file_holds_every_trial_the_planner_plans(profile):
    cfg = load_config(profile)
    planned = plan_file(cfg)
    for study in cfg.studies:
        trials = plan(cfg, study=study)
        entries = planned.of_study(study)
        assert [e.name for e in entries] == [t.name for t in trials]
        assert [e.parent for e in entries] == [t.depends_on for t in trials]
        assert all(e.config == t.config.model_dump(mode="json") for e, t in zip(entries, trials))
        parts = check_parts(trials, cfg, study)
        for name, members in parts.items():
            assert {e.name for e in entries if name in e.parts} == {t.name for t in members}
        assert not parts or all(e.parts for e in entries)        # parts cover the study
    assert PlanFile.model_validate_json(planned.model_dump_json()) == planned


def test_roles_are_the_planners():
    planned = plan_file(load_config("study"))
    depth = {e.name: e.role for e in planned.of_study("depth")}
    assert depth["kv_only-d4-no_target-token_context"] == "control with context" and depth["eagle3"] == "trial"
    hybrid = planned.of_study("hybrid")
    parents = {e.parent for e in hybrid if e.parent}
    assert parents and all(next(e for e in hybrid if e.name == p).role == "parent" for p in parents)
    continued = [e for e in hybrid if e.config["drafter"]["init"] == "continued"]
    assert continued and all(e.role == "compute-matched control" for e in continued)
    injection = {e.name: e.role for e in planned.of_study("injection")}
    assert list(injection.values()).count("no-target control") == 1
    assert {e.name for e in planned.of_study("block") if e.e2e} == {
        e.name for e in planned.of_study("block") if e.variant == "block" and e.config["train"]["seed"] == 0}
    # the block arms' learning rates are chosen on a validation set, every other study is measured on the eval split
    lr = planned.of_study("block_lr")
    assert {e.config["train"]["lr"] for e in lr} == {0.0003, 0.001, 0.003} and len(lr) == 9
    assert {e.evaluated_on for e in lr} == {"data/validation/small-200.jsonl"}
    assert {e.evaluated_on for e in planned.trials if e.study != "block_lr"} == {"eval split"}
    # and the block study takes them from it (pending before any workspace holds block_lr's runs): its block arms
    pending = {e.name for e in planned.of_study("block") if "pending: block_lr" in e.chosen.get("train.lr", "")}
    assert pending == {e.name for e in planned.of_study("block") if e.variant == "block"} and len(pending) == 11


def test_kvshot_plan_writes_the_json(tmp_path):
    out = tmp_path / "plan.json"
    res = subprocess.run([sys.executable, "-m", "pipeline.cli", "plan", "--profile", "smoke", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].startswith("injection: ")
    data = json.loads(out.read_text())
    assert data["profile"] == "smoke" and data["trials"] == json.loads(plan_file(load_config("smoke"))
                                                                       .model_dump_json())["trials"]


def test_the_planner_names_each_trials_baseline():
    planned = plan_file(load_config("study"))
    base = {(e.study, e.name): e.baseline for e in planned.trials}
    assert base["block", "block-kv-d2"] == base["block", "block-both-d2"] == "block-hidden-d2"
    assert base["block", "block-hidden-d2"] is None and base["block", "eagle3"] is None
    assert base["hybrid", "hybrid-ckpt-s1"] == "eagle3-continued-s1" and base["hybrid", "eagle3-continued"] == "eagle3"
    assert base["depth", "kv_only-d4-s3"] == "eagle3-s3" and base["block", "eagle3.1"] == "eagle3"
    assert base["scale", "eagle3-large-epochs1-from_small_epochs1.5-continued"] == "eagle3-small"


def _rows_of(trials) -> list[dict]:
    """A metrics row per planned trial, its setting columns as evaluate writes them, naming its baseline."""
    sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "report"))
    import make_fixtures as fx

    rows = []
    for t in trials:
        d, tr = t.config.drafter, t.config.train
        fields = {"variant": d.variant, "depth": d.depth, "injection": d.injection, "rope_fix": d.rope_fix,
                  "init": d.init, "scale": tr.scale,
                  **{k: True for k in ("fc_norm", "norm_output", "no_target", "token_context") if getattr(d, k)},
                  **({"block_size": d.block_size, "context": d.context} if d.variant == "block" else {})}
        r = fx.row(t.study, t.name, fields, 0.4, 0.3, tr.seed, 1)
        r.update(trial=t.name, values=t.values, role=t.role, **({"baseline": t.baseline} if t.baseline else {}))
        rows.append(r)
    return rows


@pytest.mark.parametrize("study", sorted(load_config("study").studies))
def test_the_reports_baselines_are_the_planners(tmp_path, study):
    """The report compares each setting with the setting holding the trials the planner named, and the rules it
    reads rows from before rows named one give the same settings; so for the controls it finds by their role."""
    from dataclasses import replace

    from stages.baselines import baseline_for
    from stages.findings import no_target, token_control
    from stages.common import Paths
    from stages.results import collect

    trials = plan(load_config("study"), study=study)
    (tmp_path / "metrics" / "stepwise").mkdir(parents=True)
    (tmp_path / "metrics" / "stepwise" / f"{study}.json").write_text(json.dumps(_rows_of(trials)))
    settings = collect({"studies": [study]}, Paths(tmp_path), draws=100).studies[study]
    compared = 0
    for s in settings:
        named, guessed = baseline_for(s, settings), baseline_for(replace(s, baselines=frozenset()), settings)
        assert named is guessed, f"{study}: {s.trials} compared with {named and named.trials}, " \
                                 f"by the rules with {guessed and guessed.trials}"
        compared += named is not None
    assert compared >= 1 and all(s.baselines == {t.baseline for t in trials if t.name in s.trials} - {None}
                                 for s in settings)
    for s in settings:
        assert s.roles == {t.role for t in trials if t.name in s.trials}
        for which in (no_target, token_control):
            assert which(s) == which(replace(s, roles=frozenset())), f"{study}: {s.trials} {which.__name__}"
    if study in ("injection", "depth"):
        assert any(no_target(s) or token_control(s) for s in settings)


def test_a_sweep_writes_the_plan_it_executes_part_by_part(tmp_path):
    """runs/<study>/plan.json gains each part's trials with their fingerprints, roles, parts and e2e marks; a part
    run again replaces its entries in place; a damaged file is a one-line error naming it."""
    from pipeline.config import ConfigError
    from pipeline.parts import part_filter, plan_part
    from pipeline.plan_file import read_study_plan, study_plan_path, write_study_plan
    from stages.common import Paths

    cfg, paths = load_config("study"), Paths(tmp_path)
    whole = plan(cfg, study="scale")
    parts = check_parts(whole, cfg, "scale")
    assert read_study_plan(paths, "scale") is None
    first = plan_part(whole, part_filter(cfg, "scale", "small-seed0"))
    for t in first:
        t.fingerprint = f"fp-{t.name}"
    write_study_plan(first, paths, parts)
    second = plan_part(plan(cfg, study="scale"), part_filter(cfg, "scale", "large-seed0"))
    for t in second:
        t.fingerprint = f"fp2-{t.name}"
    write_study_plan(second, paths, parts)
    got = {e.name: e for e in read_study_plan(paths, "scale")}
    assert set(got) == {t.name for t in first} | {t.name for t in second}
    assert [e.name for e in read_study_plan(paths, "scale")][:len(first)] == [t.name for t in first]
    reference = {e.name: e for e in plan_file(cfg).of_study("scale")}
    for t in second:
        assert got[t.name].fingerprint == f"fp2-{t.name}"
        assert got[t.name].model_dump(exclude={"fingerprint"}) == reference[t.name].model_dump(exclude={"fingerprint"})
    assert all(e.e2e for e in got.values())                 # the scale study decodes all of its trials

    study_plan_path(paths, "scale").write_text('{"profile": "study"}')
    with pytest.raises(ConfigError, match=r"runs/scale/plan.json: not a plan file"):
        read_study_plan(paths, "scale")
