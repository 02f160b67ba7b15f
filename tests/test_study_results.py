"""`kvshot study-results`: studies run in different workspaces fold into one committed results folder, each study's
metrics and records from where it last ran, and the report is regenerated from the merged files alone."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.machine import cpu_name
from pipeline.provenance import record_part, record_time
from pipeline.study_results import install, merge, merged_lock
from stages.common import StageError

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "results" / "study"
KVSHOT = str(Path(sys.executable).parent / "kvshot")


def _lock(stages: dict) -> str:
    return yaml.safe_dump({"schema": "2.0", "stages": stages}, sort_keys=False)


@pytest.fixture()
def folders(tmp_path):
    """A committed results folder holding injection and depth, and a workspace that ran depth again and scale."""
    results, ws = tmp_path / "results", tmp_path / "ws"
    (results / "metrics" / "stepwise").mkdir(parents=True)
    (results / "figures").mkdir()
    (results / "figures" / "old.png").write_bytes(b"png")
    for name in ("injection", "depth"):
        (results / "metrics" / "stepwise" / f"{name}.json").write_text(json.dumps([{"committed": name}]))
    (results / "timings.json").write_text(json.dumps({"regenerate": 900.0, "sweep:injection": 5800.0,
                                                      "sweep:depth": 8300.0}))
    (results / "dvc.lock").write_text(_lock({"prepare": {"cmd": "kvshot prepare", "md5": "old"},
                                             "study@injection": {"cmd": "kvshot sweep --study injection"}}))
    (ws / "metrics" / "stepwise").mkdir(parents=True)
    (ws / "scratch").mkdir()
    for name in ("depth", "scale"):
        (ws / "metrics" / "stepwise" / f"{name}.json").write_text(json.dumps([{"workspace": name}]))
    (ws / "metrics" / "e2e.json").write_text("[]")
    (ws / "scratch" / "timings.json").write_text(json.dumps({"regenerate": 950.0, "sweep:scale": 7000.0}))
    (ws / "scratch" / "machines.json").write_text(json.dumps({"sweep:scale": "2 CPU cores (native bf16)"}))
    (ws / "dvc.lock").write_text(_lock({"prepare": {"cmd": "kvshot prepare", "md5": "new"},
                                        "study@scale": {"cmd": "kvshot sweep --study scale"}}))
    return results, ws, tmp_path / "staging"


def test_the_workspace_replaces_only_the_studies_it_ran(folders):
    results, ws, staging = folders
    merged = merge(ws, results, staging)
    assert merged.from_workspace == ["depth", "scale"] and merged.kept == ["injection"]
    assert merged.e2e == "the workspace"
    stepwise = {p.stem: json.loads(p.read_text()) for p in (staging / "metrics" / "stepwise").glob("*.json")}
    assert stepwise == {"injection": [{"committed": "injection"}], "depth": [{"workspace": "depth"}],
                        "scale": [{"workspace": "scale"}]}
    times = json.loads((staging / "scratch" / "timings.json").read_text())
    assert times == {"regenerate": 950.0, "sweep:depth": 8300.0, "sweep:injection": 5800.0, "sweep:scale": 7000.0}
    assert json.loads((staging / "scratch" / "machines.json").read_text()) == {"sweep:scale": "2 CPU cores (native bf16)"}
    lock = yaml.safe_load(merged_lock(ws, results))
    assert lock["stages"]["prepare"]["md5"] == "new"
    assert set(lock["stages"]) == {"prepare", "study@injection", "study@scale"}
    assert (results / "metrics" / "stepwise" / "depth.json").read_text() == json.dumps([{"committed": "depth"}])


def test_a_study_run_in_parts_combines_its_rows_on_the_same_data(folders):
    """Seeds 1 and 2 run in a second workspace on the same conversations as the committed seed 0: the study keeps
    seed 0's rows (whatever CPU computed their feature cache) and adds the new ones, and its sweep time is the sum of
    both parts; rows on other conversations (or without data hashes) are replaced as before."""
    results, ws, staging = folders
    same = {"regenerated/sharegpt": "sha256:a", "features/small": "dir-sha256:1"}
    other = {"regenerated/sharegpt": "sha256:b", "features/small": "dir-sha256:1"}
    rounded = {**same, "features/small": "dir-sha256:2"}     # the same conversations, the target run elsewhere
    committed = [{"trial": "eagle3", "data": rounded}, {"trial": "eagle3-s1", "data": same},
                 {"trial": "eagle3-s3", "data": other}, {"trial": "old"}]
    (results / "metrics" / "stepwise" / "depth.json").write_text(json.dumps(committed))
    fresh = [{"trial": "eagle3-s1", "data": same, "new": True}, {"trial": "eagle3-s2", "data": same}]
    (ws / "metrics" / "stepwise" / "depth.json").write_text(json.dumps(fresh))
    record_time(ws, "sweep:depth", 100.0)
    record_time(ws, "e2e:depth", 30.0)
    (results / "timings.json").write_text(json.dumps({"sweep:depth": 8300.0, "e2e:depth": 600.0, "e2e:scale": 9.0}))
    merged = merge(ws, results, staging)
    assert merged.combined == ["depth"]
    rows = json.loads((staging / "metrics" / "stepwise" / "depth.json").read_text())
    assert [r["trial"] for r in rows] == ["eagle3", "eagle3-s1", "eagle3-s2"] and rows[1]["new"]
    times = json.loads((staging / "scratch" / "timings.json").read_text())
    assert (times["sweep:depth"], times["e2e:depth"], times["e2e:scale"]) == (8400.0, 630.0, 9.0)
    # a grid cut to one seed names its trials without the seed: the same name on another seed is another trial
    (ws / "metrics" / "stepwise" / "depth.json").write_text(json.dumps([{"trial": "eagle3", "seed": 1, "data": same}]))
    rows = json.loads((merge(ws, results, staging).root / "metrics" / "stepwise" / "depth.json").read_text())
    assert [(r["trial"], r.get("seed")) for r in rows] == [("eagle3", None), ("eagle3-s1", None), ("eagle3", 1)]
    (ws / "metrics" / "stepwise" / "depth.json").write_text(json.dumps([{"trial": "x", "data": other}]))
    merged = merge(ws, results, staging)
    assert merged.combined == ["depth"] and [r["trial"] for r in json.loads(
        (staging / "metrics" / "stepwise" / "depth.json").read_text())] == ["eagle3-s3", "x"]
    assert merged.other_data == {"depth": 3}      # eagle3 and eagle3-s1 on the other conversations, "old" on none
    (ws / "metrics" / "stepwise" / "depth.json").write_text(json.dumps([{"trial": "x"}]))
    merged = merge(ws, results, staging)
    assert merged.combined == [] and json.loads((staging / "scratch" / "timings.json").read_text())[
        "sweep:depth"] == 100.0


def test_e2e_rows_merge_by_study(folders):
    """The scale and block studies decode in different workspaces: the workspace's rows replace the committed rows
    of the studies it decoded, the other studies' rows stay; without a workspace file the committed one stays."""
    results, ws, staging = folders
    committed = [{"study": "scale", "trial": "eagle3-large", "committed": True},
                 {"study": "block", "trial": "block-kv-d2", "committed": True}]
    (results / "metrics" / "e2e.json").write_text(json.dumps(committed))
    assert merge(ws, results, staging).e2e == "the workspace, with the committed rows of block, scale"
    assert json.loads((staging / "metrics" / "e2e.json").read_text()) == committed   # the workspace decoded none
    fresh = [{"study": "block", "trial": "block-kv-d2"}, {"study": "block", "trial": "block-hidden-d2"}]
    (ws / "metrics" / "e2e.json").write_text(json.dumps(fresh))
    assert merge(ws, results, staging).e2e == "the workspace, with the committed rows of scale"
    assert json.loads((staging / "metrics" / "e2e.json").read_text()) == [committed[0], *fresh]
    (results / "metrics" / "e2e.json").unlink()
    assert merge(ws, results, staging).e2e == "the workspace"
    (results / "metrics" / "e2e.json").write_text(json.dumps(committed))
    (ws / "metrics" / "e2e.json").unlink()
    assert merge(ws, results, staging).e2e == "as committed"
    assert json.loads((staging / "metrics" / "e2e.json").read_text()) == committed
    (results / "metrics" / "e2e.json").unlink()
    assert merge(ws, results, staging).e2e == "none" and not (staging / "metrics" / "e2e.json").exists()


