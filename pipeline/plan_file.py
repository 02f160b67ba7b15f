"""The plan written down once: every trial of a profile's studies, typed and serialised (`kvshot plan`).

One entry per trial and study: its name, the values that set it apart, the resolved config, the trial it is
initialised from, the trial it is compared with (its baseline, which its metrics row names too), its role in the
experiment, the parts of the study that run it, whether the study decodes it end to end and what it is evaluated
on (the eval split, or a validation set: stages/validation.py). The roles are what the planner knows and a table
of rows does not:

  * `trial`: a drafter the study compares;
  * `parent`: an EAGLE-3 that checkpoint-initialised drafters load (it is also compared as itself);
  * `compute-matched control`: EAGLE-3 continued for the same schedule as the checkpoint-initialised drafters;
  * `no-target control`: a drafter of its variant's shape that reads no target information;
  * `control with context`: the no-target control that reads the prefix's own token embeddings.

A trial planned by several studies appears once per study (it is trained once and adopted by fingerprint).

Two forms. `kvshot plan` writes the profile's plan before anything ran, without fingerprints (they hash the data,
which exist only in a workspace after the data stages). A sweep writes the plan it executes into the workspace,
`runs/<study>/plan.json` (`write_study_plan`), with each trial's fingerprint, merging parts run one after another
by trial name: what the e2e stage decodes is read from it (`decoded_runs`), so a study swept with axes on top of
the profile's (`kvshot sweep --study S KEY=V`) is decoded as it ran, and `kvshot study-results` keeps it beside the
committed metrics (metrics/plans/<study>.json). Metrics rows and MLflow runs carry each trial's
baseline and role, which the planner named; the report reads them from the rows (rows from before are read by
the same rules, `stages.baselines`). The budget asks the planner: it runs before any workspace exists (DESIGN §8).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from pipeline.config import Config, ConfigError
from pipeline.parts import check_parts, config_matches, decodes_any
from pipeline.plan import Role, plan
from pipeline.trial import Trial
from stages.common import Paths, write_text_atomic

PLAN_FILE = "plan.json"     # in runs/<study>/, written by the sweep that runs the study


class PlannedTrial(BaseModel):
    name: str
    study: str
    variant: str
    values: dict[str, Any]
    parent: str | None
    baseline: str | None            # the trial it is compared with (`pipeline.plan.baseline_of`)
    role: Role
    parts: list[str]
    e2e: bool
    evaluated_on: str               # "eval split", or the validation set a study chooses a setting on
    config: dict[str, Any]
    fingerprint: str = ""           # in a workspace's plan (`write_study_plan`); not known before the data stages
    chosen: dict[str, str] = {}     # KEY -> how its value was chosen by a validation study (`pipeline.choices`)


class PlanFile(BaseModel):
    profile: str
    trials: list[PlannedTrial]

    def of_study(self, study: str) -> list[PlannedTrial]:
        return [t for t in self.trials if t.study == study]


def planned(t: Trial, cfg: Config, parts: dict[str, list[Trial]]) -> PlannedTrial:
    """A trial of the plan as written down; `parts`: its study's parts with their trials (`check_parts`)."""
    return PlannedTrial(
        name=t.name, study=t.study, variant=t.variant, values=t.values, parent=t.depends_on, baseline=t.baseline,
        role=t.role, parts=[name for name, members in parts.items() if any(m.name == t.name for m in members)],
        e2e=t.study in cfg.studies and decodes_any(cfg, t.study, [t]),
        evaluated_on=t.config.eval.data or "eval split", config=t.config.model_dump(mode="json"),
        fingerprint=t.fingerprint, chosen={c.key: c.text() for c in t.choices})


def plan_file(cfg: Config) -> PlanFile:
    """Every study's plan of the profile, with each trial's role, parts and end-to-end decoding."""
    entries = []
    for study in cfg.studies:
        trials = plan(cfg, study=study)
        parts = check_parts(trials, cfg, study)
        entries += [planned(t, cfg, parts) for t in trials]
    return PlanFile(profile=cfg.profile, trials=entries)


