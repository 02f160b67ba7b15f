"""Settings a study takes from a validation study, trial by trial (`studies.STUDY.choose: {KEY: VALIDATION}`).

B's fairness (DESIGN §7) trains each block arm at its best learning rate from one small grid, chosen on training
conversations the verdicts are not measured on. The validation study (`validation: N`) trains every arm at every
value of KEY; a trial of the choosing study that the validation study trains too (the same resolved config but
KEY, the seed and the evaluation set) takes the value whose trials reach the highest validation step MAT, pooled
over their seeds as the report's validation section ranks them. A trial it does not train keeps the profile's value.

A choice is *pending* while some value of its arm has no finished trial in the workspace: the trial keeps the
profile's value, `kvshot plan` and the dry run say so, and the sweep stops with a one-line error naming the
validation study's parts to run first (`pipeline.sweep.check_chosen`). The planner applies the choices
(`pipeline.plan.plan(..., rows_of=...)`), so a chosen value is part of the trial's resolved config and fingerprint:
a validation study rerun with another outcome retrains the trials whose value it changes. Trial names stay the
same (the chosen value is not one of the values that name a trial).

A study run in parts over sessions may run its validation study in other workspaces than the study choosing from
it: the validation rows committed in the profile's results folder (`kvshot study-results`) then count as finished
in a workspace that did not run them (`committed_rows`), where they are that workspace's trials: the same config
and code (the row's fingerprint recomputed with the trial's config, the current code and the row's own data
hashes; the feature cache of another CPU differs in bf16 rounding) on the same conversations and validation set.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline.config import Config, ConfigError, lookup, resolve_key, settings_key
from pipeline.fingerprint import TRIAL_SECTIONS
from pipeline.trial import Trial

if TYPE_CHECKING:
    from stages.common import Paths

# Besides the chosen key, what may differ between a trial and the validation trials of its arm.
ARM_FREE = ("train.seed", "eval.data")
METRIC = "step_mat"          # as stages.report_validation ranks a validation study's values

RowsOf = Callable[[list[Trial]], dict[str, dict]]   # finished rows of these trials by name (a workspace's)


@dataclass(frozen=True)
class Choice:
    key: str                          # the config key chosen, e.g. train.lr
    by: str                           # the validation study that chose it
    value: Any | None                 # None: pending (the profile's value stays)
    scores: dict[str, float]          # each value's validation step MAT (by str(value)), once known
    waiting: tuple[str, ...] = ()     # the validation trials of the arm without a finished row

    def text(self) -> str:
        """One line for the console and the plan: the value and what it was chosen over, or what it waits for."""
        if self.value is None:
            return (f"{self.key} pending: {self.by} has not finished {', '.join(self.waiting[:3])}"
                    + (", ..." if len(self.waiting) > 3 else ""))
        best = self.scores[str(self.value)]
        others = ", ".join(f"{s:.3f} at {v}" for v, s in self.scores.items() if v != str(self.value))
        tie = any(s == best for v, s in self.scores.items() if v != str(self.value))
        return (f"{self.key} {self.value} chosen by {self.by} (validation step MAT {best:.3f}"
                + (f"; {others}" if others else "") + ("; a tie, broken by plan order" if tie else "") + ")")


def chosen_keys(cfg: Config, study: str | None) -> dict[str, str]:
    """The study's `choose` (resolved KEY -> validation study), checked against the profile: one-line errors."""
    spec = cfg.studies.get(study) if study else None
    if spec is None or not spec.choose:
        return {}
    order = list(cfg.studies)
    out: dict[str, str] = {}
    for raw, by in spec.choose.items():
        key = resolve_key(raw)
        where = f"studies.{study}.choose.{raw}"
        other = cfg.studies.get(by)
        if other is None:
            raise ConfigError(f"{where}: {by!r} is not a study of this profile ({', '.join(order)})")
        if not other.validation:
            raise ConfigError(f"{where}: study {by} has no `validation`: a value is chosen on a validation set, "
                              "never on the eval split")
        if other.choose:
            raise ConfigError(f"{where}: study {by} chooses values itself; a validation study sweeps them")
        if order.index(by) > order.index(study):
            raise ConfigError(f"{where}: study {by} comes after {study} in `studies`; list it first (DVC runs the "
                              "studies in that order)")
        if key not in _set_keys(other.grid, other.include):
            raise ConfigError(f"{where}: study {by} does not sweep {key} (its grid or include)")
        if key in _set_keys(spec.grid, spec.include):
            raise ConfigError(f"{where}: study {study} sets {key} itself; give it either way, not both")
        out[key] = by
    return out


