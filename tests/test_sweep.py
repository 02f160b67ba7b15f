"""The sweep runner: planning (pure), fingerprints, and real local Ray Tune sweeps with injected quick trials."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from pipeline.config import ConfigError, load_config, parse_overrides, with_values
from pipeline.fingerprint import HashCache, data_hashes, fingerprint, path_hash
from pipeline.console import show_plan
from pipeline.cost import estimated_cost, schedule_order, time_left
from pipeline.executor import trial_slots
from pipeline.forward import Forward
from pipeline.plan import plan, waves
from pipeline.plan_file import read_study_plan
from pipeline.standalone import fingerprint_trials
from pipeline.sweep import run_sweep
from pipeline.trial import cached_result
from stages.common import Paths

ROOT = Path(__file__).resolve().parent.parent


def smoke():
    return load_config("smoke")


# -- planning ----------------------------------------------------------------------------------------------------

def test_adhoc_grid_names_and_study():
    trials = plan(smoke(), parse_overrides(["depth=1,2,3,4"]))
    assert [t.name for t in trials] == ["kv_only-d1", "kv_only-d2", "kv_only-d3", "kv_only-d4"]
    assert {t.study for t in trials} == {"adhoc"}
    assert [t.config.drafter.depth for t in trials] == [1, 2, 3, 4]
    assert all(t.config.drafter.variant == "kv_only" for t in trials)   # the profile's variant
    assert plan(smoke(), parse_overrides(["depth=1,2"]), study="mine")[0].study == "mine"


def test_two_axes_cartesian_and_single_values_apply_to_all():
    trials = plan(smoke(), parse_overrides(["depth=1,2", "injection=linear,head_concat", "train.lr=0.01"]))
    assert len(trials) == 4
    assert [t.name for t in trials] == ["kv_only-d1-linear", "kv_only-d1-head_concat",
                                        "kv_only-d2-linear", "kv_only-d2-head_concat"]
    assert all(t.config.train.lr == 0.01 for t in trials)
    assert len({t.name for t in trials}) == 4


def test_study_expansion_grid_plus_include():
    cfg = load_config("default")
    depth = plan(cfg, study="depth")
    assert [t.name for t in depth] == ["kv_only-d1", "kv_only-d2", "kv_only-d4", "eagle3"]
    inj = plan(cfg, study="injection")
    assert [t.name for t in inj] == ["kv_only-linear-norope", "kv_only-linear-ropefix", "kv_only-head_concat",
                                     "kv_only-no_target", "eagle3"]
    assert next(t for t in inj if t.name == "kv_only-no_target").config.drafter.no_target
    assert {t.study for t in inj} == {"injection"}
    # an axis on top of a study replaces its grid axis
    assert sorted(t.name for t in plan(cfg, parse_overrides(["depth=2,3"]), study="depth")) == \
        ["eagle3-d2", "eagle3-d3", "kv_only-d2", "kv_only-d3"]


def test_hybrid_ckpt_depends_on_eagle3_of_same_scale():
    cfg = load_config("default")
    trials = plan(cfg, study="scale")
    by = {t.name: t for t in trials}
    assert by["hybrid-small"].depends_on == "eagle3-small"
    assert by["hybrid-large"].depends_on == "eagle3-large"
    first, second = waves(trials)
    assert {t.name for t in first} == {"eagle3-small", "eagle3-large"}
    assert {t.name for t in second} == {"hybrid-small", "hybrid-large", "eagle3-small-continued",
                                        "eagle3-large-continued"}
    # parents already finished (cached or adopted from another study) need no wave of their own
    children = [t for t in trials if t.variant == "hybrid"]
    assert [{t.name for t in w} for w in waves(children, finished={"eagle3-small", "eagle3-large"})] == [
        {"hybrid-small", "hybrid-large"}]


def test_missing_parent_is_added_first_and_shared():
    trials = plan(smoke(), parse_overrides(["variant=hybrid,cross_only", "init=ckpt"]))
    names = [t.name for t in trials]
    assert names[0] == "eagle3" and len(trials) == 4
    assert {t.depends_on for t in trials[1:]} == {"eagle3"}
    assert names[-1] == "eagle3-continued" and trials[-1].config.drafter.init == "continued"
    parent = trials[0].config
    assert parent.drafter.variant == "eagle3" and parent.train == trials[1].config.train
    # random init needs no parent
    assert [t.depends_on for t in plan(smoke(), parse_overrides(["variant=hybrid", "init=random"]))] == [None]


def test_seeds_make_one_parent_per_seed():
    cfg = with_values(smoke(), {"studies": {"h": {"grid": {"drafter.variant": ["hybrid"]}, "seeds": [0, 1]}}})
    trials = plan(cfg, study="h")
    by = {t.name: t for t in trials}
    assert set(by) == {"hybrid-s0", "hybrid-s1", "eagle3-s0", "eagle3-s1", "eagle3-s0-continued",
                       "eagle3-s1-continued"}
    assert by["hybrid-s1"].depends_on == "eagle3-s1" and by["eagle3-s1"].config.train.seed == 1
    assert by["eagle3-s1-continued"].depends_on == "eagle3-s1"


def test_a_resolved_profile_plans_what_the_profile_plans(tmp_path, monkeypatch):
    """A workspace's params.yaml is the profile resolved and written out, defaults included: a study whose grid has
    a train.seed axis must plan the same trials there (a written-out default `seeds` once replaced that axis)."""
    from pipeline.dvc_workspace import prepare_workspace

    cfg = with_values(smoke(), {"studies": {"h": {"grid": {"drafter.variant": ["hybrid"], "train.seed": [1, 2]}}}})
    monkeypatch.setenv("KVSHOT_WORKSPACES", str(tmp_path))
    resolved = load_config(str(prepare_workspace(cfg, "mine") / "params.yaml"))
    names = [t.name for t in plan(cfg, study="h")]
    assert names == [t.name for t in plan(resolved, study="h")]
    assert set(names) == {"hybrid-s1", "hybrid-s2", "eagle3-s1", "eagle3-s2", "eagle3-s1-continued",
                          "eagle3-s2-continued"}
    both = with_values(cfg, {"studies": {"h": {"grid": {"train.seed": [1, 2]}, "seeds": [0]}}})
    with pytest.raises(ConfigError, match=r"studies.h: both `seeds` and the grid axis train.seed"):
        plan(both, study="h")


def test_continued_control_once_per_parent_and_shared_across_studies():
    """Every ckpt child gets its compute-matched baseline: the parent eagle3 continued for the same schedule, added
    once per parent (hybrid and cross-only from one parent share it), with the same config in every study, so its
    fingerprint is the same and it is trained once (adopted elsewhere)."""
    from pipeline.fingerprint import config_hash

    cfg = load_config("default")
    hyb = plan(cfg, study="hybrid")
    cont = [t for t in hyb if t.config.drafter.init == "continued"]
    assert [t.name for t in cont] == ["eagle3-continued"] and cont[0].depends_on == "eagle3"
    assert cont[0].config.train == next(t for t in hyb if t.name == "hybrid-ckpt").config.train
    scale = {t.name: t for t in plan(cfg, study="scale")}
    small = scale["eagle3-small-continued"]
    assert config_hash(small.config) == config_hash(cont[0].config)
    assert config_hash(scale["eagle3-small"].config) == config_hash(next(t for t in hyb if t.name == "eagle3").config)
    parent_fp = "f" * 64
    assert fingerprint(small.config, {}, parent_fp) == fingerprint(cont[0].config, {}, parent_fp)
    # random-init children need no control; a control asked for directly gets its parent
    assert not any(t.config.drafter.init == "continued"
                   for t in plan(smoke(), parse_overrides(["variant=hybrid", "init=random"])))
    direct = plan(smoke(), parse_overrides(["variant=eagle3", "init=continued"]))
    assert [(t.name, t.depends_on) for t in direct] == [("eagle3", None), ("eagle3-continued", "eagle3")]
    assert direct[0].config.drafter.init == "ckpt"


def test_part_of_a_plan_keeps_its_names_parents_and_controls():
    """`--only`: a study run in parts names each trial as the whole study does, so the parts combine by name; a
    ckpt child keeps the parent it loads and the control it is compared with."""
    from pipeline.parts import plan_part

    trials = plan(load_config("default"), study="scale")
    small = plan_part(trials, parse_overrides(["train.scale=small"]))
    assert {t.name for t in small} == {"eagle3-small", "hybrid-small", "eagle3-small-continued"}
    assert [t.name for t in small] == [t.name for t in trials if t.name in {x.name for x in small}]
    hybrid = plan_part(trials, parse_overrides(["variant=hybrid", "scale=large"]))
    assert {t.name for t in hybrid} == {"eagle3-large", "hybrid-large", "eagle3-large-continued"}
    controls = plan_part(trials, parse_overrides(["variant=eagle3", "init=continued"]))
    assert {t.name for t in controls} == {"eagle3-small", "eagle3-large", "eagle3-small-continued",
                                          "eagle3-large-continued"}
    with pytest.raises(ConfigError, match=r"--only train.scale=huge: no trial of the plan"):
        plan_part(trials, parse_overrides(["train.scale=huge"]))


def test_children_of_a_parent_trained_on_other_settings():
    """`train.parent`: large-data children start from the small scale's eagle3 (the one the plan already holds, not
    a copy), each with a control continued for the child's own schedule; a part of the large children keeps that
    parent and their control, not the small children's."""
    from pipeline.fingerprint import config_hash
    from pipeline.parts import plan_part

    large = {"drafter.variant": "hybrid", "train.scale": "large", "train.epochs": 2,
             "train.parent": {"scale": "small", "epochs": 1}}
    cfg = with_values(smoke(), {"studies": {"s": {"grid": {"drafter.variant": ["eagle3", "hybrid"],
                                                           "train.scale": ["small"]}, "include": [large]}}})
    trials = plan(cfg, study="s")
    by = {t.name: t for t in trials}
    child = by["hybrid-large-epochs2-from_small_epochs1"]
    control = by["eagle3-large-epochs2-from_small_epochs1-continued"]
    assert set(by) == {"eagle3-small", "hybrid-small", "eagle3-small-continued", child.name, control.name}
    assert child.depends_on == control.depends_on == "eagle3-small" == by["hybrid-small"].depends_on
    assert (control.config.train.scale, control.config.train.epochs, control.config.drafter.init) == \
        ("large", 2, "continued")
    assert control.config.train == child.config.train
    # the parent is an eagle3 of the small scale as any other: planned alone (ad hoc), it is the same trial
    alone = plan(smoke(), {k: [v] for k, v in large.items()})
    parent = next(t for t in alone if t.depends_on is None)
    assert config_hash(parent.config) == config_hash(by["eagle3-small"].config)
    assert {t.name for t in plan_part(trials, parse_overrides(["train.scale=large"]))} == \
        {"eagle3-small", child.name, control.name}
    assert {t.name for t in plan_part(trials, parse_overrides(["train.scale=small"]))} == \
        {"eagle3-small", "hybrid-small", "eagle3-small-continued"}
    # a child and its control fingerprint their parent: another parent, other fingerprints
    assert fingerprint(child.config, {}, "a" * 64) != fingerprint(child.config, {}, "b" * 64)


