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


def test_kvshot_plan_writes_the_json(tmp_path):
    out = tmp_path / "plan.json"
    res = subprocess.run([sys.executable, "-m", "pipeline.cli", "plan", "--profile", "smoke", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].startswith("injection: ")
    data = json.loads(out.read_text())
    assert data["profile"] == "smoke" and data["trials"] == json.loads(plan_file(load_config("smoke"))
                                                                       .model_dump_json())["trials"]
