"""What a study part would take in one go, from the measured times of its trials wherever they ran: the part's
trials replayed as one sweep (`pipeline.cost.replay`), each for the wall time its row records. Studies run in
pieces (a seed here, a setting there, trials adopted across studies) so still state the budget of the unit a
researcher runs.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import Config
from pipeline.cost import replay
from pipeline.parts import WHOLE, check_parts, decodes_any
from pipeline.plan import plan
from pipeline.trial import Trial, base_row
from stages.evaluate import BLOCK_FIELDS, SETTING_FIELDS
from stages.results import SETTING_KEYS, setting_columns

# drafter options that add no layer: a setting with them on is paced like its plain shape when it has no rows yet
_SAME_SHAPE = ("no_target", "token_context", "fc_norm", "norm_output")


def _row_of(t: Trial) -> dict:
    """The setting columns of the row the trial's evaluation will write (`base_row`, and the drafter options
    `stages.evaluate.row_for` adds: each option when on, a block drafter's own fields), read as the report reads
    every row (`stages.results.setting_columns`): a column a row lacks holds its default on both sides."""
    d = t.config.drafter
    return setting_columns({**base_row(t), **{k: True for k in SETTING_FIELDS if getattr(d, k)},
                            **({k: getattr(d, k) for k in BLOCK_FIELDS} if d.variant == "block" else {})})


def setting_of(t: Trial) -> dict:
    """The setting columns of the trial's row, its seed, and under `values` its swept settings beyond them (say
    train.epochs and train.parent), which a row records among its own `values`."""
    extra = {k: v for k, v in t.values.items() if k.split(".")[-1] not in (*SETTING_KEYS, "seed")}
    return {**_row_of(t), "seed": t.config.train.seed, **({"values": extra} if extra else {})}


def row_matches(row: dict, want: dict) -> bool:
    """A row of the trial's setting (`setting_of`): the same setting columns and seed, and the trial's swept values
    beyond them among the row's `values`."""
    values = row.get("values") if isinstance(row.get("values"), dict) else {}
    if any(values.get(k) != v for k, v in want.get("values", {}).items()):
        return False
    return {**setting_columns(row), "seed": row.get("seed")} == {k: v for k, v in want.items() if k != "values"}


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


def _drafter_setting(columns: dict) -> tuple:
    """A drafter's setting at any scale: its setting columns but the scale."""
    return tuple(columns[k] for k in SETTING_KEYS if k != "scale")


def _steps_per_epoch(cfg: Config, rows: list[dict]) -> dict[str, float]:
    """Optimizer steps per epoch at each data scale, from the rows' training steps (a row's epochs are its
    `values`' train.epochs, else the profile's); a scale without rows scaled from one with them by its size."""
    seen: dict[str, list[float]] = {}
    for r in rows:
        values = r.get("values") if isinstance(r.get("values"), dict) else {}
        epochs = values.get("train.epochs", cfg.train.epochs)
        if isinstance(r.get("train_steps"), int) and r["train_steps"] and r.get("scale") in cfg.data.scales \
                and "train.max_steps" not in values:
            seen.setdefault(r["scale"], []).append(r["train_steps"] / float(epochs))
    per = {scale: max(v) for scale, v in seen.items()}
    if per:
        ref = next(iter(per))
        for scale, size in cfg.data.scales.items():
            per.setdefault(scale, per[ref] * size / cfg.data.scales[ref])
    return per


def _plain_shape(want: dict) -> tuple:
    """A setting read as the plain drafter of its shape (`_SAME_SHAPE` off): a no-target control without rows of its
    own is paced like the drafter that reads the target (same layers and attention widths; it attends to its own
    keys, not the target's), EAGLE-3.1 like EAGLE-3 (its two norms cost little beside its layer)."""
    return _drafter_setting({**want, **{k: False for k in _SAME_SHAPE}})


def _likeness(row: dict, machine: str | None, own_threads: int) -> int:
    """How alike a row's pace was measured to a trial's of this sweep: 2 on this machine at the trial's own share of
    threads (a trial beside others), 1 on this machine at more threads (alone, every CPU lent to it, faster a step),
    0 elsewhere or unrecorded (rows before `pipeline.trial.ran_on`)."""
    if machine is None or row.get("machine") != machine:
        return 0
    threads = row.get("threads")
    return 2 if isinstance(threads, (int, float)) and threads <= own_threads + 0.25 else 1