def test_a_parent_on_other_settings_needs_a_child_and_train_settings():
    with pytest.raises(ConfigError, match=r"train.parent=\{'scale': 'small'\} on a eagle3 with drafter.init=ckpt: "
                                          r"only a drafter that starts from an eagle3 checkpoint"):
        plan(smoke(), parse_overrides(["variant=eagle3", "train.parent={scale: small}"]))
    with pytest.raises(ConfigError, match=r"train.parent: Value error, 'sclae' is not a train setting of the "
                                          r"parent eagle3 \(one of batch_size, "):
        with_values(smoke(), {"train.parent": {"sclae": "small"}})
    with pytest.raises(ConfigError, match=r"train.parent.epochs: Input should be greater than 0"):
        with_values(smoke(), {"train.parent": {"epochs": 0}})
    from pipeline.standalone import single_trial
    child = with_values(smoke(), {"drafter.variant": "hybrid", "drafter.init": "ckpt",
                                  "train.parent": {"scale": "small"}})
    with pytest.raises(ConfigError, match=r"train.parent=\{'scale': 'small'\}: a parent trained on other settings "
                                          r"is planned by a sweep"):
        single_trial(child)
    # a profile without `train.parent` hashes as before the key existed: its finished trials are reused
    from pipeline.fingerprint import config_hash
    tree = smoke().model_dump()
    del tree["train"]["parent"]
    assert config_hash(tree) == config_hash(smoke())