def test_e2e_rows_of_a_study_run_in_parts_combine_like_its_step_wise_rows(folders):
    """The block study decoded block-kv in one workspace and block-both in another, on the same conversations: its
    committed end-to-end rows of the trials the workspace did not decode stay; on other conversations they go."""
    results, ws, staging = folders
    same = {"regenerated/sharegpt": "sha256:a"}
    (results / "metrics" / "stepwise" / "block.json").write_text(json.dumps(
        [{"trial": "block-kv", "seed": 0, "data": same}, {"trial": "block-hidden", "seed": 0, "data": same}]))
    committed = [{"study": "block", "trial": "block-kv", "seed": 0, "committed": True},
                 {"study": "block", "trial": "block-hidden", "seed": 0, "committed": True}]
    (results / "metrics" / "e2e.json").write_text(json.dumps(committed))
    (ws / "metrics" / "stepwise" / "block.json").write_text(json.dumps(
        [{"trial": "block-both", "seed": 0, "data": same}, {"trial": "block-kv", "seed": 0, "data": same}]))
    fresh = [{"study": "block", "trial": "block-both", "seed": 0}, {"study": "block", "trial": "block-kv", "seed": 0}]
    (ws / "metrics" / "e2e.json").write_text(json.dumps(fresh))
    merge(ws, results, staging)
    assert json.loads((staging / "metrics" / "e2e.json").read_text()) == [committed[1], *fresh]
    (ws / "metrics" / "stepwise" / "block.json").write_text(json.dumps(
        [{"trial": "block-both", "seed": 0, "data": {"regenerated/sharegpt": "sha256:b"}}]))
    merge(ws, results, staging)
    assert json.loads((staging / "metrics" / "e2e.json").read_text()) == fresh


