"""Values a study takes from a validation study (`studies.S.choose`, pipeline/choices.py): each block arm trains at
the learning rate its validation study found best, chosen by the planner from finished rows, never by hand; while
rows are missing the choice is pending and the sweep refuses to run, naming the parts to run first."""
import json
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, StudyParams, load_config
from pipeline.plan import plan
from pipeline.plan_file import planned
from pipeline.sweep import check_chosen, finished_rows_in, run_sweep
from stages.common import StageError

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "report"))
import make_fixtures as fx  # noqa: E402

LRS = [0.0003, 0.001, 0.003]
# validation acc_0 per (arm, lr): the hidden arm is best at 0.003, the KV arm at 0.001
ACC0 = {("hidden", 0.0003): 0.30, ("hidden", 0.001): 0.36, ("hidden", 0.003): 0.45,
        ("kv", 0.0003): 0.40, ("kv", 0.001): 0.50, ("kv", 0.003): 0.42}


def _cfg(**chooser):
    cfg = load_config("smoke")
    val = StudyParams(grid={"drafter.variant": ["block"], "drafter.context": ["hidden", "kv"], "train.lr": LRS},
                      validation=3, parts={"h": {"drafter.context": ["hidden"]}, "k": {"drafter.context": ["kv"]}})
    blk = StudyParams(grid={"drafter.variant": ["block"], "drafter.context": ["hidden", "kv"]}, seeds=[0, 1],
                      include=[{"drafter.variant": "eagle3"}], choose={"train.lr": "val"}, **chooser)
    return cfg.model_copy(update={"studies": {"val": val, "blk": blk}})


def _row(t) -> dict:
    ctx, lr = t.config.drafter.context, t.config.train.lr
    r = fx.row("val", t.name, dict(variant="block", depth=t.config.drafter.depth, context=ctx, block_size=8),
               ACC0[(ctx, lr)], ACC0[(ctx, lr)] * 0.5, 0, 1)
    return {**r, "values": t.values, "lr": lr, "eval_data": t.config.eval.data}


def _trained(trial, paths, report) -> dict:
    """A validation trial as a worker reports it: its step accuracies, from ACC0 (no per-conversation counts)."""
    a0 = ACC0[(trial.config.drafter.context, trial.config.train.lr)]
    acc = [a0 * 0.8 ** k for k in range(7)]
    return {"acc": acc, "alpha": acc, "mat": 2.0, "retention": 0.5}


def _rows_of(skip=()):
    return lambda trials: {t.name: _row(t) for t in trials if t.name not in skip}


def test_each_arm_trains_at_its_validation_best_and_keeps_its_name_and_baseline():
    cfg = _cfg()
    before = plan(cfg, study="blk")
    after = plan(cfg, study="blk", rows_of=_rows_of())
    assert [t.name for t in after] == [t.name for t in before]
    lr = {t.name: t.config.train.lr for t in after}
    assert lr == {"block-hidden-s0": 0.003, "block-kv-s0": 0.001, "block-hidden-s1": 0.003, "block-kv-s1": 0.001,
                  "eagle3-s0": cfg.train.lr, "eagle3-s1": cfg.train.lr}
    kv = next(t for t in after if t.name == "block-kv-s1")
    assert kv.baseline == "block-hidden-s1"          # its own seed's hidden arm, each at its own learning rate
    (c,) = kv.choices
    assert (c.key, c.by, c.value) == ("train.lr", "val", 0.001) and set(c.scores) == {str(v) for v in LRS}
    assert not next(t for t in after if t.name == "eagle3-s1").choices     # the validation study trains no eagle3
    # the plan says how each value was chosen; the fingerprinted config holds the value
    from pipeline.forward import Forward
    _, tags = Forward(None, None, {kv.name: kv}, "abc", None)._params_tags(kv)     # its MLflow run says so too
    assert tags["chosen.train.lr"] == c.text()
    entry = planned(kv, cfg, {})
    assert entry.config["train"]["lr"] == 0.001 and entry.chosen["train.lr"].startswith("train.lr 0.001 chosen by val")