def test_the_study_profiles_parts_cover_each_plan():
    """Run part by part, every study of the study profile finishes: each trial lies in a part (with the parent and
    the control it needs), and each part names trials of the plan."""
    from pipeline.parts import check_parts

    cfg = load_config("study")
    for study, spec in cfg.studies.items():
        parts = check_parts(plan(cfg, study=study), cfg, study)
        assert set(parts) == set(spec.parts), study
    block = check_parts(plan(cfg, study="block"), cfg, "block")
    assert {t.name for t in block["ar-seed1"]} == {"eagle3-s1", "eagle3-s1-continued", "eagle3.1-s1", "kv_only-d4-s1",
                                                   "hybrid-s1-ckpt"}
    assert {t.variant for t in block["blocks-seeds12"]} == {"block"} and len(block["blocks-seeds12"]) == 4


def test_parts_named_by_study_or_all_run_once_in_the_profiles_order():
    """`kvshot repro --part` takes STUDY/PART, STUDY (each part of it; a study without parts, whole) or `all`:
    every part of every study once, the validation study's parts before those of the study choosing from it."""
    from pipeline.parts import WHOLE, expand_parts

    cfg = load_config("study")
    every = expand_parts(cfg, ["all"])
    assert every[0] == ("injection", WHOLE) and len(set(every)) == len(every) == 24
    assert sum(len(s.parts) or 1 for s in cfg.studies.values()) == 24
    studies = [s for s, _ in every]
    assert max(i for i, s in enumerate(studies) if s == "block_lr") < studies.index("block")
    depth = [("depth", p) for p in cfg.studies["depth"].parts]
    assert expand_parts(cfg, ["depth/seed1", "depth", "injection"]) == \
        [("depth", "seed1"), *[d for d in depth if d[1] != "seed1"], ("injection", WHOLE)]


def test_parts_that_leave_a_trial_out_or_match_nothing_are_one_line_errors():
    from pipeline.config import Config
    from pipeline.parts import check_parts, part_filter

    tree = load_config("study").model_dump()
    tree["studies"]["depth"]["parts"] = {"seed0": {"train.seed": [0]}}
    cfg = Config.model_validate(tree)
    with pytest.raises(ConfigError, match=r"studies.depth.parts: no part runs kv_only-d4-s1, kv_only-d4-s2, "):
        check_parts(plan(cfg, study="depth"), cfg, "depth")
    tree["studies"]["depth"]["parts"] = {"all": {"train.seed": [0, 1, 2]}, "none": {"seed": [7]}}
    cfg = Config.model_validate(tree)
    with pytest.raises(ConfigError, match=r"studies.depth.parts.none: no trial of the plan"):
        check_parts(plan(cfg, study="depth"), cfg, "depth")
    assert check_parts(plan(cfg, study="injection"), cfg, "injection") == {}   # no parts: one whole
    assert part_filter(cfg, "depth", "all") == {"train.seed": [0, 1, 2]}
    with pytest.raises(ConfigError, match=r"--part x: not a part of study depth \(its parts: all, none\)"):
        part_filter(cfg, "depth", "x")
    with pytest.raises(ConfigError, match=r"--part x: not a part of study injection \(it has no parts\)"):
        part_filter(cfg, "injection", "x")
    tree["studies"]["depth"]["parts"] = {"two words": {"seed": [0]}}
    with pytest.raises(ConfigError, match=r"studies.depth.parts: Value error, part name 'two words'"):
        from pipeline.config import _validate
        _validate(tree, "profile x")


def test_bad_plans_are_one_line_errors():
    with pytest.raises(ConfigError, match="nothing to sweep"):
        plan(smoke())
    with pytest.raises(ConfigError, match="unknown study 'nope'"):
        plan(smoke(), study="nope")
    with pytest.raises(ConfigError, match="unknown key 'dpth'"):
        plan(smoke(), parse_overrides(["dpth=1,2"]))


def test_dry_run_table_lists_resolved_trials(tmp_path):
    console = Console(record=True, width=200)
    trials = plan(load_config("default"), study="hybrid")
    show_plan(trials, console=console, paths=Paths(tmp_path))
    text = console.export_text()
    for name in ("eagle3", "hybrid-ckpt", "cross_only-random", "to run", "sweep hybrid: 6 trials", "eagle3-continued"):
        assert name in text
    assert "sweep hybrid: 6 of 6 trials to train (no finished trial of the plan to estimate their time from)" in text
    assert not (tmp_path / "runs").exists()   # a dry run runs nothing


# -- fingerprints ------------------------------------------------------------------------------------------------

