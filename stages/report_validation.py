"""The report's section for a study that chooses a setting on a validation set, not on the eval split.

A study with `validation: N` (stages/validation.py) evaluates its trials on training conversations beyond their
data scale; its rows name that file (`eval_data`). Its settings are grouped into *arms* (a setting without the
values the study sweeps on top of the setting columns, e.g. `train.lr`); each arm's best value is the one with the
highest validation step MAT (block drafters run free, so step MAT is what the block comparison decides on; for
an autoregressive drafter it is the sum of its teacher-forced step accuracies). The section shows every value's
step MAT and acc_0 with intervals, the best one with its paired difference from the runner-up, and for each arm
the learning rate the eval-split studies trained it at (a row's `lr`), flagged where that is not the best. A
best value at an end of its grid says so: the arm's best may lie beyond it. Where the grid's values are positive, a
parabola in log value through the three values nearest that end says whether the measured trend peaks inside the
grid (the best lies between the edge and its neighbour) or points beyond it (a value beyond is worth trying).
Validation studies are kept out of the findings: their rows are not measured on the eval split.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

from stages.findings import contrast, fmt_ci
from stages.report_cells import cell, md_table
from stages.results import Setting, label, setting_columns

METRIC = "step_mat"


def is_validation(rows: list[dict] | None) -> bool:
    """A study whose rows were all evaluated on a validation set."""
    return bool(rows) and all(r.get("eval_data") for r in rows)


def _arm_key(s: Setting) -> str:
    return json.dumps(s.fields, sort_keys=True, default=str)


def arms(settings: list[Setting]) -> dict[str, list[Setting]]:
    """The settings grouped by everything but the swept extra values, in display order."""
    out: dict[str, list[Setting]] = {}
    for s in settings:
        out.setdefault(_arm_key(s), []).append(s)
    return out


def _arm_label(s: Setting) -> str:
    """The arm's name: the setting's label without the swept values."""
    return label(replace(s, extra={}))


def _swept(s: Setting) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]} {v}" for k, v in s.extra.items()) or "(profile's)"


def ranked(group: list[Setting]) -> list[Setting]:
    """The arm's values with a step MAT, best first."""
    return sorted((s for s in group if math.isfinite(s.value(METRIC))), key=lambda s: -s.value(METRIC))


def trained_lrs(rows_by_study: dict[str, list[dict] | None], arm: Setting) -> dict[float, list[str]]:
    """The learning rates the eval-split studies trained `arm`'s setting at (rows of its setting columns that
    record `lr`), with the studies that did."""
    found: dict[float, list[str]] = {}
    for study, rows in rows_by_study.items():
        for r in rows or []:
            if r.get("eval_data") or r.get("status", "ok") != "ok" or not isinstance(r.get("lr"), (int, float)):
                continue
            if setting_columns(r) == setting_columns(arm.fields):
                found.setdefault(float(r["lr"]), [])
                if study not in found[float(r["lr"])]:
                    found[float(r["lr"])].append(study)
    return found


def _lr_of(s: Setting) -> Any:
    return s.extra.get("train.lr")


def at_grid_edge(top: Setting, group: list[Setting]) -> str:
    """Where the best value lies at an end of a numeric grid of three values or more ("its grid's smallest lr"):
    a value beyond it was not tried, so the best found may not be the arm's best; with the trend there
    (`edge_trend`) where it can be read."""
    ends = []
    for key, v in top.extra.items():
        values = {s.extra.get(key) for s in group}
        if not isinstance(v, (int, float)) or len(values) < 3 \
                or not all(isinstance(x, (int, float)) for x in values):
            continue
        if v in (min(values), max(values)):
            name = key.rsplit('.', 1)[-1]
            text = f"its grid's {'smallest' if v == min(values) else 'largest'} {name}: a value beyond it was not tried"
            points = [(s.extra[key], s.value(METRIC)) for s in group if math.isfinite(s.value(METRIC))]
            if trend := edge_trend(points, v, name):
                text += f" ({trend})"
            ends.append(text)
    return " and ".join(ends)


def edge_trend(points: list[tuple[float, float]], edge: float, name: str = "value") -> str:
    """What a parabola in log10(value) through the three grid values nearest `edge` (the best one, at an end of the
    grid) says of the metric there: a peak between them, inside the grid, or a trend that points beyond the edge.
    Empty where it cannot be read (fewer than three values, a value not positive)."""
    import numpy as np

    pts = sorted(points)
    if len(pts) < 3 or any(x <= 0 for x, _ in pts):
        return ""
    near = pts[:3] if edge == pts[0][0] else pts[-3:]
    x = np.log10([p[0] for p in near])
    a, b, _ = np.polyfit(x, [p[1] for p in near], 2)
    which = "smallest" if edge == pts[0][0] else "largest"
    if a < 0 and min(x) <= -b / (2 * a) <= max(x):
        peak = 10 ** (-b / (2 * a))
        return (f"a parabola in log {name} through the three {which} values peaks at {peak:.2g}, inside the grid: "
                f"the trend does not point beyond it")
    return (f"a parabola in log {name} through the three {which} values rises towards the edge: a value beyond it "
            f"may be better")


def validation_section(name: str, settings: list[Setting], rows: list[dict], others: dict[str, list[dict] | None],
                       level: float) -> list[str]:
    """The validation study `name`: one table row per setting, then per arm its best value and how the eval-split
    studies use it."""
    where = sorted({str(r.get("eval_data")) for r in rows})
    md = [f"## Validation: {name}", "",
          f"Evaluated on `{'`, `'.join(where)}`: training conversations beyond each trial's data scale (none trained "
          "on, no first prompt shared with the scale's training conversations, never the eval split). Each arm's "
          f"best value is the one with the highest step MAT; the findings do not read these rows.", ""]
    table, notes = [], []
    for group in arms(settings).values():
        order = ranked(group) if len(group) > 1 else []    # one value: nothing chosen
        top = order[0] if order else None
        for s in group:
            table.append({"arm": _arm_label(s), "swept": _swept(s), "seeds": s.n, "step MAT": cell(s, METRIC, level),
                          "acc_0": cell(s, "acc_0", level), "best": "**best**" if s is top else ""})
        if top is None:
            continue
        text = f"- **{_arm_label(top)}**: best at {_swept(top)}"
        if len(order) > 1:
            runner = order[1]
            c = contrast(top, runner, METRIC, level)
            tie = ", a tie in step MAT, broken by plan order" if top.value(METRIC) == runner.value(METRIC) else ""
            text += f" (over {_swept(runner)}: {c.diff:+.3f} {fmt_ci(*c.ci, signed=True)}, {c.seeds}{tie})"
        if edge := at_grid_edge(top, group):
            text += f", {edge}"
        used = trained_lrs(others, top)
        lr = _lr_of(top)
        if used and lr is not None:
            parts = [f"{v:g} ({', '.join(st)})" for v, st in sorted(used.items())]
            off = [v for v in used if not math.isclose(v, float(lr), rel_tol=1e-9)]
            text += (f"; the eval-split studies train it at lr {'; '.join(parts)}"
                     + (f": **not the validation's best ({float(lr):g})**" if off else ": the validation's best"))
        elif lr is not None:
            text += "; no eval-split study has rows of this arm with their learning rate yet"
        notes.append(text)
    if table:
        import pandas as pd

        md += [md_table(pd.DataFrame(table)), ""]
    md += notes + ([""] if notes else [])
    return md


__all__ = ["arms", "at_grid_edge", "edge_trend", "ranked", "is_validation", "trained_lrs", "validation_section"]