def estimated_seconds(trials: list[Trial], rows: list[dict], cfg: Config, machine: str | None = None) \
        -> dict[str, float]:
    """A trial without a row of its own, estimated from paces: its optimizer steps (its epochs at its scale's steps
    per epoch, `_steps_per_epoch`) times the seconds per step (`wall_s` / `train_steps`, evaluation included) of
    the rows of its drafter setting at any scale, seed or schedule (a no-target control without rows: those of the
    plain drafter of its shape, `_plain_shape`). Of those rows only the most alike are averaged
    (`_likeness`: measured on `machine` at the trial's own share of threads before alone on it, before elsewhere),
    as a step's time differs between machines (several times over without native bf16) and between a trial
    alone and two side by side.
    Trials with no such row are left out."""
    import math

    per_epoch = _steps_per_epoch(cfg, rows)
    own = max(1, int(cfg.ray.cpus_per_trial))
    paces: dict[tuple, list[tuple[int, float]]] = {}
    for r in rows:
        if isinstance(r.get("wall_s"), (int, float)) and isinstance(r.get("train_steps"), int) and r["train_steps"]:
            paces.setdefault(_drafter_setting(setting_columns(r)), []).append(
                (_likeness(r, machine, own), r["wall_s"] / r["train_steps"]))
    pace = {k: [p for like, p in v if like == max(like for like, _ in v)] for k, v in paces.items()}
    out = {}
    for t in trials:
        tp, want = t.config.train, setting_of(t)
        s_per_step = pace.get(_drafter_setting(want)) or pace.get(_plain_shape(want))
        steps = tp.max_steps or (math.ceil(tp.epochs * per_epoch[tp.scale]) if tp.scale in per_epoch else None)
        if s_per_step and steps:
            out[t.name] = steps * sum(s_per_step) / len(s_per_step)
    return out


def _rows(path: Path) -> list[dict]:
    """A study's metrics rows ([] when the file is missing or not a JSON list)."""
    try:
        rows = json.loads(path.read_text()) if path.is_file() else []
    except json.JSONDecodeError:
        rows = []
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def training_left_s(cfg: Config, trials: list[Trial], rows: list[dict], machine: str | None = None) -> float | None:
    """Seconds `trials` (a part's trials not finished yet) would train in one sweep (`replay`), each estimated from
    the paces of `rows` (`estimated_seconds`, measured on `machine` first): 0 when none is left, None when one of
    them has no pace to go by. A trial begun before is counted whole (its checkpoint saves part of that)."""
    if not trials:
        return 0.0
    guess = estimated_seconds(trials, rows, cfg, machine)
    return replay(trials, guess, cfg.ray.max_concurrent) if len(guess) == len(trials) else None


def rows_in(*stepwise: Path) -> list[dict]:
    """Every row of the studies' metrics files (`STUDY.json`) in these folders (a missing folder holds none)."""
    return [r for folder in stepwise if Path(folder).is_dir() for f in sorted(Path(folder).glob("*.json"))
            for r in _rows(f)]


def replayed_parts(cfg: Config, stepwise: Path, machine: str | None = None) -> dict[str, dict]:
    """Per part `STUDY/PART` (a study without parts is one, `STUDY/(whole)`): its trial count, whether the study
    decodes some of them end to end and, when every trial has a measured row in `stepwise/STUDY.json` (or one of its
    setting and seed in another study's file, the trial that study trained), the seconds
    its trials take replayed as one sweep. Else the trials without one (`missing`) and, when each of them can be
    estimated from the paces of its drafter setting's rows (`estimated_seconds`), the replay with those estimates
    (`estimated_s`, naming the estimated trials in `estimated`). Beside either, `unwaved_s`: the same replay with
    each child started as soon as its parent has finished (`replay(waves=False)`), what the waves cost. Estimates
    prefer paces measured on `machine` (`estimated_seconds`): the one the parts will run on, when known."""
    out: dict[str, dict] = {}
    by_study = {study: _rows(Path(stepwise) / f"{study}.json") for study in cfg.studies}
    everywhere = [r for rows in by_study.values() for r in rows]
    for study, rows in by_study.items():
        trials = plan(cfg, study=study)
        for name, part in (check_parts(trials, cfg, study) or {WHOLE: trials}).items():
            # a trial another study trained (the same setting and seed: adopted by fingerprint) took what it took there
            took = {**measured_seconds(part, everywhere), **measured_seconds(part, rows)}
            missing = [t.name for t in part if t.name not in took]
            got = {"trials": len(part), "decodes": decodes_any(cfg, study, part)}
            if not missing:
                out[f"{study}/{name}"] = {**got, "replayed_s": round(replay(part, took, cfg.ray.max_concurrent), 1),
                                          "unwaved_s": round(replay(part, took, cfg.ray.max_concurrent, False), 1)}
                continue
            got["missing"] = missing
            guess = estimated_seconds([t for t in part if t.name in missing], rows, cfg, machine)
            # a study without rows of a setting (one that only sweeps, say, the learning rate of another study's
            # drafters) is paced by the rows of that setting in the profile's other studies
            guess.update(estimated_seconds([t for t in part if t.name in missing and t.name not in guess],
                                           everywhere, cfg, machine))
            if len(guess) == len(missing):
                got.update(estimated=missing,
                           estimated_s=round(replay(part, {**took, **guess}, cfg.ray.max_concurrent), 1),
                           unwaved_s=round(replay(part, {**took, **guess}, cfg.ray.max_concurrent, False), 1))
            out[f"{study}/{name}"] = got
    return out