def test_fingerprint_follows_config_and_data_content(tmp_path):
    paths = Paths(tmp_path)
    cfg = smoke()
    h0 = data_hashes(cfg, paths)
    assert set(h0.values()) == {"missing"}
    src = paths.regenerated("sharegpt")
    src.parent.mkdir(parents=True)
    src.write_text('{"id": 1}\n')
    h1 = data_hashes(cfg, paths)
    assert h1["regenerated/sharegpt"].startswith("sha256:")
    os.utime(src, (1, 1))                        # a touch (clone, checkout) does not change the content hash
    assert data_hashes(cfg, paths) == h1
    src.write_text('{"id": 2}\n')
    assert data_hashes(cfg, paths) != h1
    feats = paths.features("small")
    feats.mkdir(parents=True)
    (feats / "index.json").write_text("{}")
    assert data_hashes(cfg, paths)["features/small"].startswith("dir-sha256:")

    f = fingerprint(cfg, h1)
    assert f == fingerprint(smoke(), h1)
    assert f != fingerprint(with_values(cfg, {"drafter.depth": 2}), h1)
    assert f != fingerprint(cfg, h1, parent="abc")
    # sections that do not affect a trial do not change it
    assert f == fingerprint(with_values(cfg, {"ray.max_concurrent": 7, "e2e.num_prompts": 3}), h1)


def test_dvc_lock_md5_is_used_when_recorded(tmp_path):
    (tmp_path / "data" / "regenerated").mkdir(parents=True)
    f = tmp_path / "data" / "regenerated" / "sharegpt.jsonl"
    f.write_text("x\n")
    (tmp_path / "dvc.lock").write_text(textwrap.dedent("""\
        schema: '2.0'
        stages:
          regenerate:
            outs:
            - path: data/regenerated/sharegpt.jsonl
              md5: 0123abcd
        """))
    from pipeline.fingerprint import _dvc_lock_md5s
    assert path_hash(f, tmp_path, HashCache(None), _dvc_lock_md5s(tmp_path)) == "md5:0123abcd"


# -- one trial alone (kvshot train) -----------------------------------------------------------------------------

def test_train_one_passes_context_and_parent_checkpoint(tmp_path, monkeypatch):
    from pipeline.standalone import single_trial, train_one
    from stages import train

    seen = {}

    def fake_run(drafter, params, run_dir, paths, report, *, target, data=None, features=None, init_from=None):
        seen.update(variant=drafter.variant, run_dir=run_dir, target=target, init_from=init_from)

    monkeypatch.setattr(train, "run", fake_run)
    paths = Paths(tmp_path)
    parent = single_trial(load_config("smoke", ["variant=eagle3"]), "solo")
    train_one(parent, paths, lambda m, step=None: None)
    assert seen["variant"] == "eagle3" and seen["init_from"] is None and seen["target"].source == "embedded"
    assert (paths.run_dir("solo", parent.name) / "fingerprint").read_text().strip() == parent.fingerprint

    child = single_trial(load_config("smoke", ["variant=hybrid", "init=ckpt"]), "solo")
    assert child.depends_on == parent.name
    train_one(child, paths, lambda m, step=None: None)
    assert seen["init_from"] == paths.run_dir("solo", parent.name)
    with pytest.raises(ConfigError, match="needs the trained eagle3"):
        train_one(single_trial(load_config("smoke", ["variant=cross_only", "init=ckpt"]), "other"), paths,
                  lambda m, step=None: None)

    def no_init(drafter, params, run_dir, paths, report, *, target):
        pass

    monkeypatch.setattr(train, "run", no_init)
    with pytest.raises(TypeError, match="does not accept init_from"):
        train_one(child, paths, lambda m, step=None: None)


# -- real Ray sweeps ---------------------------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return Paths(tmp_path)


def quick_trial(trial, paths, report):
    """Reports a training curve, waits until a second trial runs at the same time (bounded), returns a row."""
    d = trial.config.drafter.depth
    calls = paths.root / "calls"
    calls.mkdir(exist_ok=True)
    (calls / f"{trial.name}.{time.time_ns()}").write_text(str(os.getpid()))
    running = paths.root / "running"
    running.mkdir(exist_ok=True)
    (running / trial.name).write_text("")
    t0 = time.time()
    while len(list(running.iterdir())) < 2 and time.time() - t0 < 20:
        time.sleep(0.05)
    for step in range(20):                       # many small results: the driver is the only MLflow writer
        report({"loss": 1.0 / (step + 1), "acc_0": 0.5 + step / 100}, step)
    if trial.config.drafter.variant in ("hybrid", "cross_only") and trial.depends_on:
        assert (paths.run_dir(trial.study, trial.depends_on) / "result.json").is_file(), "parent not done"
    if trial.values.get("train.lr") == 0.0123:
        raise RuntimeError("planned failure")
    alpha = [round(0.8 * (1 - 0.05 * d) ** k, 4) for k in range(7)]
    mat = 1 + sum(__import__("math").prod(alpha[: i + 1]) for i in range(7))
    if trial.config.drafter.variant == "hybrid":
        alpha[6] = float("nan")                  # no chain reached step 6: undefined, written as null
    if d == 2:                                   # like the evaluate stage: curves sent live are not logged twice
        for k, a in enumerate(alpha):
            report({"alpha": a, "acc": a}, k)
        report({"mat": mat, "retention": alpha[6] / alpha[0]}, None)
    return {"alpha": alpha, "acc": alpha, "mat": mat, "retention": alpha[6] / alpha[0],
            "t0": t0, "t1": time.time()}


def _calls(paths):
    d = paths.root / "calls"
    return sorted(p.name.rsplit(".", 1)[0] for p in d.iterdir()) if d.is_dir() else []


def _mlflow(paths):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=f"sqlite:///{paths.root / 'mlflow.db'}")


