"""The CLI contract of DESIGN §10: every command exists, dry-run grids, one-line errors with exit code 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KVSHOT = [str(Path(sys.executable).parent / "kvshot")]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(KVSHOT + list(args), cwd=cwd, capture_output=True, text=True, timeout=300)


def test_help_lists_every_command():
    out = run("--help")
    assert out.returncode == 0
    for command in ("prepare", "regenerate", "features", "train", "evaluate", "e2e", "report", "sweep", "repro",
                    "ui", "keys"):
        assert command in out.stdout
    for command in ("prepare", "sweep", "repro"):
        assert run(command, "--help").returncode == 0


def test_sweep_dry_run_prints_the_resolved_grid():
    out = run("sweep", "depth=1,2,3,4", "variant=kv_only", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "4 trials" in out.stdout
    for depth in (1, 2, 3, 4):
        assert f"kv_only-d{depth}" in out.stdout


def test_sweep_dry_run_of_a_study_includes_its_baseline():
    out = run("sweep", "--study", "depth", "--dry-run", "--profile", "default")
    assert out.returncode == 0, out.stderr
    assert "eagle3" in out.stdout and "kv_only-d4" in out.stdout
    part = run("sweep", "--study", "scale", "--only", "train.scale=large", "--dry-run", "--profile", "study")
    assert part.returncode == 0, part.stderr
    # the large children and their controls, and the small scale's EAGLE-3 they start from (train.parent)
    assert "6 trials" in part.stdout and "hybrid-large-s1-epochs1-from_small_epochs1.5" in part.stdout
    assert "eagle3-small-s1 " in part.stdout and "hybrid-small" not in part.stdout


def test_sweep_dry_run_lists_a_studys_parts_and_runs_one():
    out = run("sweep", "--study", "block", "--dry-run", "--profile", "study")
    assert out.returncode == 0, out.stderr
    for part in ("blocks-seed0", "blocks-seeds12", "ar-seed0", "ar-seed1", "ar-seed2"):
        assert part in out.stdout
    one = run("sweep", "--study", "block", "--part", "ar-seed1", "--dry-run", "--profile", "study")
    assert one.returncode == 0, one.stderr
    assert "5 trials" in one.stdout and "kv_only-d4-s1" in one.stdout and "eagle3-s1-continued" in one.stdout
    assert "block-" not in one.stdout and "parts of" not in one.stdout


@pytest.mark.parametrize("args, needle", [
    (("sweep", "bogus=1", "--dry-run"), "unknown key 'bogus' (`kvshot keys` lists all)"),
    (("train", "dpeth=2"), "unknown key 'dpeth'; did you mean drafter.depth?"),
    (("sweep", "depth=two", "--dry-run"), "drafter.depth"),
    (("sweep", "--study", "depth", "--only", "depth=3", "--dry-run"), "--only drafter.depth=3: no trial of the plan"),
    (("prepare", "--profile", "nope"), "unknown profile 'nope'"),
    (("sweep", "--study", "depth", "--part", "nope", "--dry-run", "--profile", "study"),
     "--part nope: not a part of study depth (its parts: seed0-shallow, seed0-deep, seed1, seed2, seed3, seed4)"),
    (("sweep", "--study", "depth", "--part", "seed0", "--only", "depth=4", "--dry-run", "--profile", "study"),
     "give one (a part is a named --only)"),
    (("e2e", "--part", "seed0", "--profile", "study"), "--part seed0: needs --study"),
    (("repro", "--profile", "study", "--part", "nope"), "--part 'nope': expected STUDY/PART, STUDY or all"),
    (("repro", "--profile", "study", "--part", "depth/nope"), "--part 'depth/nope': not a part of study depth"),
    (("repro", "--profile", "study", "--part", "injection/x"), "it has no parts: --part injection runs it whole"),
    (("repro", "--profile", "study", "--part", "depth/seed0-deep", "--stage", "features"), "without --stage or --force"),
    (("repro", "--dry-run"), "--dry-run: shows where parts stand; give --part (say --part all)"),
    (("train", "variant=medusa"), "drafter.variant"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    out = run(*args)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr
    if "two" in args[1]:
        assert "'two'" in lines[0]


def test_paper_profile_fails_fast_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = run("prepare", "--profile", "paper")
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_e2e_decodes_what_the_plan_marks_each_run_once(tmp_path):
    """The e2e stage decodes the trials a study's plan marks e2e (the plan its sweep wrote, runs/<study>/plan.json),
    each finished run once (a run adopted by another e2e study has its fingerprint)."""
    from pipeline.plan_file import decoded_runs
    from pipeline.config import ConfigError, load_config, with_values
    from pipeline.plan_file import PlanFile, PlannedTrial, study_plan_path
    from stages.common import Paths

    paths = Paths(tmp_path)
    plans: dict[str, list] = {}

    def run(study, name, scale, fp, e2e=True, planned_fp=None):
        d = tmp_path / "runs" / study / name
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
        (d / "fingerprint").write_text(fp + "\n")
        plans.setdefault(study, []).append(PlannedTrial(
            name=name, study=study, variant="eagle3", values={}, parent=None, baseline=None, role="trial", parts=[],
            e2e=e2e, evaluated_on="eval split", config={"train": {"scale": scale}, "drafter": {"variant": "eagle3"}},
            fingerprint=fp if planned_fp is None else planned_fp))
        study_plan_path(paths, study).write_text(PlanFile(profile="smoke", trials=plans[study]).model_dump_json())
        return d

    small, large = run("scale", "eagle3-small", "small", "a", e2e=False), run("scale", "eagle3-large", "large", "b")
    run("block", "eagle3", "large", "b")                       # adopted: the same fingerprint
    own = run("block", "block-kv", "large", "c")
    run("block", "block-hidden", "large", "e", planned_fp="f")  # a stale run: not the trial the plan ran
    cfg = with_values(load_config("smoke"), {"studies": {"scale": {"e2e": {"train.scale": ["large"]}},
                                                         "block": {"e2e": True}, "depth": {}}})
    assert decoded_runs(cfg, paths) == [large, own]
    # a part: `kvshot e2e --only train.scale=small` decodes the marked studies' small drafters alone
    assert decoded_runs(cfg, paths, only={"train.scale": ["small"]}) == []
    assert decoded_runs(cfg, paths, only={"train.scale": ["large"]}) == [large, own]
    # `--study depth`: a study not marked e2e decodes all of its drafters when named
    deep = run("depth", "kv_only-d4", "small", "d", e2e=False)
    assert decoded_runs(cfg, paths, "depth") == [deep]
    assert decoded_runs(cfg, paths, "scale") == [large]     # its plan's marks still apply
    # a profile whose e2e filter no longer says what the sweep's plan marks: an error saying what to run
    changed = with_values(cfg, {"studies": {"scale": {"e2e": {"train.scale": ["small"]}}}})
    with pytest.raises(ConfigError, match=r"studies.scale.e2e: marks other trials than the plan its sweep ran .*"
                                          r"run `kvshot sweep --study scale`"):
        decoded_runs(changed, paths)


def test_e2e_reads_the_profiles_plan_where_no_sweep_wrote_one(tmp_path):
    from pipeline.plan_file import decoded_runs
    from pipeline.config import load_config
    from pipeline.plan_file import plan_file
    from stages.common import Paths

    cfg = load_config("smoke")
    marked = [e for e in plan_file(cfg).trials if e.e2e]
    assert marked
    for i, e in enumerate(marked):
        d = tmp_path / "runs" / e.study / e.name
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
        (d / "fingerprint").write_text(f"fp{i}\n")
    other = next(e for e in plan_file(cfg).trials if not e.e2e and e.study in {m.study for m in marked})
    (tmp_path / "runs" / other.study / other.name).mkdir(parents=True)
    (tmp_path / "runs" / other.study / other.name / "model.safetensors").write_bytes(b"x")
    got = decoded_runs(cfg, Paths(tmp_path))
    assert [(d.parent.name, d.name) for d in got] == [(e.study, e.name) for e in marked]


def test_e2e_names_a_study_the_profile_lacks(tmp_path):
    out = run("e2e", "--profile", "smoke", "--study", "nope")
    assert out.returncode != 0 and "--study nope: not a study of this profile" in out.stderr
    out = run("e2e", "--profile", "smoke", "--root", str(tmp_path), "--only", "train.seed=7")
    assert out.returncode != 0 and "--only train.seed=7: no trained drafter of the studies marked e2e" in out.stderr


def test_keys_lists_every_key_with_its_value():
    from pipeline.config import LEAF_KEYS

    out = run("keys", "--profile", "smoke")
    assert out.returncode == 0, out.stderr
    listed = [ln.split()[0] for ln in out.stdout.splitlines() if ln.strip()]
    assert listed == LEAF_KEYS
    assert any(ln.split() == ["drafter.depth", "1"] for ln in out.stdout.splitlines())
    only = run("keys", "depth", "--profile", "smoke")
    assert only.returncode == 0 and [ln.split()[0] for ln in only.stdout.splitlines()] == ["drafter.depth"]


def test_a_profile_given_as_a_yaml_path_gets_a_workspace_named_after_the_file(tmp_path, monkeypatch):
    from pipeline.dvc_workspace import workspace

    monkeypatch.setenv("KVSHOT_WORKSPACES", str(tmp_path / "ws"))
    mine = tmp_path / "profiles" / "smoke-fp32.yaml"
    assert workspace(str(mine)) == tmp_path / "ws" / "smoke-fp32"
    assert workspace("smoke") == tmp_path / "ws" / "smoke"


def test_a_profile_workspace_links_the_code_dvc_yaml_lists(tmp_path, monkeypatch):
    """dvc.yaml names each stage's code by project-relative paths (stages/train.py, models): a profile's workspace
    links models/ and stages/ and keeps compiled caches out of DVC's folder hashes; a second call changes nothing,
    and a folder of the workspace's own in their place is a one-line error, not replaced."""
    from pipeline.config import ConfigError, load_config
    from pipeline.dvc_workspace import prepare_workspace, share_code

    monkeypatch.setenv("KVSHOT_WORKSPACES", str(tmp_path))
    cfg = load_config("smoke", [])
    prepare_workspace(cfg, "smoke")
    prepare_workspace(cfg, "smoke")
    ws = tmp_path / "smoke"
    for name in ("models", "stages"):
        assert (ws / name).is_symlink() and (ws / name).resolve() == ROOT / name
    assert (ws / "stages" / "train.py").is_file()
    assert (ws / ".dvcignore").read_text().splitlines().count("__pycache__/") == 1     # dvc init wrote its own header
    (tmp_path / "other" / "models").mkdir(parents=True)
    with pytest.raises(ConfigError, match="models/ is a folder of its own"):
        share_code(tmp_path / "other")


