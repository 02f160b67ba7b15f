"""`kvshot repro`: run the DVC DAG for a profile.

The default profile runs in the project root against the committed params.yaml. Any other profile runs in its
own workspace `scratch/workspaces/<profile>/`: a DVC project (no SCM) holding a copy of dvc.yaml and a params.yaml
that is the fully resolved profile, so DVC tracks that profile's params and each profile keeps its own data,
runs and dvc.lock without touching the default's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pipeline.config import ROOT, Config, ConfigError
from pipeline.parts import WHOLE
from pipeline.stopping import run_child

CODE_DIRS = ("models", "stages")   # the folders dvc.yaml names the stages' code in, relative to the project


def dvc_env(root: Path) -> dict[str, str]:
    """Environment for DVC and the stage commands it spawns (kvshot on PATH, nothing phoning home)."""
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env.setdefault("DVC_SITE_CACHE_DIR", str(root / "scratch" / "dvc-site"))
    env.setdefault("KVSHOT_MODEL_CACHE", str(ROOT / "scratch" / "models"))
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("MPLBACKEND", "Agg")
    return env


def workspace(profile: str) -> Path:
    """scratch/workspaces/<profile>, or under KVSHOT_WORKSPACES when set (tests, shared storage); a profile given
    as a YAML path names its workspace by the file's name without the suffix."""
    base = os.environ.get("KVSHOT_WORKSPACES")
    name = Path(profile).stem if Path(profile).suffix in (".yaml", ".yml") else profile
    return (Path(base) if base else ROOT / "scratch" / "workspaces") / name


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def prepare_workspace(cfg: Config, profile: str, committed_answers: bool = True,
                      echo=lambda line: None) -> Path:
    """Create or refresh the workspace of a non-default profile; returns its root. With `committed_answers`, a
    workspace that has not regenerated its conversations yet starts from the target's answers committed in the
    profile's results folder (`pipeline.conversations`), so its parts train on the committed rows' conversations."""
    ws = workspace(profile)
    ws.mkdir(parents=True, exist_ok=True)
    env = dvc_env(ws)
    if not (ws / ".dvc").is_dir():
        subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=ws, env=env, check=True)
        subprocess.run(["dvc", "config", "core.analytics", "false"], cwd=ws, env=env, check=True)
    _write_if_changed(ws / "dvc.yaml", (ROOT / "dvc.yaml").read_text())
    _write_if_changed(ws / "params.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    share_code(ws)
    if committed_answers:
        from pipeline.conversations import FOLDER, results_folder, seed

        for source in seed(results_folder(cfg), ws):
            echo(f"data/regenerated/{source}.jsonl: the target's answers from {results_folder(cfg) / FOLDER} (the "
                 "regenerate stage reuses each one whose settings and input are unchanged)")
    return ws


def share_code(ws: Path) -> None:
    """Link the project's code folders into a workspace: dvc.yaml lists each stage's code among its deps by paths
    relative to the project (stages/train.py, models), which must resolve in the workspace too; and leave compiled
    caches out of a folder dep's hash (.dvcignore), so importing the code does not change it."""
    for name in CODE_DIRS:
        link, target = ws / name, ROOT / name
        if link.is_symlink() and Path(os.readlink(link)) != target:
            link.unlink()                  # the project moved: point at where it is now
        if not link.exists() and not link.is_symlink():
            link.symlink_to(target, target_is_directory=True)
        elif not link.is_symlink():
            raise ConfigError(f"workspace {ws}: {name}/ is a folder of its own; remove it (the workspace links "
                              f"the project's {name}/ there)")
    ignore = ws / ".dvcignore"
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    if "__pycache__/" not in lines:
        ignore.write_text("\n".join(lines + ["__pycache__/"]) + "\n")


def _ready(cfg: Config, profile: str, committed_answers: bool, echo) -> tuple[Path, dict[str, str]]:
    """The profile's root (its workspace made or refreshed) and the environment DVC runs in there."""
    root = ROOT if profile == "default" else prepare_workspace(cfg, profile, committed_answers, echo)
    (root / "scratch").mkdir(parents=True, exist_ok=True)
    env = dvc_env(root)
    if shutil.which("dvc", path=env["PATH"]) is None:
        raise FileNotFoundError("dvc is not installed in this environment (run `make setup`)")
    return root, env


def repro(cfg: Config, profile: str, force: bool = False, stages: list[str] | None = None,
          echo=lambda line: None, committed_answers: bool = True) -> int:
    """Run `dvc repro` for the profile (only `stages` and what they depend on, when given); returns DVC's exit
    code. A study that takes values from a validation study (`choose`) and ran on other values than that study's
    rows choose now is run again (`dvc repro --force --single-item study@S`, then `dvc repro` for what follows it):
    DVC sees no dependency between two studies."""
    root, env = _ready(cfg, profile, committed_answers, echo)
    cmd = ["dvc", "repro"] + (["--force"] if force else []) + list(stages or [])
    code = run_child(cmd, cwd=root, env=env)
    if code or stages or not any(s.choose for s in cfg.studies.values()):
        return code
    from pipeline.sweep import stale_choices
    from stages.common import Paths

    stale = stale_choices(cfg, Paths(root))
    for study, changes in stale.items():
        echo(f"study {study} ran on other chosen values than its validation study's rows choose now "
             f"({'; '.join(changes[:3])}{'; ...' if len(changes) > 3 else ''}): running it again")
        code = run_child(["dvc", "repro", "--force", "--single-item", f"study@{study}"], cwd=root, env=env)
        if code:
            return code
    return run_child(["dvc", "repro"], cwd=root, env=env) if stale else 0


DATA_STAGES = "features"   # the last data stage: `dvc repro features` runs prepare, regenerate and features


def repro_data_stages(cfg: Config, profile: str, echo=lambda line: None, committed_answers: bool = True) -> int:
    """The data stages alone (`dvc repro features`: prepare, regenerate, features) in the profile's workspace;
    returns DVC's exit code."""
    root, env = _ready(cfg, profile, committed_answers, echo)
    return run_child(["dvc", "repro", DATA_STAGES], cwd=root, env=env)


def repro_part(cfg: Config, profile: str, study: str, part: str, decode: bool,
               echo=lambda line: None, begun_before: int = 0, committed_answers: bool = True) -> int:
    """One part of a study from its workspace, in one go: the data stages through DVC (nothing when they are up to
    date), then `kvshot sweep --study STUDY --part PART` (a study without parts: its one part `(whole)`, the whole
    study) and, when the part holds drafters the study decodes, `kvshot e2e` of those. The whole is timed into
    the workspace's parts record (scratch/parts.json, which the report reads), with the data stages' share,
    whether the workspace was fresh and `begun_before`, how many of the part's trials had begun before this run
    (a run resumed after an interruption: its time is then not the whole part's); each command records its own
    stage time too. Returns the first nonzero exit code, else 0."""
    from pipeline.provenance import record_part

    root, env = _ready(cfg, profile, committed_answers, echo)
    fresh = not (root / "data" / "features").exists()
    kvshot = [sys.executable, "-m", "pipeline.cli"]
    which = ["--study", study] + (["--part", part] if part != WHOLE else [])
    steps = [("data stages", ["dvc", "repro", DATA_STAGES]), ("sweep", kvshot + ["sweep", *which])]
    if decode:
        steps.append(("e2e", kvshot + ["e2e", *which]))
    start = time.perf_counter()
    data_s = 0.0
    for what, cmd in steps:
        echo(f"part {study}/{part}: {what}")
        t0 = time.perf_counter()
        code = run_child(cmd, cwd=root, env=env)
        if what == "data stages":
            data_s = time.perf_counter() - t0
        if code:
            return code
    record_part(root, f"{study}/{part}", time.perf_counter() - start, data_s, fresh, begun_before)
    return 0


def done_part(root: Path, study: str, part: str, trials: list, finished: dict, decode: bool) -> dict | None:
    """The record of a part's latest run in one go when nothing of it is left to do: every trial of it finished
    in the workspace (`finished`: rows by trial name, found by fingerprint, so by the current code and data) and,
    when it decodes, its decoding done by the current decoding code. Else None: the part runs (again)."""
    from pipeline.provenance import part_record
    from stages.code_hash import DECODE_CODE, code_hash

    record = part_record(root, f"{study}/{part}")
    if record is None or any(t.name not in finished for t in trials):
        return None
    if decode and record.get("decode_code") != code_hash(patterns=DECODE_CODE):
        return None
    return record