def test_the_choice_is_the_reports_best():
    from stages.report_validation import arms, ranked
    from stages.results import settings_of

    cfg = _cfg()
    val = plan(cfg, study="val")
    best = {s.fields["context"]: s.extra["train.lr"]
            for group in arms(settings_of("val", [_row(t) for t in val])).values() for s in ranked(group)[:1]}
    chosen = {t.config.drafter.context: t.config.train.lr for t in plan(cfg, study="blk", rows_of=_rows_of())
              if t.choices}
    assert chosen == best == {"hidden": 0.003, "kv": 0.001}


def test_a_best_value_at_an_end_of_its_grid_is_said_to_be_one():
    """The hidden arm is best at the grid's largest learning rate: a larger one was not tried, and the report says
    so; the KV arm's best lies inside its grid."""
    from stages.report_validation import arms, at_grid_edge, ranked, validation_section
    from stages.results import settings_of

    settings = settings_of("val", [_row(t) for t in plan(_cfg(), study="val")])
    edges = {s.fields["context"]: at_grid_edge(ranked(group)[0], group) for group in arms(settings).values()
             for s in ranked(group)[:1]}
    beyond = ("its grid's largest lr: a value beyond it was not tried (a parabola in log lr through the three "
              "largest values rises towards the edge: a value beyond it may be better)")
    assert edges == {"hidden": beyond, "kv": ""}
    text = "\n".join(validation_section("val", settings, [], {}, 0.95))
    (hidden,) = [line for line in text.splitlines() if line.startswith("- **") and "hidden" in line]
    assert f"), {beyond};" in hidden
    assert "beyond it" not in "".join(line for line in text.splitlines() if "kv" in line and line.startswith("- **"))


def test_the_trend_at_a_grid_edge_says_whether_it_peaks_inside_or_points_beyond():
    """The study's block_lr rows (step MAT at lr 0.0003 / 0.001 / 0.003): the hidden arm, best at the smallest lr,
    peaks between 0.0003 and 0.001; the both-context arm keeps rising towards the smallest."""
    from stages.report_validation import edge_trend

    hidden = [(0.0003, 1.313), (0.001, 1.303), (0.003, 1.157)]
    assert edge_trend(hidden, 0.0003, "lr") == ("a parabola in log lr through the three smallest values peaks at "
                                                "0.00051, inside the grid: the trend does not point beyond it")
    both = [(0.0003, 1.310), (0.001, 1.249), (0.003, 1.211)]
    assert "rises towards the edge: a value beyond it may be better" in edge_trend(both, 0.0003, "lr")
    # a concave curve whose peak lies beyond the edge points beyond it too
    assert "rises towards the edge" in edge_trend([(0.001, 1.0), (0.01, 1.5), (0.1, 1.8)], 0.1, "lr")
    assert "largest" in edge_trend([(0.001, 1.0), (0.01, 1.5), (0.1, 1.8)], 0.1, "lr")
    assert edge_trend(hidden[:2], 0.0003) == "" and edge_trend([(0.0, 1.0), *hidden[1:]], 0.0) == ""


def test_a_missing_validation_row_leaves_its_arm_pending_and_the_sweep_names_the_part_to_run():
    cfg = _cfg()
    trials = plan(cfg, study="blk", rows_of=_rows_of(skip={"block-kv-lr0.003"}))
    kv = [t for t in trials if t.config.drafter.context == "kv"]
    assert all(t.config.train.lr == cfg.train.lr and t.choices[0].value is None for t in kv)
    hidden = [t for t in trials if t.variant == "block" and t.config.drafter.context == "hidden"]
    assert len(hidden) == 2 and all(t.config.train.lr == 0.003 for t in hidden)
    with pytest.raises(ConfigError, match=r"chosen by val, which has not finished 1 of .*run its parts val/k here"):
        check_chosen(trials, cfg)
    check_chosen(hidden, cfg)                        # a part of the chosen arms alone runs
    assert "pending: val has not finished block-kv-lr0.003" in planned(kv[0], cfg, {}).chosen["train.lr"]