def _set_keys(grid: dict[str, list[Any]], include: list[dict[str, Any]]) -> set[str]:
    return {resolve_key(k) for k in grid} | {resolve_key(k) for entry in include for k in entry}


def _arm(cfg: Config, key: str) -> str:
    """A trial's config with what may differ within an arm left out."""
    return settings_key(cfg, TRIAL_SECTIONS, (key, *ARM_FREE))


def choose(cfg: Config, key: str, by: str, candidates: list[Trial], rows: dict[str, dict]) -> Choice | None:
    """The value of `key` for a trial of config `cfg` from the validation trials `candidates` (the plan of study
    `by`) and their finished `rows`; None when `by` trains no trial of this arm."""
    arm = _arm(cfg, key)
    mine = [t for t in candidates if _arm(t.config, key) == arm]
    if not mine:
        return None
    waiting = tuple(t.name for t in mine if t.name not in rows)
    if waiting:
        return Choice(key, by, None, {}, waiting)
    from stages.results import settings_of      # pandas: only once a validation study has rows

    values: dict[str, Any] = {}                      # each value by its text, in plan order
    groups: dict[str, list[Trial]] = {}
    for t in mine:
        value = lookup(t.config, key)
        values.setdefault(str(value), value)
        groups.setdefault(str(value), []).append(t)
    scores: dict[str, float] = {}
    for text, members in groups.items():
        settings = settings_of(by, [rows[t.name] for t in members])
        score = settings[0].value(METRIC) if len(settings) == 1 else math.nan
        scores[text] = score if math.isfinite(score) else -math.inf
    best = max(groups, key=scores.get)               # the first in plan order on a tie
    return Choice(key, by, values[best], scores)


def committed_rows(trials: list[Trial], results: Path, paths: "Paths") -> dict[str, dict]:
    """The finished rows of `trials` (fingerprinted in the workspace `paths`) committed in a results folder
    (results/<profile>/metrics/stepwise/<study>.json) that stand for them here: the same config and code, and the
    same conversations and validation set as the workspace's (see the module doc). Trials with a parent never
    match (their parent's fingerprint holds its own feature cache's hash). Reads only."""
    from pipeline.fingerprint import MISSING, fingerprint
    from pipeline.metrics_files import conversations, read_rows
    from stages.code_hash import code_hash

    committed: dict[str, dict[str, dict]] = {}
    sets: dict[str, str] = {}
    found: dict[str, dict] = {}
    for t in trials:
        mine = conversations({"data": t.data_hashes})
        mine.pop("eval", None)      # recomputed below: a validation set is written by a study it may not have run
        if t.depends_on or not mine or MISSING in mine.values():
            continue        # a workspace without its conversations yet cannot tell which rows are its own
        if t.study not in committed:
            path = Path(results) / "metrics" / "stepwise" / f"{t.study}.json"
            rows = read_rows(path) if path.is_file() else []
            committed[t.study] = {r.get("trial"): r for r in rows if isinstance(r, dict) and r.get("status") == "ok"}
        row = committed[t.study].get(t.name)
        if row is None or row.get("code") != code_hash() or not isinstance(row.get("data"), dict):
            continue
        if t.config.eval.data and t.config.eval.data not in sets:
            sets[t.config.eval.data] = _validation_hash(t, paths)
        if t.config.eval.data:
            mine["eval"] = sets[t.config.eval.data]
        if all(row["data"].get(k) == v for k, v in mine.items()) and \
                fingerprint(t.config, row["data"], None, row["code"]) == row.get("fingerprint"):
            found[t.name] = row
    return found


def _validation_hash(trial: Trial, paths: "Paths") -> str:
    """The hash of the file a trial evaluates on as the workspace would write it (the validation study's sweep
    writes it; a workspace that did not run that study has none)."""
    from pipeline.fingerprint import MISSING
    from stages import validation

    spec = validation.parse(trial.config.eval.data)
    if spec is None:
        return (trial.data_hashes or {}).get("eval", MISSING)
    return "sha256:" + hashlib.sha256(validation.content(paths, trial.config.data, *spec).encode()).hexdigest()


__all__ = ["Choice", "RowsOf", "choose", "chosen_keys", "committed_rows"]