def _runs(paths, study="adhoc"):
    client = _mlflow(paths)
    exp = client.get_experiment_by_name(f"kvshot-{study}")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def test_sweep_tracks_reruns_nothing_and_grows(ray_local, project):
    cfg = smoke()
    trials = plan(cfg, parse_overrides(["depth=1,2,3"]))
    result = run_sweep(trials, project, trial_fn=quick_trial)
    assert result.exit_code == 0 and sorted(result.ran) == ["kv_only-d1", "kv_only-d2", "kv_only-d3"]

    # two trials really ran at the same time
    rows = {r["trial"]: r for r in result.rows}
    spans = sorted((r["t0"], r["t1"]) for r in rows.values())
    assert any(a1 > b0 for (a0, a1), (b0, b1) in zip(spans, spans[1:]))

    client, parents, children = _runs(project)
    assert len(parents) == 1 and len(children) == 3
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.params["drafter.depth"] in {"1", "2", "3"}
        assert child.data.tags["fingerprint"] == rows[child.info.run_name]["fingerprint"]
        assert "git_commit" in child.data.tags and "data_hash.regenerated/sharegpt" in child.data.tags
        alpha = client.get_metric_history(child.info.run_id, "alpha")
        assert sorted(m.step for m in alpha) == list(range(7))
        assert [m.value for m in sorted(alpha, key=lambda m: m.step)] == rows[child.info.run_name]["alpha"]
        assert len(client.get_metric_history(child.info.run_id, "loss")) == 20   # nothing lost to a lock
        assert len(client.get_metric_history(child.info.run_id, "mat")) == 1
        assert child.data.metrics["mat"] == pytest.approx(rows[child.info.run_name]["mat"])
        assert "alpha.png" in [a.path for a in client.list_artifacts(child.info.run_id)]

    stepwise = json.loads(project.stepwise_metrics("adhoc").read_text())
    assert [r["trial"] for r in stepwise] == ["kv_only-d1", "kv_only-d2", "kv_only-d3"]
    for r in stepwise:
        assert {"trial", "variant", "depth", "injection", "rope_fix", "init", "scale", "alpha", "acc", "mat",
                "retention"} <= set(r) and r["status"] == "ok"
        assert (project.run_dir("adhoc", r["trial"]) / "fingerprint").read_text().strip() == r["fingerprint"]
        assert r["role"] == "trial"
        assert r["machine"].startswith(f"{os.cpu_count()} CPU cores") and r["threads"] >= 1   # where its time ran
    # the plan it executed, written into the workspace with each trial's fingerprint
    executed = read_study_plan(project, "adhoc")
    assert [(e.name, e.fingerprint, e.role) for e in executed] == [(r["trial"], r["fingerprint"], "trial")
                                                                   for r in stepwise]
    assert all(c.data.tags["role"] == "trial" for c in children)
    assert "plan.json" in [a.path for a in client.list_artifacts(parents[0].info.run_id)]   # the plan, in MLflow too

    # the dry run now shows them done
    console = Console(record=True, width=200)
    show_plan(plan(cfg, parse_overrides(["depth=1,2,3,4"])), console=console, paths=project)
    text = console.export_text()
    assert text.count("done") == 3 and text.count("to run") == 1
    # and how long the rest would take at the pace of those measured
    assert re.search(r"sweep adhoc: 1 of 4 trials to train, about \d+:\d\d at 2 at a time \(at the pace of the 3 "
                     r"finished\)", text), text

    # a re-run runs nothing and reuses every row
    again = run_sweep(plan(cfg, parse_overrides(["depth=1,2,3"])), project, trial_fn=quick_trial)
    assert again.ran == [] and len(again.skipped) == 3 and again.exit_code == 0
    assert [r["mat"] for r in again.rows] == [rows[n]["mat"] for n in ("kv_only-d1", "kv_only-d2", "kv_only-d3")]
    assert len(_calls(project)) == 3

    # a grid grown by one value runs only the new trial
    grown = run_sweep(plan(cfg, parse_overrides(["depth=1,2,3,4"])), project, trial_fn=quick_trial)
    assert grown.ran == ["kv_only-d4"] and len(grown.skipped) == 3
    assert _calls(project).count("kv_only-d4") == 1 and len(_calls(project)) == 4
    _, parents, children = _runs(project)
    trained = [c for c in children if "reused_from" not in c.data.tags]
    assert len(parents) == 3 and len(trained) == 4 and len(children) == 3 + 3 + 4
    for parent, planned in zip(sorted(parents, key=lambda r: r.info.start_time), (3, 3, 4)):
        # every parent lists every trial of its sweep: those it trained and those it reused
        assert len([c for c in children if c.data.tags["mlflow.parentRunId"] == parent.info.run_id]) == planned
    assert len(json.loads(project.stepwise_metrics("adhoc").read_text())) == 4
    assert [e.name for e in read_study_plan(project, "adhoc")] == [f"kv_only-d{d}" for d in (1, 2, 3, 4)]

    # another study planning the same trials adopts the finished runs instead of training them again; its dry
    # run says so
    console = Console(record=True, width=200)
    show_plan(plan(cfg, parse_overrides(["depth=1,2"]), "other"), console=console, paths=project)
    text = console.export_text()
    assert "done in adhoc/kv_only-d1" in text and "done in adhoc/kv_only-d2" in text and "to run" not in text
    assert "sweep other: 0 of 2 trials to train" in text
    assert not project.run_dir("other", "kv_only-d1").exists()              # a dry run adopts nothing
    other = run_sweep(plan(cfg, parse_overrides(["depth=1,2"]), "other"), project, trial_fn=quick_trial)
    assert other.ran == [] and len(other.skipped) == 2 and len(_calls(project)) == 4
    assert {r["reused_from"] for r in other.rows} == {"adhoc/kv_only-d1", "adhoc/kv_only-d2"}
    # ... and its MLflow parent lists them as child runs that point to the runs that trained them
    client, (other_parent,), adopted = _runs(project, "other")
    by_name = {c.info.run_name: c for c in trained}
    assert sorted(c.info.run_name for c in adopted) == ["kv_only-d1", "kv_only-d2"]
    for child in adopted:
        source = by_name[child.info.run_name]
        assert child.data.tags["mlflow.parentRunId"] == other_parent.info.run_id
        assert child.data.tags["reused_from"] == f"adhoc/{child.info.run_name}"
        assert child.data.tags["reused_from_run_id"] == source.info.run_id
        assert child.data.tags["fingerprint"] == source.data.tags["fingerprint"]
        assert child.data.params["drafter.depth"] == source.data.params["drafter.depth"]
        assert child.data.metrics["mat"] == pytest.approx(rows[child.info.run_name]["mat"])
        assert sorted(m.step for m in client.get_metric_history(child.info.run_id, "alpha")) == list(range(7))
        assert child.info.status == "FINISHED"
    assert client.get_experiment_by_name("kvshot-other").tags["mlflow.experimentKind"] == "custom_model_development"
    assert (project.run_dir("other", "kv_only-d1") / "fingerprint").is_file()
    assert [r["trial"] for r in json.loads(project.stepwise_metrics("other").read_text())] == ["kv_only-d1",
                                                                                             "kv_only-d2"]

    # a changed config keeps the names but not the fingerprints: nothing would be reused
    changed = plan(with_values(cfg, {"train.lr": 0.002}), parse_overrides(["depth=1,2,3"]))
    fingerprint_trials(changed, project)
    assert [t.name for t in changed] == ["kv_only-d1", "kv_only-d2", "kv_only-d3"]
    assert all(cached_result(t, project) is None for t in changed)