def test_a_tie_is_broken_by_plan_order_and_said():
    def tied(trials):
        rows = _rows_of()(trials)
        for t in trials:
            if t.config.drafter.context == "kv":
                rows[t.name] = {**rows[t.name], **{k: rows["block-kv-lr0.001"][k] for k in ("acc", "per_conversation",
                                                                                        "counts", "step_mat")}}
        return rows
    kv = next(t for t in plan(_cfg(), study="blk", rows_of=tied) if t.name == "block-kv-s0")
    assert kv.config.train.lr == LRS[0] and kv.choices[0].text().endswith("a tie, broken by plan order)")
    hidden = next(t for t in plan(_cfg(), study="blk", rows_of=tied) if t.name == "block-hidden-s0")
    assert "tie" not in hidden.choices[0].text()


def test_a_value_given_on_top_wins_over_the_choice():
    trials = plan(_cfg(), {"train.lr": [0.01]}, study="blk", rows_of=_rows_of())
    assert all(t.config.train.lr == 0.01 and not t.choices for t in trials)


@pytest.mark.parametrize("change, message", [
    (lambda s: {**s, "blk": s["blk"].model_copy(update={"choose": {"train.lr": "nope"}})}, "'nope' is not a study"),
    (lambda s: {**s, "val": s["val"].model_copy(update={"validation": None})}, "study val has no `validation`"),
    (lambda s: {"blk": s["blk"], "val": s["val"]}, "study val comes after blk"),
    (lambda s: {**s, "blk": s["blk"].model_copy(update={"choose": {"train.epochs": "val"}})},
     "study val does not sweep train.epochs"),
    (lambda s: {**s, "blk": s["blk"].model_copy(update={"include": [{"train.lr": 0.01}]})},
     "study blk sets train.lr itself"),
])
def test_a_choice_the_profile_cannot_make_is_a_one_line_error(change, message):
    cfg = _cfg()
    cfg = cfg.model_copy(update={"studies": change(dict(cfg.studies))})
    with pytest.raises(ConfigError, match=message) as err:
        plan(cfg, study="blk")
    assert "studies.blk.choose" in str(err.value) and "\n" not in str(err.value)


