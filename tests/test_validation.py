"""Validation sets (stages/validation.py): a study with `validation: N` chooses a setting (e.g. each block arm's
learning rate) on training conversations beyond its data scale, never on the eval split; the planner points its
trials there, the sweep writes the file before fingerprinting, the report shows the choice apart from the findings
and flags an eval-split study that trains an arm at another learning rate."""
import copy
import json
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config, with_values
from pipeline.plan import plan
from pipeline.standalone import fingerprint_trials
from pipeline.sweep import write_validation_sets
from pipeline.trial import base_row, evaluate_runs
from stages import validation
from stages.common import Paths, StageError, read_jsonl
from stages.findings import findings
from stages.prepare import prompt_key
from stages.report import ReportParams, run
from stages.results import collect

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "report"))
import make_fixtures as fx  # noqa: E402

SCALES = {"small": 6, "large": 14}


def conv(i: int, prompt: str, rank: int, split: str = "train") -> dict:
    return {"id": f"c{i}", "source": "sharegpt", "split": split, "scale_rank": rank,
            "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": f"answer {i}"}]}


def pool() -> list[dict]:
    """Six training rows in the small scale, eight beyond it (two sharing a trained prompt, one context-free),
    and an eval row."""
    rows = [conv(i, f"question {i}", i) for i in range(6)]
    beyond = ["new A", "Question 2.", "new B", "Continue", "new C", "  QUESTION   4 ", "new D", "new E"]
    rows += [conv(10 + j, p, 6 + j) for j, p in enumerate(beyond)]
    return rows + [conv(99, "an eval prompt", 0, split="eval")]


def test_the_set_is_beyond_the_scale_without_trained_or_context_free_prompts():
    chosen = validation.choose(pool(), SCALES, "small", 5)
    assert [r["messages"][0]["content"] for r in chosen] == ["new A", "new B", "new C", "new D", "new E"]
    assert all(r["split"] == "train" and r["scale_rank"] >= SCALES["small"] for r in chosen)
    trained = {prompt_key(r["messages"][0]["content"]) for r in pool() if r["scale_rank"] < 6 and r["split"] == "train"}
    assert not {prompt_key(r["messages"][0]["content"]) for r in chosen} & trained


def test_too_few_conversations_or_an_unknown_scale_are_one_line_errors():
    with pytest.raises(StageError, match=r"6 conversations asked beyond scale 'small' \(6\), 5 found") as e:
        validation.choose(pool(), SCALES, "small", 6)
    assert "\n" not in str(e.value)
    with pytest.raises(StageError, match="'medium' is not a data scale"):
        validation.choose(pool(), SCALES, "medium", 1)


def test_the_path_names_its_scale_and_size():
    assert validation.parse(validation.relative_path("small", 200)) == ("small", 200)
    assert validation.parse("data/my-set.jsonl") is None and validation.parse(None) is None


def _cfg(**studies):
    cfg = load_config("smoke")
    return cfg.model_copy(update={"studies": {**cfg.studies, **studies}})


def _study(grid, **kw):
    from pipeline.config import StudyParams
    return StudyParams(grid=grid, **kw)


def test_the_plan_points_every_trial_at_the_validation_set_of_its_scale():
    scales = list(load_config("smoke").data.scales)
    cfg = _cfg(lr=_study({"drafter.variant": ["block"], "train.lr": [0.001, 0.003], "train.scale": scales},
                         validation=3))
    trials = plan(cfg, study="lr")
    assert len(trials) == 2 * len(scales)
    for t in trials:
        assert t.config.eval.data == validation.relative_path(t.config.train.scale, 3)
        assert base_row(t)["eval_data"] == t.config.eval.data and base_row(t)["lr"] == t.config.train.lr
    # other studies still evaluate on the eval split
    assert all(t.config.eval.data is None for t in plan(cfg, study=next(iter(load_config("smoke").studies))))