def test_install_swaps_the_folder_contents(folders):
    results, ws, staging = folders
    merge(ws, results, staging)
    (staging / "reports" / "figures").mkdir(parents=True)
    (staging / "reports" / "figures" / "alpha_scale.png").write_bytes(b"new")
    (staging / "reports" / "README.md").write_text("# report\n")
    install(staging, ws, results)
    assert (results / "report.md").read_text() == "# report\n"
    assert sorted(p.name for p in (results / "figures").iterdir()) == ["alpha_scale.png"]   # the stale one went
    assert sorted(p.name for p in (results / "metrics" / "stepwise").iterdir()) == ["depth.json", "injection.json",
                                                                                    "scale.json"]
    assert json.loads((results / "machines.json").read_text()) == {"sweep:scale": "2 CPU cores (native bf16)"}
    assert "study@scale" in (results / "dvc.lock").read_text()
    assert not any(p.name.startswith(".") for p in results.iterdir())


def test_a_workspace_without_metrics_is_refused(folders):
    results, ws, staging = folders
    shutil.rmtree(ws / "metrics")
    with pytest.raises(StageError, match=r"no rows in metrics/stepwise"):
        merge(ws, results, staging)


def test_a_broken_record_names_its_file(folders):
    results, ws, staging = folders
    (ws / "scratch" / "timings.json").write_text("{")
    with pytest.raises(StageError, match="timings.json: not valid JSON"):
        merge(ws, results, staging)