def test_the_sweep_reads_the_choice_from_the_validation_runs_of_this_workspace(ray_local, tmp_path, monkeypatch):
    """Real run directories, fingerprints and Ray: a choice needs the validation trials finished on this data."""
    from stages.common import Paths

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = _cfg()
    paths = Paths(tmp_path)
    src = next(iter(cfg.data.sources))
    paths.regenerated(src).parent.mkdir(parents=True)
    paths.regenerated(src).write_text("".join(
        json.dumps({"id": f"c{i}", "source": src, "split": "train", "scale_rank": i,
                    "messages": [{"role": "user", "content": f"prompt {i}"},
                                 {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
        for i in range(max(cfg.data.scales.values()) + 5)))
    rows_of = finished_rows_in(paths)
    assert all(t.choices[0].value is None for t in plan(cfg, study="blk", rows_of=rows_of) if t.choices)
    result = run_sweep(plan(cfg, study="val"), paths, trial_fn=_trained, track=False)
    assert not result.failed
    trials = plan(cfg, study="blk", rows_of=rows_of)
    check_chosen(trials, cfg)
    assert {t.name: t.config.train.lr for t in trials if t.choices} == \
        {"block-hidden-s0": 0.003, "block-kv-s0": 0.001, "block-hidden-s1": 0.003, "block-kv-s1": 0.001}
    # a validation set with other conversations: the finished trials are not its trials any more
    written = tmp_path / plan(cfg, study="val")[0].config.eval.data
    written.write_text(written.read_text() + "\n")
    assert all(t.choices[0].value is None for t in plan(cfg, study="blk", rows_of=rows_of) if t.choices)


def _regenerated(paths, cfg, changed: bool = False) -> None:
    src = next(iter(cfg.data.sources))
    paths.regenerated(src).parent.mkdir(parents=True, exist_ok=True)
    paths.regenerated(src).write_text("".join(
        json.dumps({"id": f"c{i}", "source": src, "split": "train", "scale_rank": i,
                    "messages": [{"role": "user", "content": f"prompt {i}"},
                                 {"role": "assistant", "content": f"answer {i}{' again' if changed else ''}"}]}) + "\n"
        for i in range(max(cfg.data.scales.values()) + 5)))


def test_a_workspace_takes_the_choice_from_committed_validation_rows_of_the_same_code_and_conversations(
        ray_local, tmp_path, monkeypatch):
    """A study run in parts over sessions: the validation study ran in another workspace and its rows were
    committed (results/<profile>/metrics/stepwise/); a workspace on the same conversations chooses from them,
    one on other conversations, or with other code, does not."""
    from pipeline.conversations import results_folder
    from pipeline.fingerprint import fingerprint
    from stages.common import Paths

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("KVSHOT_RESULTS", str(tmp_path / "results"))
    cfg = _cfg()
    ran = Paths(tmp_path / "ran")
    _regenerated(ran, cfg)
    assert not run_sweep(plan(cfg, study="val"), ran, trial_fn=_trained, track=False).failed
    stepwise = results_folder(cfg) / "metrics" / "stepwise"
    stepwise.mkdir(parents=True)
    rows = json.loads(ran.stepwise_metrics("val").read_text())
    for r, t in zip(rows, plan(cfg, study="val")):   # trained beside another CPU's feature cache (bf16 rounding)
        r["data"] = {k: ("sha256:another-cpu" if k.startswith("features/") else v) for k, v in r["data"].items()}
        r["fingerprint"] = fingerprint(t.config, r["data"], None, r["code"])
    (stepwise / "val.json").write_text(json.dumps(rows))

    here = Paths(tmp_path / "here")
    _regenerated(here, cfg)
    trials = plan(cfg, study="blk", rows_of=finished_rows_in(here, results_folder(cfg)))
    check_chosen(trials, cfg)
    assert {t.name: t.config.train.lr for t in trials if t.choices} == \
        {"block-hidden-s0": 0.003, "block-kv-s0": 0.001, "block-hidden-s1": 0.003, "block-kv-s1": 0.001}
    assert not (tmp_path / "here" / "data" / "validation").exists()        # read, not written
    assert all(t.choices[0].value is None for t in plan(cfg, study="blk", rows_of=finished_rows_in(here)) if t.choices)

    other = Paths(tmp_path / "other")
    _regenerated(other, cfg, changed=True)
    assert all(t.choices[0].value is None
               for t in plan(cfg, study="blk", rows_of=finished_rows_in(other, results_folder(cfg))) if t.choices)
    for r in rows:
        r["code"] = "other code"
    (stepwise / "val.json").write_text(json.dumps(rows))
    assert all(t.choices[0].value is None
               for t in plan(cfg, study="blk", rows_of=finished_rows_in(here, results_folder(cfg))) if t.choices)

    (stepwise / "val.json").write_text(json.dumps(rows)[:-7])       # a committed file cut short
    with pytest.raises(StageError, match=r"val\.json: not valid JSON") as err:
        plan(cfg, study="blk", rows_of=finished_rows_in(here, results_folder(cfg)))
    assert "\n" not in str(err.value)


def test_a_study_that_ran_on_an_older_choice_is_run_again_by_repro(tmp_path, monkeypatch):
    """DVC sees no dependency between a validation study and the study choosing from it: `kvshot repro` compares
    the plan the choosing study ran (runs/<study>/plan.json) with what the validation rows choose now and forces
    that study's stage, then lets DVC run what follows it."""
    import subprocess

    from pipeline import dvc_workspace
    from pipeline.plan_file import write_study_plan
    from pipeline.sweep import stale_choices
    from stages.common import Paths

    cfg, paths = _cfg(), Paths(tmp_path)
    assert stale_choices(cfg, paths, _rows_of()) == {}                      # nothing ran yet
    write_study_plan(plan(cfg, study="blk", rows_of=_rows_of()), paths)
    assert stale_choices(cfg, paths, _rows_of()) == {}                      # ran on today's choice
    write_study_plan(plan(cfg, study="blk"), paths)                          # ran while pending: lr 0.001 each
    stale = stale_choices(cfg, paths, _rows_of())
    assert sorted(stale["blk"]) == ["block-hidden-s0: train.lr 0.001 -> 0.003",
                                    "block-hidden-s1: train.lr 0.001 -> 0.003"]    # the KV arm's best is 0.001
    calls = []
    monkeypatch.setattr(dvc_workspace, "ROOT", tmp_path)
    monkeypatch.setattr(dvc_workspace.shutil, "which", lambda *a, **k: "dvc")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setattr(dvc_workspace, "run_child", lambda cmd, **kw: calls.append(cmd) or 0)
    import pipeline.sweep
    monkeypatch.setattr(pipeline.sweep, "finished_rows_in", lambda *a: _rows_of())
    lines = []
    assert dvc_workspace.repro(cfg, "default", echo=lines.append) == 0
    assert calls == [["dvc", "repro"], ["dvc", "repro", "--force", "--single-item", "study@blk"], ["dvc", "repro"]]
    assert len(lines) == 1 and lines[0].startswith("study blk ran on other chosen values")


def test_a_waiting_part_of_a_fresh_workspace_runs_its_data_stages_before_it_checks_committed_rows(tmp_path,
                                                                                                   monkeypatch):
    """Which validation rows stand for a workspace's trials is known only once it has its conversations: a part
    waiting for its choice runs the data stages first when committed rows of its validation study exist, then
    plans again; without such rows it stops at once with the one-line error."""
    from pipeline import repro_parts
    from pipeline.conversations import results_folder

    monkeypatch.setenv("KVSHOT_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("KVSHOT_WORKSPACES", str(tmp_path / "ws"))
    cfg = _cfg()
    calls = []
    monkeypatch.setattr(repro_parts, "check_hardware", lambda cfg: calls.append("hardware"))
    monkeypatch.setattr(repro_parts, "repro_data_stages", lambda *a, **k: calls.append("data") or 0)
    monkeypatch.setattr(repro_parts, "repro_part", lambda *a, **k: calls.append("part") or 0)
    state = repro_parts.part_state(cfg, "mine", "blk", "(whole)")
    assert state.waits and "committed" not in state.waits
    with pytest.raises(ConfigError, match="run its parts val/h, val/k here first$"):
        repro_parts.run_part(cfg, "mine", state)
    assert calls == []

    stepwise = results_folder(cfg) / "metrics" / "stepwise"
    stepwise.mkdir(parents=True)
    (stepwise / "val.json").write_text("[]")
    state = repro_parts.part_state(cfg, "mine", "blk", "(whole)")
    assert "checked against this workspace's conversations once its data stages have run" in state.waits
    with pytest.raises(ConfigError):           # no committed row stands for these trials: it still waits
        repro_parts.run_part(cfg, "mine", state, echo=lambda line: None)
    assert calls == ["hardware", "data"]                  # the hardware checked once, before the data stages
    (tmp_path / "ws" / "mine" / "data" / "features").mkdir(parents=True)    # the data stages have run
    assert "committed" not in repro_parts.part_state(cfg, "mine", "blk", "(whole)").waits
