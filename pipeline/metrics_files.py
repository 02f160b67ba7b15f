"""Reading a results folder's metrics files: one-line errors naming a damaged file, and the conversations a row
was measured on. A leaf of pipeline/ (nothing of pipeline imported), so that the planner's modules
(`pipeline.choices`) and the fold (`pipeline.study_results`) share it without an import circle."""
from __future__ import annotations

import json
from pathlib import Path

from stages.common import StageError


def read_json(path: Path, kind: type, what: str):
    """A JSON file holding a `kind` (dict or list); anything else is a one-line error naming the file."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StageError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, kind):
        raise StageError(f"{path}: expected {what}")
    return data


def read_rows(path: Path) -> list:
    """A JSON list of trial rows (a results folder's metrics/stepwise/<study>.json); a one-line error otherwise."""
    return read_json(path, list, "a JSON list of trial rows")


def conversations(row: dict) -> dict:
    """The hashes of the conversations a row trained and was evaluated on (`data`: regenerated/<source>, eval),
    without the feature cache: the cache is the target run over those conversations, and in bf16 its bits differ
    from one CPU to another (rounding), so two workspaces on the same conversations never share its hash."""
    data = row.get("data") or {}
    return {k: v for k, v in data.items() if k.startswith("regenerated/") or k == "eval"}