def test_parts_run_in_one_go_merge_by_part_the_workspace_winning(folders):
    results, ws, staging = folders
    (results / "parts.json").write_text(json.dumps({"depth/seed0": {"wall_s": 7000.0}, "scale/a": {"wall_s": 1.0}}))
    record_part(ws, "scale/a", 8000.0, 2000.0, fresh=True)
    merge(ws, results, staging)
    parts = json.loads((staging / "scratch" / "parts.json").read_text())
    assert parts["depth/seed0"] == {"wall_s": 7000.0}
    assert parts["scale/a"]["wall_s"] == 8000.0 and parts["scale/a"]["data_stages_s"] == 2000.0
    assert parts["scale/a"]["fresh"] is True and parts["scale/a"]["machine"] and parts["scale/a"]["commit"]
    # the stage times stay the stages' own: a part's time is not added to the total the report sums
    assert "scale/a" not in json.dumps(json.loads((staging / "scratch" / "timings.json").read_text()))


def test_record_time_keeps_the_machine_beside_the_time(tmp_path):
    record_time(tmp_path, "sweep:scale", 12.34, machine="machine A")
    record_time(tmp_path, "features", 5.0, machine="machine B")
    assert json.loads((tmp_path / "scratch" / "timings.json").read_text()) == {"features": 5.0, "sweep:scale": 12.3}
    assert json.loads((tmp_path / "scratch" / "machines.json").read_text()) == {"features": "machine B",
                                                                                 "sweep:scale": "machine A"}


def test_cpu_name_reads_the_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu\n")
    assert cpu_name(info) == "AMD EPYC 9B14"
    assert cpu_name(tmp_path / "missing")   # falls back to what platform knows


