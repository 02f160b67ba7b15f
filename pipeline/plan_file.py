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
Fingerprints are left out: they hash the data, which exist only in a workspace after the data stages. The budget
and the e2e selection ask the planner; the report reads each row's baseline, which the planner named (rows from
before that are read by the same rules, `stages.baselines`); this file is the serialised form of the plan
(DESIGN §8).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from pipeline.config import Config
from pipeline.parts import check_parts, decodes_any
from pipeline.plan import plan
from pipeline.trial import Trial, is_continued

Role = Literal["trial", "parent", "compute-matched control", "no-target control", "control with context"]


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


class PlanFile(BaseModel):
    profile: str
    trials: list[PlannedTrial]

    def of_study(self, study: str) -> list[PlannedTrial]:
        return [t for t in self.trials if t.study == study]


def role_of(t: Trial, trials: list[Trial]) -> Role:
    """What the trial is in its study's experiment (the module docstring lists the roles)."""
    d = t.config.drafter
    if d.no_target:
        return "control with context" if d.token_context else "no-target control"
    if is_continued(t.config):
        return "compute-matched control"
    if any(o.depends_on == t.name for o in trials):
        return "parent"
    return "trial"


def plan_file(cfg: Config) -> PlanFile:
    """Every study's plan of the profile, with each trial's role, parts and end-to-end decoding."""
    entries = []
    for study in cfg.studies:
        trials = plan(cfg, study=study)
        parts = {name: {m.name for m in members} for name, members in check_parts(trials, cfg, study).items()}
        for t in trials:
            entries.append(PlannedTrial(
                name=t.name, study=study, variant=t.variant, values=t.values, parent=t.depends_on,
                baseline=t.baseline,
                role=role_of(t, trials), parts=[name for name, members in parts.items() if t.name in members],
                e2e=decodes_any(cfg, study, [t]), evaluated_on=t.config.eval.data or "eval split",
                config=t.config.model_dump(mode="json")))
    return PlanFile(profile=cfg.profile, trials=entries)
