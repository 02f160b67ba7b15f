"""What a study part would take in one go, from the measured times of its trials wherever they ran: the part's
trials replayed as one sweep (`sweep.replay`), each for the wall time its row records. Studies run in pieces (a
seed here, a setting there, trials adopted across studies) so still state the budget of the unit a researcher runs.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import Config
from pipeline.sweep import Trial, check_parts, decodes_any, plan, replay
from stages.train import DrafterParams

# the row fields that tell one drafter setting from another (a row written before a field existed lacks it)
SETTING = ("variant", "depth", "injection", "rope_fix", "init", "context", "no_target", "fc_norm", "norm_output")
WHOLE = "(whole)"   # the one part of a study that names none
_DEFAULTS = DrafterParams().model_dump()


def setting_of(t: Trial) -> dict:
    """The row fields of the trial's setting, and under `values` its swept settings beyond them (say train.epochs
    and train.parent), which a row records among its own `values`."""
    d = t.config.drafter
    extra = {k: v for k, v in t.values.items()
             if k.split(".")[-1] not in (*SETTING, "variant", "scale", "seed")}
    return {**{k: getattr(d, k) for k in SETTING}, "scale": t.config.train.scale, "seed": t.config.train.seed,
            **({"values": extra} if extra else {})}


def row_matches(row: dict, want: dict) -> bool:
    """A row of the trial's setting; a field the row lacks (written before the field existed) held its default."""
    values = row.get("values") if isinstance(row.get("values"), dict) else {}
    if any(values.get(k) != v for k, v in want.get("values", {}).items()):
        return False
    return all(row.get(k) == v or (row.get(k) is None and _DEFAULTS.get(k, object()) == v)
               for k, v in want.items() if k != "values")


def measured_seconds(trials: list[Trial], rows: list[dict]) -> dict[str, float]:
    """Each trial's own training and evaluation time (`wall_s`) from the first row of its setting that has one."""
    took = {}
    for t in trials:
        want = setting_of(t)
        found = [r["wall_s"] for r in rows if isinstance(r, dict) and isinstance(r.get("wall_s"), (int, float))
                 and row_matches(r, want)]
        if found:
            took[t.name] = float(found[0])
    return took


def replayed_parts(cfg: Config, stepwise: Path) -> dict[str, dict]:
    """Per part `STUDY/PART` (a study without parts is one, `STUDY/(whole)`): its trial count, whether the study
    decodes some of them end to end and, when every trial has a measured row in `stepwise/STUDY.json`, the seconds
    its trials take replayed as one sweep, else the trials without one."""
    out: dict[str, dict] = {}
    for study in cfg.studies:
        path = Path(stepwise) / f"{study}.json"
        try:
            rows = json.loads(path.read_text()) if path.is_file() else []
        except json.JSONDecodeError:
            rows = []
        trials = plan(cfg, study=study)
        for name, part in (check_parts(trials, cfg, study) or {WHOLE: trials}).items():
            took = measured_seconds(part, rows if isinstance(rows, list) else [])
            missing = [t.name for t in part if t.name not in took]
            got = {"trials": len(part), "decodes": decodes_any(cfg, study, part)}
            out[f"{study}/{name}"] = {**got, "missing": missing} if missing else \
                {**got, "replayed_s": round(replay(part, took, cfg.ray.max_concurrent), 1)}
    return out
