"""How the report writes one value: ours as `value [95% interval]`, a tree shape as `(3, 2, 5)`, and the paper's
number beside ours (with the paper row a setting of ours is set beside). Shared by the report's tables
(`stages.report`) and its figures (`stages.report_figures`), which is why it sits below both."""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

from stages.findings import fmt_ci
from stages.results import Setting
from stages.sections import CONTINUED

PAPER_LABEL = "paper (Qwen3-8B)"


def md_table(frame: pd.DataFrame) -> str:
    return frame.to_markdown(index=False, disable_numparse=True)


def cell(s: Setting, name: str, level: float, pct: bool = False) -> str:
    """`value [lo, hi]` of one metric of a setting (percent for retentions)."""
    v, (lo, hi) = s.value(name), s.ci(name, level)
    if not math.isfinite(v):
        return "–"
    if pct:
        ci = f"[{lo * 100:.1f}, {hi * 100:.1f}]" if math.isfinite(lo) else "[–]"
        return f"{v * 100:.1f}% {ci}"
    return f"{v:.3f} {fmt_ci(lo, hi)}"


def tree_text(t: Any) -> str:
    """(3, 2, 5); one tree per decoded seed when their tuned trees differ: (2, 3, 5) / (4, 2, 8)."""
    if isinstance(t, list) and t and all(isinstance(x, list) for x in t):
        return " / ".join(tree_text(x) for x in t)
    return "(" + ", ".join(str(x) for x in t) + ")" if isinstance(t, list) else "n/a"


def paper_row(paper: dict | None, fields: dict) -> dict | None:
    """The paper's row for a setting: every key its `match` names equal ours, and none of our controls or
    options it does not name (a plain "eagle3" row is not EAGLE-3 continued or EAGLE-3.1)."""
    for row in (paper or {}).get("rows", []):
        match = row.get("match")
        if not match or not all(fields.get(k) == v for k, v in match.items()):
            continue
        if any(fields.get(k) and k not in match for k in ("no_target", "fc_norm", "norm_output")):
            continue
        if fields.get("init") == CONTINUED and "init" not in match:
            continue
        return row
    return None


def paper_cell(row: dict | None, name: str) -> str:
    """One of the paper's numbers as the paper prints it: retention in percent, α_k to 3 digits, the rest to 2."""
    if not row or row.get(name) is None:
        return "–"
    if name == "retention":
        return f"{row[name] * 100:.1f}%"
    return f"{row[name]:.3f}" if name.startswith("alpha_") else f"{row[name]:.2f}"


__all__ = ["PAPER_LABEL", "cell", "md_table", "paper_cell", "paper_row", "tree_text"]