def test_failing_trial_fails_alone_and_blocks_its_children(ray_local, project):
    cfg = smoke()
    trials = plan(cfg, parse_overrides(["variant=eagle3,hybrid", "train.lr=0.001,0.0123"]))
    by = {t.name: t for t in trials}
    assert by["hybrid-lr0.0123"].depends_on == "eagle3-lr0.0123"
    result = run_sweep(trials, project, trial_fn=quick_trial)
    assert result.exit_code == 1
    assert sorted(result.failed_names) == ["eagle3-lr0.0123", "eagle3-lr0.0123-continued", "hybrid-lr0.0123"]
    assert sorted(result.ran) == ["eagle3-lr0.001", "eagle3-lr0.001-continued", "eagle3-lr0.0123",
                                  "hybrid-lr0.001"]
    rows = {r["trial"]: r for r in json.loads(project.stepwise_metrics("adhoc").read_text())}
    assert rows["eagle3-lr0.001"]["status"] == "ok" and rows["hybrid-lr0.001"]["status"] == "ok"
    assert rows["eagle3-lr0.0123"]["status"] == "failed"
    assert "planned failure" in rows["eagle3-lr0.0123"]["error"]
    assert "depends on eagle3-lr0.0123" in rows["hybrid-lr0.0123"]["error"]
    assert "hybrid-lr0.0123" not in _calls(project)             # never started
    _, parents, children = _runs(project)
    status = {c.info.run_name: c.info.status for c in children}
    assert status["eagle3-lr0.0123"] == "FAILED" and status["eagle3-lr0.001"] == "FINISHED"
    assert status["hybrid-lr0.0123"] == "FAILED" and status["hybrid-lr0.001"] == "FINISHED"
    assert parents[0].info.status == "FAILED"
    assert not (project.run_dir("adhoc", "eagle3-lr0.0123") / "result.json").exists()

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a JSON file"))

    ok = strict((project.run_dir("adhoc", "hybrid-lr0.001") / "result.json").read_text())
    assert ok["alpha"][6] is None and ok["retention"] is None
    stepwise = {r["trial"]: r for r in strict(project.stepwise_metrics("adhoc").read_text())}
    assert stepwise["hybrid-lr0.001"]["alpha"][6] is None


def timed_trial(trial, paths, report):
    """kv_only runs until eagle3's children have finished, or 10 s (in waves they wait for it: a schedule that
    started them beside it would have them finished well within that); every other trial returns at once. When
    each ran shows the sweep's schedule."""
    t0 = time.time()
    done = paths.root / "done"
    if trial.variant == "kv_only":
        children = [done / "hybrid", done / "eagle3-continued"]
        while time.time() < t0 + 10 and not all(c.exists() for c in children):
            time.sleep(0.2)
    a = [0.5] * 7
    row = {"alpha": a, "acc": a, "mat": 2.0, "retention": 1.0, "t0": t0, "t1": time.time()}
    done.mkdir(exist_ok=True)
    (done / trial.name).write_text("")
    return row


def test_trials_run_in_dependency_waves_in_priority_order(ray_local, project):
    trials = plan(smoke(), parse_overrides(["variant=eagle3,hybrid,kv_only"]))
    by = {t.name: t for t in trials}
    assert by["hybrid"].depends_on == "eagle3" and by["eagle3-continued"].depends_on == "eagle3"
    prio = schedule_order(trials)
    # the parent's priority carries its children's work: it starts before the longer kv_only
    assert prio["eagle3"] > prio["kv_only"] >= prio["hybrid"] > prio["eagle3-continued"]
    console = Console(record=True, width=200)
    result = run_sweep(trials, project, trial_fn=timed_trial, console=console)
    assert result.exit_code == 0
    # two slots: a wave's two trials start together, in whichever order Tune's actors come up
    assert set(result.ran[:2]) == {"eagle3", "kv_only"} and set(result.ran[2:]) == {"hybrid", "eagle3-continued"}
    # after each trial, where the sweep stands and (from the trials measured so far) how long it has left
    lines = [ln.strip() for ln in console.export_text().splitlines() if "trials done" in ln]
    assert re.fullmatch(r"sweep adhoc: 1/4 trials done(, 1 running)?(, about \d+:\d\d left)?", lines[0]), lines
    assert lines[-1] == "sweep adhoc: 4/4 trials done", lines
    rows = {r["trial"]: r for r in result.rows}
    for child in ("hybrid", "eagle3-continued"):
        # one Tune experiment per wave: the children start once the parents' wave (eagle3 and kv_only) has ended
        assert max(rows["eagle3"]["t1"], rows["kv_only"]["t1"]) <= rows[child]["t0"], child