def test_repro_dry_run_says_where_each_part_stands(tmp_path):
    """`kvshot repro --part all --dry-run` in a workspace not made yet: every part of every study, in the order
    they run, none begun; creates nothing. (Parts done and begun: tests/test_repro.py.)"""
    import os

    env = dict(os.environ, KVSHOT_WORKSPACES=str(tmp_path))
    out = subprocess.run(KVSHOT + ["repro", "--profile", "smoke", "--part", "all", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "part injection/(whole): not begun (4 trials)", "part depth/(whole): not begun (3 trials)",
        "part hybrid/(whole): not begun (3 trials)", "part scale/(whole): not begun (3 trials, decoded)",
        "part block/blocks: not begun (2 trials, decoded)", "part block/autoregressive: not begun (2 trials)"]
    assert list(tmp_path.iterdir()) == []


def test_a_part_line_counts_trials_adopted_from_another_study_as_finished_not_begun():
    """A part's trial finished in another study (adopted, no run directory here) is finished, and nothing in
    progress is made of it; trials begun here and not finished are 'more begun'."""
    from pipeline.repro_parts import PartState

    state = PartState("block", "ar-seed1", [object()] * 5, False, finished=2, begun=1, in_progress=0, done=None,
                      waits=None)
    assert state.line() == "part block/ar-seed1: 2 of 5 trials finished"
    state.in_progress, state.decode = 2, True
    assert state.line() == "part block/ar-seed1: 2 of 5 trials finished, 2 more begun; then decoded"
    state.finished = state.in_progress = 0
    assert state.line() == "part block/ar-seed1: not begun (5 trials, decoded)"
    state.left_s, state.by_earlier = 5462.0, 2      # at the paces measured so far; two trials of earlier parts
    assert state.line() == ("part block/ar-seed1: not begun (5 trials, decoded); about 1:31:02 of training left at "
                            "the paces measured so far; 2 trained by the parts before it")
    state.left_s = state.by_earlier = 0
    state.done = {"wall_s": 2377.1, "date": "2026-12-07", "begun_before": 3}      # resumed: not the part's time
    assert state.line() == ("part block/ar-seed1: done in this workspace (5 trials finished, decoded; 39.6 min on "
                            "2026-12-07 in its last sitting, 3 of its trials begun before)")
    state.done = {"wall_s": 2377.1, "date": "2026-12-07"}
    assert state.line().endswith("; 39.6 min in one go on 2026-12-07)")


def test_a_fast_dev_run_has_the_profiles_parts_in_a_workspace_of_its_own(tmp_path):
    """`kvshot repro --fast-dev-run`: the study profile's every part, with the same trials, at the smoke sizes (the
    plan's equality: tests/test_profiles.py), in the workspace study-fast-dev-run; a dry run creates nothing."""
    import os

    # no committed results: a waiting part's line would name the study's committed validation rows (the fast dev
    # run has none)
    env = dict(os.environ, KVSHOT_WORKSPACES=str(tmp_path), KVSHOT_RESULTS=str(tmp_path / "no-results"))

    def dry(*flags: str) -> list[str]:
        out = subprocess.run(KVSHOT + ["repro", "--profile", "study", "--part", "all", "--dry-run", *flags], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    lines = dry("--fast-dev-run")
    assert len(lines) == 24 and lines == dry()
    assert list(tmp_path.iterdir()) == []
    out = subprocess.run(KVSHOT + ["repro", "--help"], capture_output=True, text=True, timeout=300)
    assert "--fast-dev-run" in out.stdout