def test_a_parent_trained_at_another_scale_is_validated_beyond_its_own():
    cfg = load_config("smoke")
    small, large = sorted(cfg.data.scales, key=cfg.data.scales.get)
    cfg = _cfg(h=_study({}, include=[{"drafter.variant": "hybrid", "drafter.init": "ckpt", "train.scale": large,
                                       "train.parent": {"scale": small}}], validation=2))
    by_scale = {t.config.train.scale: t.config.eval.data for t in plan(cfg, study="h")}
    assert by_scale == {small: validation.relative_path(small, 2), large: validation.relative_path(large, 2)}


def test_validation_beside_eval_data_or_above_the_eval_limit_is_a_config_error():
    base = _cfg(lr=_study({"train.lr": [0.001, 0.003]}, validation=3))
    with pytest.raises(ConfigError, match="both `validation` and eval.data=mine.jsonl"):
        plan(with_values(base, {"eval.data": "mine.jsonl"}), study="lr")
    with pytest.raises(ConfigError, match=r"validation=3 conversations, but eval.max_conversations=2"):
        plan(with_values(base, {"eval.max_conversations": 2}), study="lr")


def _workspace(tmp_path: Path, cfg) -> Paths:
    paths = Paths(tmp_path)
    src = next(iter(cfg.data.sources))
    rows = [conv(i, f"prompt {i}", i) for i in range(max(cfg.data.scales.values()) + 5)]
    paths.regenerated(src).parent.mkdir(parents=True)
    paths.regenerated(src).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def test_the_sweep_writes_the_set_before_the_fingerprints_hash_it(tmp_path):
    cfg = _cfg(lr=_study({"train.lr": [0.001, 0.003]}, validation=3))
    paths = _workspace(tmp_path, cfg)
    trials = plan(cfg, study="lr")
    write_validation_sets(trials, paths)
    fingerprint_trials(trials, paths)
    written = paths.root / trials[0].config.eval.data
    assert [r["scale_rank"] for r in read_jsonl(written)] == [cfg.data.scales[cfg.train.scale] + i for i in range(3)]
    assert all("eval" in t.data_hashes for t in trials)
    before, mtime = trials[0].fingerprint, written.stat().st_mtime_ns
    write_validation_sets(trials, paths)          # unchanged content: the file (and the fingerprints) stay
    assert written.stat().st_mtime_ns == mtime
    written.write_text(written.read_text().replace("answer", "reply"))
    again = plan(cfg, study="lr")
    fingerprint_trials(again, paths)
    assert again[0].fingerprint != before          # other conversations: another trial


def test_a_worker_reads_the_relative_set_from_the_root(tmp_path, monkeypatch):
    from stages import evaluate

    seen = {}
    monkeypatch.setattr(evaluate, "run", lambda params, run_dirs, paths, report, **kw: seen.setdefault("d", params.data)
                        and [])
    cfg = with_values(load_config("smoke"), {"eval.data": "data/validation/small-3.jsonl"})
    evaluate_runs(cfg, [], Paths(tmp_path), lambda *a, **k: None)
    assert seen["d"] == str(tmp_path / "data/validation/small-3.jsonl")


# -- the report ------------------------------------------------------------------------------------------------

def _lr_rows(eval_split_lr: float) -> dict[str, list[dict]]:
    """A validation study (block hidden and kv arms at three learning rates; 0.003 best for hidden, 0.001 for kv)
    and a block study that trains both arms at `eval_split_lr`."""
    accs = {("hidden", 0.0003): 0.30, ("hidden", 0.001): 0.36, ("hidden", 0.003): 0.45,
            ("kv", 0.0003): 0.40, ("kv", 0.001): 0.50, ("kv", 0.003): 0.42}
    val = []
    for (ctx, lr), a0 in accs.items():
        r = fx.row("block_lr", f"block-{ctx}-lr{lr}", dict(variant="block", depth=2, context=ctx, block_size=8),
                   a0, a0 * 0.5, 0, 1)
        r.update(values={"drafter.context": ctx, "train.lr": lr}, eval_data="data/validation/small-200.jsonl",
                 lr=lr)
        val.append(r)
    # a no-target control evaluated on the validation set: the findings must not take it for the study's control
    ctrl = fx.row("block_lr", "kv_only-no_target", dict(variant="kv_only", no_target=True), 0.9, 0.9, 0, 1)
    ctrl.update(eval_data="data/validation/small-200.jsonl", lr=0.001)
    block = []
    for ctx in ("hidden", "kv"):
        r = fx.row("block", f"block-{ctx}", dict(variant="block", depth=2, context=ctx, block_size=8), 0.4, 0.2, 0, 1)
        r["lr"] = eval_split_lr
        block.append(r)
    return {"block_lr": val + [ctrl], "block": block}