def test_trial_slots_are_what_the_cluster_holds(ray_local):
    ray_params = smoke().ray
    assert trial_slots(ray_params.model_copy(update={"max_concurrent": 8})) == 2      # ray_local has 2 CPUs
    assert trial_slots(ray_params.model_copy(update={"max_concurrent": 1})) == 1
    assert trial_slots(ray_params.model_copy(update={"max_concurrent": 8, "cpus_per_trial": 2.0})) == 1


def test_progress_line_estimates_the_time_left_from_the_pace_measured():
    trials = plan(smoke(), parse_overrides(["variant=eagle3,hybrid,kv_only"]))
    forward = Forward(None, None, {t.name: t for t in trials}, "commit", Console(record=True))
    progress = forward.progress
    progress.track(trials, slots=2)
    now = time.time()
    progress.started_at = {"eagle3": now - 100, "kv_only": now - 100}
    forward.finish("eagle3", {"status": "ok", "mat": 2.0})
    assert progress.took["eagle3"] == pytest.approx(100.0, abs=1.0)
    progress.took["eagle3"] = 100.0
    # eagle3 took 100 s for 3.0 units: kv_only (3.31) has ~10 s left, hybrid (3.31) and the continued eagle3 (3.0)
    # 110 + 100 s between 2 slots; never under hybrid's 110 s alone
    assert progress.line() == "sweep adhoc: 1/4 trials done, 1 running, about 1:50 left"
    forward.finish("kv_only", {"status": "failed", "error": "boom"})
    assert "kv_only" not in progress.took             # a failed trial's time does not set the pace
    assert progress.line() == "sweep adhoc: 2/4 trials done, about 1:50 left"


def test_schedule_order_puts_the_longest_work_first():
    study = load_config("study")
    depth = plan(study, study="depth")
    prio = schedule_order(depth)
    first = sorted(depth, key=lambda t: -prio[t.name])
    assert [t.config.drafter.depth for t in first[:3]] == [4, 4, 4]
    assert estimated_cost(by_name(depth, "kv_only-d4")) > estimated_cost(by_name(depth, "kv_only-d2")) \
        > estimated_cost(by_name(depth, "kv_only-d1"))
    hybrid = plan(study, study="hybrid")
    prio = schedule_order(hybrid)
    parents = [t for t in hybrid if any(c.depends_on == t.name for c in hybrid)]
    others = [t for t in hybrid if t not in parents]
    assert parents and min(prio[t.name] for t in parents) > max(prio[t.name] for t in others)
    # the larger scale trains on twice the conversations: twice the estimated work
    scale = {t.config.train.scale: estimated_cost(t) for t in plan(study, parse_overrides(["train.scale=small,large"]))}
    assert scale["large"] == pytest.approx(2 * scale["small"], rel=0.01)


def test_time_left_scales_the_measured_pace_by_the_work_ahead():
    costs = {"a": 1.0, "b": 2.0, "c": 1.0}
    assert time_left(costs, {}, {"a": 5.0}, slots=2) is None            # nothing measured yet
    # a took 60 s for 1 unit; b (2 units) has run 30 s of its 120, c (1 unit) has not started: 90 + 60 s of
    # work on 2 slots is 75 s, but b alone needs 90 more
    assert time_left(costs, {"a": 60.0}, {"b": 30.0}, slots=2) == pytest.approx(90.0)
    assert time_left(costs, {"a": 60.0}, {"b": 30.0}, slots=1) == pytest.approx(150.0)
    assert time_left(costs, {"a": 60.0, "b": 100.0, "c": 70.0}, {}, slots=2) == 0.0


def by_name(trials, name):
    return next(t for t in trials if t.name == name)


KILL_SCRIPT = """
import os, sys, time
from pathlib import Path
from pipeline.config import load_config, parse_overrides
from pipeline.plan import plan
from pipeline.sweep import run_sweep
from stages.common import Paths

def slow_trial(trial, paths, report):
    (paths.root / "calls").mkdir(exist_ok=True)
    (paths.root / "calls" / f"{trial.name}.{time.time_ns()}").write_text("")
    if trial.config.drafter.depth < 3:      # the deepest starts first (schedule_order) and finishes at once
        time.sleep(120)
    a = [0.5] * 7
    return {"alpha": a, "acc": a, "mat": 2.0, "retention": 1.0}

cfg = load_config("smoke", ["ray.max_concurrent=2"])
run_sweep(plan(cfg, parse_overrides(["depth=1,2,3"])), Paths(Path(sys.argv[1])), trial_fn=slow_trial)
"""


def test_a_trial_has_begun_when_its_run_directory_holds_its_fingerprint(tmp_path):
    """What `kvshot repro --part` counts as begun before its run (its time is then not the whole part's): a run
    directory of the trial's current fingerprint, finished or not; a stale one is removed when the trial runs."""
    from pipeline.trial import FINGERPRINT_FILE, begun

    t = plan(smoke(), parse_overrides(["depth=1"]))[0]
    t.fingerprint = "abc"
    paths = Paths(tmp_path)
    assert not begun(t, paths)
    t.run_dir(paths).mkdir(parents=True)
    (t.run_dir(paths) / FINGERPRINT_FILE).write_text("old\n")
    assert not begun(t, paths)
    (t.run_dir(paths) / FINGERPRINT_FILE).write_text("abc\n")
    assert begun(t, paths)


