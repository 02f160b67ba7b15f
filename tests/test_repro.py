"""The whole DAG under DVC on the smoke profile, then ad-hoc sweeps on its data (issues: orchestration, report);
and results that follow the code: each DVC stage lists the code it runs, trial fingerprints hash it.

One fresh workspace for the slow tests: `kvshot repro --profile smoke` builds everything, a second run does
nothing, and `kvshot sweep` re-uses finished trials by fingerprint. The code tests are fast: `dvc status` on a
scratch copy of dvc.yaml and the code, and code hashes over copies (the real files are never touched).
"""
import ast
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.plan_file import read_study_plan
from stages.code_hash import DECODE_CODE, TRIAL_CODE, code_files, code_hash
from stages.common import Paths

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STUDIES = ("injection", "depth", "hybrid", "scale", "block")


def kvshot(*args: str, env: dict, cwd: Path | None = None, timeout: int = 1500) -> subprocess.CompletedProcess:
    out = subprocess.run([str(BIN / "kvshot"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=timeout)
    return out


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """A smoke workspace built by `kvshot repro --profile smoke`; yields (workspace, env, first run)."""
    base = tmp_path_factory.mktemp("workspaces")
    env = dict(os.environ, KVSHOT_WORKSPACES=str(base), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    first = kvshot("repro", "--profile", "smoke", env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return base / "smoke", env, first


@pytest.mark.slow
def test_repro_builds_every_artifact(smoke):
    ws, _, first = smoke
    for stage in ("prepare", "regenerate", "features", "e2e", "report", *(f"study@{s}" for s in STUDIES)):
        assert f"Running stage '{stage}'" in first.stdout, stage
    assert (ws / "data" / "prepared" / "sharegpt.jsonl").is_file()
    assert (ws / "data" / "regenerated" / "sharegpt.jsonl").is_file()
    assert json.loads((ws / "data" / "features" / "small" / "index.json").read_text())
    for study in STUDIES:
        rows = json.loads((ws / "metrics" / "stepwise" / f"{study}.json").read_text())
        assert rows and all(r["status"] == "ok" for r in rows), study
        for row in rows:
            assert len(row["alpha"]) == 7 and len(row["acc"]) == 7
            assert row["code"] == code_hash()          # the code its numbers come from
            assert (ws / "runs" / study / row["trial"] / "model.safetensors").is_file()
            assert (ws / "runs" / study / row["trial"] / "config.json").is_file()
        curves = json.loads((ws / "metrics" / "curves" / f"{study}.json").read_text())
        assert {c["k"] for c in curves} == set(range(7))
        # the plan the sweep executed, beside its runs: every trial with its row's fingerprint, role and baseline
        executed = {e.name: e for e in read_study_plan(Paths(ws), study)}
        assert set(executed) == {r["trial"] for r in rows}, study
        for row in rows:
            e = executed[row["trial"]]
            assert (e.fingerprint, e.role, e.baseline) == (row["fingerprint"], row["role"], row.get("baseline"))
    e2e = json.loads((ws / "metrics" / "e2e.json").read_text())
    # the e2e stage decoded what the plans mark e2e (a trial adopted by two marked studies once)
    marked = {e.fingerprint for s in STUDIES for e in read_study_plan(Paths(ws), s) if e.e2e}
    assert marked and {(ws / r["run_dir"] / "fingerprint").read_text().strip() for r in e2e if r.get("run_dir")} \
        == marked
    drafter_rows = [r for r in e2e if r.get("variant") in ("eagle3", "hybrid")]
    assert drafter_rows and all(r["lossless"] for r in drafter_rows)
    assert all(r["code"] == code_hash(patterns=DECODE_CODE) for r in e2e)     # a decoding's code: the trial's and e2e
    assert (ws / "models").is_symlink() and (ws / "stages").is_symlink()   # the code dvc.yaml lists, linked in
    assert all(r["speedup"] > 0 and 0 <= r["exact_match"] <= 1 for r in drafter_rows)
    decoded = "+".join(sorted({r["study"] for r in e2e if r.get("study")}))   # the decoding is timed per study
    assert json.loads((ws / "scratch" / "timings.json").read_text())[f"e2e:{decoded}"] > 0
    printed = first.stdout + first.stderr                  # `kvshot e2e` prints what it measured
    assert "lossless tree speculative decoding" in printed and "Baselines in the same run" in printed


@pytest.mark.slow
def test_a_fresh_workspace_starts_from_the_answers_study_results_committed(smoke, tmp_path):
    """`kvshot study-results` commits the target's answers beside the results; a fresh workspace of the profile
    regenerates from them into the same bytes (so its rows combine with the committed ones) and 0 new tokens."""
    ws, env, _ = smoke
    results = tmp_path / "results"
    out = kvshot("study-results", str(ws), "--into", str(results / "smoke"), "--profile", "smoke", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the target's answers of sharegpt committed" in " ".join((out.stdout + out.stderr).split())
    assert (results / "smoke" / "conversations" / "sharegpt.jsonl.gz").is_file()
    env2 = dict(env, KVSHOT_WORKSPACES=str(tmp_path / "ws"), KVSHOT_RESULTS=str(results))
    out = kvshot("repro", "--profile", "smoke", "--stage", "regenerate", env=env2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    said = " ".join((out.stdout + out.stderr).split())
    assert "data/regenerated/sharegpt.jsonl: the target's answers from" in said and " 0 new tokens" in said
    fresh = tmp_path / "ws" / "smoke" / "data" / "regenerated" / "sharegpt.jsonl"
    assert fresh.read_bytes() == (ws / "data" / "regenerated" / "sharegpt.jsonl").read_bytes()


@pytest.mark.slow
def test_report_has_every_table_figure_and_verdict(smoke):
    ws, _, _ = smoke
    text = (ws / "reports" / "README.md").read_text()
    for title in ("Injection study", "Depth study", "Hybrid study", "Scale study", "Findings", "Provenance"):
        assert title in text
    for claim in ("P1", "P2", "P3", "H", "E"):
        line = next(ln for ln in text.splitlines() if ln.split("|")[1:2] and ln.split("|")[1].strip() == claim)
        assert any(v in line for v in ("holds", "does not hold", "inconclusive", "not measured")), line
    assert "step accuracy" in text and "Chain acceptance" in text and "EAGLE-3 (hidden-only) continued" in text
    assert "no target information (control)" in text
    figures = [ln.split("](")[1].rstrip(")") for ln in text.splitlines() if ln.startswith("![")]
    assert len(figures) >= 5
    for fig in figures:
        assert (ws / "reports" / fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_second_repro_does_nothing(smoke):
    ws, env, _ = smoke
    again = kvshot("repro", "--profile", "smoke", env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Running stage" not in again.stdout
    status = subprocess.run([str(BIN / "dvc"), "status"], cwd=ws, env=env, capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout
    shown = subprocess.run([str(BIN / "dvc"), "metrics", "show"], cwd=ws, env=env, capture_output=True, text=True)
    assert "metrics/summary/depth.json" in shown.stdout and "mat" in shown.stdout, shown.stdout
    assert "metrics/summary/e2e.json" in shown.stdout and "tau" in shown.stdout, shown.stdout


@pytest.mark.slow
def test_sweeps_track_in_mlflow_and_skip_finished_trials(smoke):
    ws, env, _ = smoke
    # the smoke depth study trained depths 1 and 2: an ad-hoc grid adopts those and trains only what is new
    first = kvshot("sweep", "depth=2,3,4", "--root", str(ws), env=env, cwd=ws)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "2 ran, 1 reused" in first.stdout, first.stdout[-2000:]
    timings = lambda: json.loads((ws / "scratch" / "timings.json").read_text())  # noqa: E731
    trained_in = timings()["sweep:adhoc"]
    assert trained_in > 0
    again = kvshot("sweep", "depth=2,3,4", "--root", str(ws), env=env, cwd=ws)
    assert again.returncode == 0 and "0 ran" in again.stdout, again.stdout[-2000:]
    dry = kvshot("sweep", "depth=2,3,4", "--dry-run", "--root", str(ws), env=env, cwd=ws)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert dry.stdout.count("done") == 3 and "sweep adhoc: 0 of 3 trials to train" in dry.stdout, dry.stdout
    grown_dry = kvshot("sweep", "depth=2,3,4,5", "--dry-run", "--root", str(ws), env=env, cwd=ws)
    assert "sweep adhoc: 1 of 4 trials to train, about" in grown_dry.stdout, grown_dry.stdout
    # neither adopting every trial nor a dry run is the study's wall time: the report keeps the training run's
    assert timings()["sweep:adhoc"] == trained_in
    # the new trial as a part of the grid: timed under its own key, beside the whole grid's
    grown = kvshot("sweep", "depth=2,3,4,5", "--only", "depth=5", "--root", str(ws), env=env, cwd=ws)
    assert grown.returncode == 0 and "1 ran" in grown.stdout, grown.stdout[-2000:]
    assert timings()["sweep:adhoc"] == trained_in and timings()["sweep:adhoc --only drafter.depth=5"] > 0

    db = sqlite3.connect(ws / "mlflow.db")
    exp = db.execute("select experiment_id from experiments where name like '%adhoc'").fetchone()[0]
    runs = db.execute("select run_uuid, status from runs where experiment_id=?", (exp,)).fetchall()
    parents = {r for r, in db.execute(
        "select run_uuid from runs where experiment_id=? and run_uuid not in "
        "(select run_uuid from tags where key='mlflow.parentRunId')", (exp,))}
    assert len(parents) == 3 and len(runs) >= 3 + 3
    first_parent = db.execute("select run_uuid from runs where experiment_id=? order by start_time limit 1",
                              (exp,)).fetchone()[0]
    children = [r for r, in db.execute("select run_uuid from tags where key='mlflow.parentRunId' and value=?",
                                       (first_parent,))]
    reused = {r for r, in db.execute("select run_uuid from tags where key='reused_from'")}
    assert len(children) == 3 and len(set(children) & reused) == 1   # the adopted depth 2 is listed too
    for child in children:
        keys = {k for k, in db.execute("select key from params where run_uuid=?", (child,))}
        assert {"drafter.depth", "train.lr"} <= keys
        def steps(key):
            return {s for s, in db.execute("select step from metrics where run_uuid=? and key=?", (child, key))}
        assert steps("acc") == set(range(7))
        # α_k is undefined (not logged) once no position has all earlier steps right: a briefly trained drafter
        assert 0 in steps("alpha") and steps("alpha") <= set(range(7))
        assert db.execute("select count(*) from metrics where run_uuid=? and key='mat'", (child,)).fetchone()[0]


@pytest.mark.slow
def test_a_validation_study_trains_evaluates_beyond_its_scale_and_reports_apart(smoke):
    """A study with `validation` on the real stages: its trials train at the small scale, are evaluated on the
    training conversations beyond it (written by the sweep), and the report shows them in a section of their own.
    A study that takes the learning rate from it (`choose`) is refused before it ran here, then trains at the
    value with the best validation step MAT, which its row, plan entry and fingerprint carry."""
    ws, env, _ = smoke
    params_file = ws / "params.yaml"
    original = params_file.read_text()
    params = yaml.safe_load(original)
    small = min(params["data"]["scales"], key=params["data"]["scales"].get)
    arm = {"drafter.variant": ["kv_only"], "train.scale": [small]}
    params["studies"]["lrv"] = {"grid": {**arm, "train.lr": [0.001, 0.003]}, "validation": 3}
    params["studies"]["pick"] = {"grid": arm, "choose": {"train.lr": "lrv"}}
    try:
        params_file.write_text(yaml.safe_dump(params, sort_keys=False))
        refused = kvshot("sweep", "--study", "pick", "--root", str(ws), env=env, cwd=ws)
        assert refused.returncode != 0 and "is chosen by lrv, which has not finished 2 of the trials" in \
            refused.stderr and "run `kvshot sweep --study lrv` here first" in refused.stderr
        out = kvshot("sweep", "--study", "lrv", "--root", str(ws), env=env, cwd=ws)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        rows = json.loads((ws / "metrics" / "stepwise" / "lrv.json").read_text())
        where = f"data/validation/{small}-3.jsonl"
        chosen = [json.loads(line)["id"] for line in (ws / where).read_text().splitlines()]
        assert len(rows) == 2 and all(r["status"] == "ok" and r["eval_data"] == where for r in rows)
        assert all(r["per_conversation"]["ids"] == chosen for r in rows)      # those conversations, none other
        assert all(r["scale_rank"] >= params["data"]["scales"][small]
                   for r in map(json.loads, (ws / where).read_text().splitlines()))
        report_root = ws / "scratch" / "lrv-report"
        shutil.rmtree(report_root, ignore_errors=True)
        (report_root / "metrics" / "stepwise").mkdir(parents=True)
        shutil.copy(ws / "metrics" / "stepwise" / "lrv.json", report_root / "metrics" / "stepwise")
        from stages.report import ReportParams, run
        run(ReportParams(bootstrap_draws=200), {"studies": ["lrv"]}, Paths(report_root), lambda m, step=None: None)
        text = (report_root / "reports" / "README.md").read_text()
        assert "## Validation: lrv" in text and where in text and "**best**" in text
        picked = kvshot("sweep", "--study", "pick", "--root", str(ws), env=env, cwd=ws)
        assert picked.returncode == 0 and "chosen by lrv" in picked.stderr, picked.stderr[-3000:]
        val = {r["lr"]: r["step_mat"] for r in rows}
        (row,) = json.loads((ws / "metrics" / "stepwise" / "pick.json").read_text())
        assert row["status"] == "ok" and row["lr"] == max(val, key=val.get) and "eval_data" not in row
        (entry,) = read_study_plan(Paths(ws), "pick")
        assert entry.config["train"]["lr"] == row["lr"] and entry.fingerprint == row["fingerprint"]
        assert entry.chosen["train.lr"].startswith(f"train.lr {row['lr']} chosen by lrv")
    finally:
        params_file.write_text(original)
        for study in ("lrv", "pick"):
            (ws / "metrics" / "stepwise" / f"{study}.json").unlink(missing_ok=True)
        shutil.rmtree(ws / "runs" / "pick", ignore_errors=True)


@pytest.mark.slow
def test_a_part_of_a_study_runs_in_one_go_from_a_fresh_workspace(tmp_path):
    """`kvshot repro --part STUDY/PART`: the data stages, the part's sweep and the end-to-end decoding of its
    drafters the study marks, nothing of the other studies, and one wall time for the whole in the parts record;
    then `--part STUDY`: its parts in order, the one done skipped."""
    env = dict(os.environ, KVSHOT_WORKSPACES=str(tmp_path), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    out = kvshot("repro", "--profile", "smoke", "--part", "block/blocks", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ws = tmp_path / "smoke"
    assert sorted(p.name for p in (ws / "runs").iterdir()) == ["block"]
    assert sorted(p.name for p in (ws / "runs" / "block").iterdir()) == ["block-hidden", "block-kv", "plan.json"]
    assert {e.name: e.parts for e in read_study_plan(Paths(ws), "block")} == {"block-hidden": ["blocks"],
                                                                              "block-kv": ["blocks"]}
    assert [p.name for p in (ws / "metrics" / "stepwise").glob("*.json")] == ["block.json"]
    assert {r["trial"] for r in json.loads((ws / "metrics" / "e2e.json").read_text())} == {"block-hidden",
                                                                                          "block-kv"}
    assert not (ws / "reports").exists()
    record = json.loads((ws / "scratch" / "parts.json").read_text())["block/blocks"]
    assert record["fresh"] is True and record["wall_s"] > record["data_stages_s"] > 0
    times = json.loads((ws / "scratch" / "timings.json").read_text())
    assert {"prepare", "regenerate", "features", "sweep:block --only drafter.variant=block",
            "e2e:block --only drafter.variant=block"} <= set(times)
    # the data stages' DVC records are the whole profile's: a later `kvshot repro` picks up from them
    assert "features" in (ws / "dvc.lock").read_text()
    # the study by name: the part done is skipped (its time in one go kept), the other runs after it
    out = kvshot("repro", "--profile", "smoke", "--part", "block", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "part block/blocks: done in this workspace (2 trials finished, decoded;" in out.stderr
    parts = json.loads((ws / "scratch" / "parts.json").read_text())
    assert parts["block/blocks"] == record and set(parts) == {"block/blocks", "block/autoregressive"}
    assert json.loads((ws / "scratch" / "timings.json").read_text())["sweep:block --only drafter.variant=block"] == \
        times["sweep:block --only drafter.variant=block"]
    assert {r["trial"] for r in json.loads((ws / "metrics" / "stepwise" / "block.json").read_text())} == \
        {"block-hidden", "block-kv", "eagle3", "eagle3.1"}
    out = kvshot("repro", "--profile", "smoke", "--part", "all", "--dry-run", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [ln.split(" (")[0] for ln in out.stdout.splitlines()][-3:] == [
        # its eagle3 is the block study's: adopted; its other two the hybrid study's part trains before it
        "part scale/(whole): 1 of 3 trials finished; 2 trained by the parts before it; then decoded",
        "part block/blocks: done in this workspace", "part block/autoregressive: done in this workspace"]


# -- results that follow the code ---------------------------------------------------------------------------------

# The module(s) each DVC stage runs.
STAGE_ENTRIES = {"prepare": ["stages.prepare"], "regenerate": ["stages.regenerate"], "features": ["stages.features"],
                 "study": ["stages.train", "stages.evaluate", "stages.validation"], "e2e": ["stages.e2e"], "report": ["stages.report"]}
# Docstring-only package markers.
NOT_CODE = {"models/__init__.py", "stages/__init__.py"}
REPORT_ONLY = {"stages/findings.py", "stages/results.py", "stages/baselines.py"}    # besides stages/report*.py
# In the stages' own closure but not in a trial's code hash: the params sections (their resolved values are the
# trial's hashed config) and the hash itself (a change of TRIAL_CODE or of how it hashes changes the hash anyway).
NOT_HASHED = {"stages/sections.py", "stages/code_hash.py"}


def _module_file(root: Path, name: str) -> Path | None:
    p = root.joinpath(*name.split("."))
    for f in (p / "__init__.py", p.with_suffix(".py")):
        if f.is_file():
            return f
    return None


def imported_code(root: Path, entries: list[str]) -> set[str]:
    """Files of models/ and stages/ that `entries` import, directly or not: every import statement, also those
    inside functions (they run too), read from the source without importing it."""
    seen: set[Path] = set()
    todo = list(entries)
    while todo:
        name = todo.pop()
        f = _module_file(root, name)
        if f is None or f in seen or f.relative_to(root).parts[0] not in ("models", "stages"):
            continue
        seen.add(f)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        package = f.relative_to(root).with_suffix("").parts[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ((node.module,) if node.module else ())) \
                    if node.level else node.module
                todo += [base] + [f"{base}.{a.name}" for a in node.names]
    return {f.relative_to(root).as_posix() for f in seen}


def dvc_code_deps(root: Path = ROOT) -> dict[str, set[str]]:
    """{stage: the code files its deps name}; a folder dep (`models`) stands for every .py file under it."""
    tree = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    out = {}
    for name, stage in tree.items():
        deps = (stage.get("do") or stage).get("deps") or []
        files: set[str] = set()
        for dep in deps:
            path = root / dep
            if dep.split("/")[0] not in ("models", "stages"):
                continue
            assert path.exists(), f"dvc.yaml: stage {name} lists {dep}, which does not exist"
            files |= ({p.relative_to(root).as_posix() for p in path.rglob("*.py") if "__pycache__" not in p.parts}
                      if path.is_dir() else {dep})
        out[name] = files
    return out


def test_every_dvc_stage_lists_the_code_it_runs():
    deps = dvc_code_deps()
    assert set(deps) == set(STAGE_ENTRIES)
    for stage, entries in STAGE_ENTRIES.items():
        needed = imported_code(ROOT, entries) - NOT_CODE
        assert needed - deps[stage] == set(), f"dvc.yaml stage {stage}: deps lack {sorted(needed - deps[stage])}"
    # the study stages see every file of a trial's code hash (what retrains a trial reruns its stage), the e2e stage
    # every file of a decoding's
    hashed = {p.relative_to(ROOT).as_posix() for p in code_files()}
    assert hashed - deps["study"] == set()
    assert {"models/ttt.py", "stages/train.py", "stages/evaluate.py"} <= hashed and "stages/report.py" not in hashed
    decoded = {p.relative_to(ROOT).as_posix() for p in code_files(patterns=DECODE_CODE)}
    assert decoded - deps["e2e"] == set()
    assert decoded - hashed == {"stages/e2e.py", "stages/engine.py", "stages/engine_env.py", "stages/engine_report.py",
                                "stages/vllm_generate.py", "stages/vllm_proposer.py"}


def test_the_code_hash_holds_the_code_a_trial_runs():
    """TRIAL_CODE covers every module train, evaluate and features import, DECODE_CODE every module e2e imports too
    (but the documented exceptions), and each of their literal entries exists."""
    for pattern in DECODE_CODE:
        assert any(ROOT.glob(pattern)), f"code hash entry {pattern} matches nothing"
    hashed = {p.relative_to(ROOT).as_posix() for p in code_files()}
    runs = imported_code(ROOT, ["stages.train", "stages.evaluate", "stages.features"])
    assert runs - hashed - NOT_CODE - NOT_HASHED == set()
    # and no report code: a change of how the report reads rows reaches neither a trial's hash nor its stage's deps
    assert not {p for p in runs if p.startswith("stages/report") or p in REPORT_ONLY}, runs
    assert "stages/prepare.py" not in hashed and "stages/report.py" not in hashed and "stages/e2e.py" not in hashed
    decodes = imported_code(ROOT, ["stages.e2e"])
    assert decodes - {p.relative_to(ROOT).as_posix() for p in code_files(patterns=DECODE_CODE)} - NOT_CODE \
        - NOT_HASHED == set()


def _copy_code(dst: Path) -> Path:
    for name in ("models", "stages"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_a_trial_fingerprint_changes_with_its_code(tmp_path):
    """Over copies of the code (the real files are untouched): an edit of models/ttt.py gives another code hash
    and so another fingerprint; an edit of the report does not."""
    from pipeline.config import load_config
    from pipeline.fingerprint import fingerprint

    before = code_hash(_copy_code(tmp_path / "a"))
    model_edit = _copy_code(tmp_path / "b")
    (model_edit / "models" / "ttt.py").write_text((ROOT / "models" / "ttt.py").read_text() + "\n# changed\n")
    report_edit = _copy_code(tmp_path / "c")
    (report_edit / "stages" / "report.py").write_text((ROOT / "stages" / "report.py").read_text() + "\n# changed\n")
    assert before == code_hash(ROOT)                       # the copy hashes like the project
    assert code_hash(model_edit) != before
    assert code_hash(report_edit) == before
    cfg = load_config("smoke")
    assert fingerprint(cfg, {}, code=code_hash(model_edit)) != fingerprint(cfg, {}, code=before)
    assert fingerprint(cfg, {}) == fingerprint(cfg, {}, code=code_hash())   # the project's code by default


def _dvc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_SITE_CACHE_DIR=str(cwd / ".dvc-site"))
    out = subprocess.run([str(BIN / "dvc"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"dvc {' '.join(args)}: {out.stdout[-1500:]}{out.stderr[-1500:]}"
    return out


def test_dvc_status_reruns_the_stages_a_code_change_affects(tmp_path):
    """A scratch DVC project with the repo's dvc.yaml, params.yaml and a copy of the code, every stage recorded as
    done (placeholder outputs): an edit of models/ttt.py changes the study stages and e2e, one of stages/report.py
    the report alone."""
    proj = _copy_code(tmp_path)
    for f in ("dvc.yaml", "params.yaml", ".dvcignore"):
        shutil.copy(ROOT / f, proj / f)
    _dvc("init", "--no-scm", "-q", cwd=proj)
    params = yaml.safe_load((proj / "params.yaml").read_text())
    studies = [f"study@{s}" for s in params["studies"]]
    for stage in yaml.safe_load((proj / "dvc.yaml").read_text())["stages"].values():
        stage = stage.get("do") or stage
        for kind in ("deps", "outs", "metrics", "plots"):
            for entry in stage.get(kind) or []:
                path = next(iter(entry)) if isinstance(entry, dict) else entry
                for study in params["studies"]:
                    p = proj / path.replace("${key}", study)
                    if not p.exists():
                        if p.suffix in (".json", ".md"):
                            p.parent.mkdir(parents=True, exist_ok=True)
                            p.write_text("[]\n" if p.suffix == ".json" else "placeholder\n")
                        else:
                            p.mkdir(parents=True)
    _dvc("commit", "-f", "-q", cwd=proj)

    def changed() -> set[str]:
        return set(json.loads(_dvc("status", "--json", cwd=proj).stdout or "{}"))

    assert changed() == set()
    ttt = proj / "models" / "ttt.py"
    original = ttt.read_text()
    ttt.write_text(original + "\n# changed\n")
    assert changed() == set(studies) | {"e2e"}
    ttt.write_text(original)
    assert changed() == set()
    report = proj / "stages" / "report.py"
    report.write_text(report.read_text() + "\n# changed\n")
    assert changed() == {"report"}


def test_metric_rows_carry_their_code_hash(tmp_path):
    """A stepwise row (evaluate's, and a trial's failed row) names the code its numbers come from; e2e rows do too
    (test_repro_builds_every_artifact checks the written files)."""
    from models.metrics import StepCounts
    from pipeline.config import load_config
    from pipeline.trial import Trial, failed_row
    from stages.evaluate import row_for

    counts = StepCounts([4] * 7, [2] * 7, [4] * 7, [2] * 7, [4] * 7)
    config = {"drafter": {"variant": "eagle3", "depth": 1},
              "params": {"drafter": {"init": "random"}, "train": {"scale": "small", "seed": 0}}}
    assert row_for(tmp_path / "eagle3", config, counts, steps=7, positions=4)["code"] == code_hash()
    trial = Trial(name="eagle3", study="solo", values={}, config=load_config("smoke"))
    assert failed_row(trial, "RuntimeError: x")["code"] == code_hash() != ""