def study_plan_path(paths: Paths, study: str) -> Path:
    return paths.root / "runs" / study / PLAN_FILE


def read_plan(path: Path, hint: str = "") -> PlanFile:
    """A plan file; a damaged one is a one-line error naming it (`hint`: what to do about it)."""
    try:
        return PlanFile.model_validate_json(path.read_text())
    except ValidationError as exc:
        raise ConfigError(f"{path}: not a plan file ({exc.error_count()} errors){hint}") from None


def read_study_plan(paths: Paths, study: str) -> list[PlannedTrial] | None:
    """The plan a sweep of `study` wrote into the workspace; None before one ran."""
    path = study_plan_path(paths, study)
    if not path.is_file():
        return None
    return read_plan(path, "; remove it and run the study's sweeps again: they write it anew, adopting the "
                           "finished trials").trials


def write_study_plan(trials: list[Trial], paths: Paths, parts: dict[str, list[Trial]] | None = None) -> Path:
    """Write the plan a sweep executes (its trials, fingerprinted; `parts`: the study's parts with their trials,
    `check_parts`) into runs/<study>/plan.json. The entries of the study's other trials stay (a study run in parts
    gains one part's trials at a time); a trial run again replaces its entry in place."""
    cfg: Config = trials[0].config
    study = trials[0].study
    mine = {t.name: planned(t, cfg, parts or {}) for t in trials}
    before = read_study_plan(paths, study) or []
    entries = [mine.pop(e.name, e) for e in before] + list(mine.values())
    path = study_plan_path(paths, study)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, PlanFile(profile=cfg.profile, trials=entries).model_dump_json(indent=1) + "\n")
    return path


def decoded_runs(cfg: Config, paths: Paths, only_study: str | None = None,
                 only: dict | None = None) -> list[Path]:
    """The drafters the plan decodes end to end: of every study marked e2e, the trials its plan marks `e2e` (the
    plan its sweep wrote into the workspace, runs/<study>/plan.json; the profile's plan where no sweep wrote one),
    each finished run once (a run adopted by several studies has one fingerprint), plus any checkpoints named in
    e2e.checkpoints. `only_study`: that study's drafters alone (all of them when it is not marked e2e); `only`:
    those of them with these settings (resolved KEY -> values). A profile whose `e2e` filter marks other trials
    than the written plan does (edited since the sweep ran) is a one-line error saying to run the sweep again."""
    profile_plan = None
    dirs, seen = [], set()
    for name, study in cfg.studies.items():
        if (only_study is not None and name != only_study) or (only_study is None and not study.e2e):
            continue
        entries = read_study_plan(paths, name)
        if entries is None:
            profile_plan = profile_plan or plan_file(cfg)
            entries = profile_plan.of_study(name)
        stale = [e.name for e in entries
                 if study.e2e and e.e2e != (study.e2e is True or config_matches(e.config, study.e2e))]
        if stale:
            listed = ", ".join(stale[:3]) + (", ..." if len(stale) > 3 else "")
            raise ConfigError(f"studies.{name}.e2e: marks other trials than the plan its sweep ran "
                              f"({study_plan_path(paths, name)}: {listed}); run `kvshot sweep --study {name}` to "
                              "write the plan anew (it adopts the finished trials)")
        for e in entries:
            run = paths.root / "runs" / name / e.name
            if not (run / "model.safetensors").is_file() or (study.e2e and not e.e2e):
                continue
            if only and not config_matches(e.config, only):
                continue
            fp = (run / "fingerprint").read_text().strip() if (run / "fingerprint").is_file() else str(run)
            if e.fingerprint and fp != e.fingerprint:
                continue                       # not the trial the plan ran (its sweep has not run it again)
            if fp not in seen:
                seen.add(fp)
                dirs.append(run)
    return dirs + ([] if only_study or only else [Path(p) for p in cfg.e2e.checkpoints])