def test_killed_sweep_resumes_without_redoing_finished_trials(ray_local, project, tmp_path):
    script = tmp_path / "sweep_to_kill.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "RAY_ADDRESS": ray_local, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, str(script), str(project.root)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    done = project.run_dir("adhoc", "kv_only-d3") / "result.json"
    try:
        deadline = time.time() + 150
        while not done.is_file() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert done.is_file(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "timeout"
        os.kill(proc.pid, signal.SIGKILL)                   # the driver dies mid-sweep
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.stderr.close()
    assert _calls(project).count("kv_only-d3") == 1

    result = run_sweep(plan(smoke(), parse_overrides(["depth=1,2,3"])), project, trial_fn=quick_trial)
    assert result.exit_code == 0
    assert result.skipped == ["kv_only-d3"] and sorted(result.ran) == ["kv_only-d1", "kv_only-d2"]
    assert _calls(project).count("kv_only-d3") == 1


def test_a_stopped_sweep_writes_no_row_for_the_trials_it_cut_off(project, monkeypatch):
    """A stop (SIGTERM, Ctrl-C) mid-sweep keeps the rows of the trials that finished and writes none for the
    others: they are not results (a report lists them as not run yet) and the next run resumes them."""
    import contextlib

    from pipeline import sweep

    def stopped_after_one(todo, done, paths, cfg, trial_fn, forward, label, started):
        first = todo[0]
        forward.start(first.name)
        forward.finish(first.name, {"trial": first.name, "study": first.study, "status": "ok", "mat": 2.0})
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "ray_session", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(sweep, "run_trials", stopped_after_one)
    monkeypatch.setattr(sweep, "trial_slots", lambda *a: 1)
    trials = plan(smoke(), parse_overrides(["depth=1,2,3"]))
    with pytest.raises(KeyboardInterrupt):
        run_sweep(trials, project, trial_fn=quick_trial, track=False)
    rows = json.loads(project.stepwise_metrics(trials[0].study).read_text())
    assert [r["trial"] for r in rows] == [trials[0].name] and rows[0]["status"] == "ok"


def test_a_trial_alone_on_the_node_computes_on_every_cpu(monkeypatch):
    """The idle CPUs are lent only while no other trial holds any, only on a single CPU-only node, and taken back
    at the next check once another trial starts."""
    import ray
    import torch

    from pipeline.cpu_share import CpuShare, threads_for

    assert threads_for(1, total=2, available=1, nodes=1) == 2          # alone: both cores
    assert threads_for(1, total=2, available=0, nodes=1) == 1          # another trial holds the other core
    assert threads_for(1, total=4, available=1, nodes=1) == 1          # two others
    assert threads_for(2, total=8, available=6, nodes=1) == 8
    assert threads_for(1, total=32, available=31, nodes=2) == 1        # a cluster: the free CPUs may be elsewhere
    assert threads_for(1, total=2, available=1, nodes=1, gpus=1) == 1  # a GPU trial keeps its share

    before = torch.get_num_threads()
    free = {"CPU": 1.0}
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "available_resources", lambda: dict(free))
    try:
        share = CpuShare(1, every_s=0.0)
        assert torch.get_num_threads() == 1
        assert share.update() == 2 and torch.get_num_threads() == 2
        assert share.update() is None                                   # unchanged: nothing to do
        free["CPU"] = 0.0                                               # a child trial started
        assert share.update() == 1 and torch.get_num_threads() == 1
        slow = CpuShare(1, every_s=3600.0)
        free["CPU"] = 1.0
        assert slow.update() is None and torch.get_num_threads() == 1   # checks are spaced
    finally:
        torch.set_num_threads(before)


def test_a_trial_records_the_threads_it_computed_on_averaged_over_its_time(monkeypatch):
    """A pace measured on every CPU is not one measured beside another trial (`pipeline.budget`): the row records
    the mean of the trial's torch threads over its time, loans included."""
    import ray
    import torch

    import pipeline.cpu_share as cpu_share

    clock = [100.0]
    free = {"CPU": 1.0}
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "available_resources", lambda: dict(free))
    before = torch.get_num_threads()
    try:
        share = cpu_share.CpuShare(1, every_s=0.0)
        clock[0] = 130.0
        assert share.update() == 2                          # 30 s on 1 thread, then alone
        clock[0] = 160.0
        free["CPU"] = 0.0
        assert share.update() == 1                          # 30 s on 2 threads, then beside a child again
        clock[0] = 220.0                                    # 60 s on 1 thread
        assert share.mean_threads() == pytest.approx((30 * 1 + 30 * 2 + 60 * 1) / 120)
    finally:
        torch.set_num_threads(before)


def test_replay_of_measured_trial_times_waits_for_parents_and_fills_the_slots():
    from pipeline.cost import replay

    trials = plan(load_config("default"), study="scale")   # eagle3-small, -large, hybrids and continued after them
    took = {t.name: 600.0 if t.depends_on is None else 900.0 for t in trials}
    by = {t.name: t for t in trials}
    assert sum(1 for t in trials if t.depends_on) == 4 and sum(1 for t in trials if not t.depends_on) == 2
    # 2 slots: both parents (600 s), then the four children two at a time (900 s each)
    assert replay(trials, took, 2) == 600.0 + 900.0 + 900.0
    assert replay(trials, took, 6) == 600.0 + 900.0
    assert replay([by["eagle3-small"]], took, 2) == 600.0
    # a long parent holds the next wave back; a child started right after its own parent would not wait for it
    took["eagle3-large"] = 2000.0
    assert replay(trials, took, 2) == 2000.0 + 900.0 + 900.0
    assert replay(trials, took, 2, waves=False) < 2000.0 + 900.0 + 900.0


def test_kvshot_train_names_a_control_or_an_eagle3_1_apart_from_its_plain_variant():
    """One run directory per drafter: `kvshot train` of a control is not written over the KV-only drafter of its
    shape (nor EAGLE-3.1 over EAGLE-3, nor one block context over another)."""
    from pipeline.standalone import single_trial

    def name(*over: str) -> str:
        return single_trial(load_config("smoke", list(over))).name

    plain = name("variant=kv_only", "depth=2")
    control = name("variant=kv_only", "depth=2", "no_target=true")
    with_context = name("variant=kv_only", "depth=2", "no_target=true", "token_context=true")
    assert len({plain, control, with_context}) == 3 and with_context.endswith("no_target-token_context")
    assert name("variant=eagle3") == "eagle3-d1"
    assert name("variant=eagle3", "fc_norm=true", "norm_output=true") == "eagle3.1-d1"
    assert name("variant=block", "context=kv") != name("variant=block", "context=hidden")