def test_cli_regenerates_the_report_from_committed_and_new_metrics(tmp_path):
    """The committed injection and depth metrics plus a workspace that ran depth again: the report holds both
    studies, the per-study table names the machine the workspace recorded, the committed folder keeps injection."""
    results = tmp_path / "results"
    shutil.copytree(COMMITTED, results)
    # the committed depth parts and part sweeps would be timed beside this sweep: only the workspace's time stays
    for name, depth_key in (("parts.json", "depth/"), ("timings.json", "sweep:depth ")):
        path = results / name
        if path.is_file():
            path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                        if not k.startswith(depth_key)}))
    ws = tmp_path / "ws"
    (ws / "metrics" / "stepwise").mkdir(parents=True)
    (ws / "scratch").mkdir()
    shutil.copy2(COMMITTED / "metrics" / "stepwise" / "depth.json", ws / "metrics" / "stepwise" / "depth.json")
    (ws / "scratch" / "timings.json").write_text(json.dumps({"sweep:depth": 600.0}))
    (ws / "scratch" / "machines.json").write_text(json.dumps({"sweep:depth": "test machine with 2 cores"}))
    out = subprocess.run([KVSHOT, "study-results", str(ws), "--into", str(results)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    committed = sorted(p.stem for p in (COMMITTED / "metrics" / "stepwise").glob("*.json"))
    assert "injection" in committed and "depth" in committed
    kept = [name for name in committed if name != "depth"]
    assert f"kept as committed: {', '.join(kept)}" in out.stdout + out.stderr
    report = (results / "report.md").read_text()
    assert "| depth     |" in report and "| injection |" in report
    assert "10.0 min (sweep)" in report and "test machine with 2 cores" in report
    # where the report itself was written is named as such, not as where the studies ran
    assert re.search(r"\| report +\| regenerated from committed metrics \(`kvshot study-results`\): the commit, date "
                     r"and hardware below are the regeneration's", report)
    assert sorted(p.stem for p in (results / "metrics" / "stepwise").iterdir()) == committed
    kept_time = json.loads((COMMITTED / "timings.json").read_text())["sweep:injection"]   # the committed study's
    assert json.loads((results / "timings.json").read_text())["sweep:injection"] == kept_time

    bad = subprocess.run([KVSHOT, "study-results", str(tmp_path / "nowhere"), "--into", str(results)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no rows in metrics/stepwise" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_the_executed_plans_merge_beside_the_metrics(folders):
    """runs/<study>/plan.json of the workspace lands in metrics/plans/<study>.json: a study run in parts adds its
    trials by name, a study run again replaces its plan, other studies' plans stay as committed."""
    from pipeline.plan_file import PlanFile, PlannedTrial

    def plan_of(*names, fp="new"):
        return PlanFile(profile="study", trials=[PlannedTrial(
            name=n, study="depth", variant="eagle3", values={}, parent=None, baseline=None, role="trial", parts=[],
            e2e=False, evaluated_on="eval split", config={}, fingerprint=f"{fp}-{n}") for n in names])

    results, ws, staging = folders
    (results / "metrics" / "plans").mkdir()
    committed = plan_of("eagle3", "eagle3-s1", fp="old")
    (results / "metrics" / "plans" / "depth.json").write_text(committed.model_dump_json())
    (results / "metrics" / "plans" / "injection.json").write_text(plan_of("kv_only").model_dump_json())
    (ws / "runs" / "depth").mkdir(parents=True)
    (ws / "runs" / "depth" / "plan.json").write_text(plan_of("eagle3-s1", "eagle3-s2").model_dump_json())

    def merged_plans() -> dict[str, list[tuple[str, str]]]:
        return {p.stem: [(e.name, e.fingerprint) for e in PlanFile.model_validate_json(p.read_text()).trials]
                for p in sorted((staging / "metrics" / "plans").glob("*.json"))}

    merge(ws, results, staging)                                  # depth replaced: its rows are on other data
    assert merged_plans() == {"depth": [("eagle3-s1", "new-eagle3-s1"), ("eagle3-s2", "new-eagle3-s2")],
                              "injection": [("kv_only", "new-kv_only")]}
    same = {"regenerated/sharegpt": "sha256:a"}
    (results / "metrics" / "stepwise" / "depth.json").write_text(json.dumps([{"trial": "eagle3", "data": same}]))
    (ws / "metrics" / "stepwise" / "depth.json").write_text(json.dumps([{"trial": "eagle3-s1", "data": same}]))
    assert merge(ws, results, staging).combined == ["depth"]     # run in parts: the plans combine by name
    assert merged_plans()["depth"] == [("eagle3", "old-eagle3"), ("eagle3-s1", "new-eagle3-s1"),
                                       ("eagle3-s2", "new-eagle3-s2")]
    (ws / "runs" / "depth" / "plan.json").write_text("{}")
    with pytest.raises(StageError, match=r"runs/depth/plan.json: not a plan file"):
        merge(ws, results, staging)


def test_a_study_begun_without_a_finished_trial_leaves_its_committed_rows_and_plan(folders):
    """A part cut off before its first trial finished leaves an empty metrics file and the plan it was executing in
    the workspace: folding it must not drop the study's committed rows nor put that plan over the committed one."""
    from pipeline.plan_file import PlanFile, PlannedTrial

    def plan_of(name):
        return PlanFile(profile="study", trials=[PlannedTrial(
            name=name, study="injection", variant="kv_only", values={}, parent=None, baseline=None, role="trial",
            parts=[], e2e=False, evaluated_on="eval split", config={}, fingerprint=name)])

    results, ws, staging = folders
    (results / "metrics" / "plans").mkdir()
    (results / "metrics" / "plans" / "injection.json").write_text(plan_of("committed").model_dump_json())
    (ws / "metrics" / "stepwise" / "injection.json").write_text("[]")
    (ws / "runs" / "injection").mkdir(parents=True)
    (ws / "runs" / "injection" / "plan.json").write_text(plan_of("begun").model_dump_json())
    merged = merge(ws, results, staging)
    assert merged.from_workspace == ["depth", "scale"] and merged.unfinished == ["injection"]
    assert "injection" in merged.kept
    assert json.loads((staging / "metrics" / "stepwise" / "injection.json").read_text()) == [{"committed": "injection"}]
    plan = PlanFile.model_validate_json((staging / "metrics" / "plans" / "injection.json").read_text())
    assert [t.name for t in plan.trials] == ["committed"]
    for name in ("depth", "scale"):
        (ws / "metrics" / "stepwise" / f"{name}.json").write_text("[]")
    with pytest.raises(StageError, match="no rows"):
        merge(ws, results, staging)