def _report(tmp_path: Path, rows: dict) -> str:
    fx.write(tmp_path / "metrics", rows, None)
    ctx = {"studies": list(rows)}
    run(ReportParams(bootstrap_draws=300), ctx, Paths(tmp_path), lambda m, step=None: None)
    return (tmp_path / "reports" / "README.md").read_text()


def test_the_report_marks_each_arms_best_and_flags_an_arm_trained_at_another(tmp_path):
    text = _report(tmp_path, _lr_rows(0.001))
    section = text.split("## Validation: block_lr")[1].split("\n## ")[0]
    assert "data/validation/small-200.jsonl" in section
    best = [line for line in section.splitlines() if "**best**" in line]
    assert len(best) == 2 and any("lr 0.003" in b and "hidden" in b for b in best) \
        and any("lr 0.001" in b and "kv context" in b for b in best)
    hidden = next(line for line in section.splitlines() if line.startswith("- **block") and "hidden" in line)
    kv = next(line for line in section.splitlines() if line.startswith("- **block") and "kv context" in line)
    assert "not the validation's best (0.003)" in hidden and "lr 0.001 (block)" in hidden
    assert kv.endswith(": the validation's best")
    assert "## Study: block_lr" not in text


def test_validation_rows_stay_out_of_the_findings(tmp_path):
    rows = _lr_rows(0.001)
    fx.write(tmp_path / "metrics", rows, None)
    res = collect({"studies": list(rows)}, Paths(tmp_path), draws=200)
    text = _report(tmp_path, rows)
    b = next(line for line in text.splitlines() if line.startswith("| B"))
    assert "0.900" not in b                       # the validation study's control is not the findings' control
    assert any(v.claim == "B" for v in findings({"block": res.studies["block"]}, None, ["small"]))


def test_b_says_the_learning_rate_each_arm_trained_at(tmp_path):
    rows = _lr_rows(0.001)
    for r in rows["block"]:
        r["lr"] = 0.003 if r["context"] == "hidden" else 0.001       # each arm at its validation's best
    fx.write(tmp_path / "metrics", rows, None)
    res = collect({"studies": list(rows)}, Paths(tmp_path), draws=200)
    b = next(v for v in findings({"block": res.studies["block"]}, None, ["small"]) if v.claim == "B")
    assert "(trained at lr 0.001 vs 0.003)" in b.evidence


def test_an_exact_tie_in_the_validation_is_said_and_broken_by_plan_order(tmp_path):
    rows = _lr_rows(0.001)
    best = next(r for r in rows["block_lr"] if r["trial"] == "block-hidden-lr0.003")
    i = next(i for i, r in enumerate(rows["block_lr"]) if r["trial"] == "block-hidden-lr0.001")
    keep = {k: rows["block_lr"][i][k] for k in ("trial", "fingerprint", "values", "lr")}
    rows["block_lr"][i] = {**copy.deepcopy(best), **keep}        # lr 0.001 scores exactly as lr 0.003
    section = _report(tmp_path, rows).split("## Validation: block_lr")[1].split("\n## ")[0]
    hidden = next(line for line in section.splitlines() if line.startswith("- **block") and "hidden" in line)
    assert hidden.startswith("- **block, 2 layers, hidden context, B=8**: best at lr 0.001 (over lr 0.003: +0.000")
    assert ", a tie in step MAT, broken by plan order)" in hidden
    kv = next(line for line in section.splitlines() if line.startswith("- **block") and "kv context" in line)
    assert "tie" not in kv
