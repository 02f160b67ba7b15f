"""prepare: raw conversations (ShareGPT, UltraChat) -> data/prepared/<source>.jsonl."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.common import Paths, Report, Section


class SourceParams(Section):
    """One conversation source: the packaged ShareGPT file, an HF `datasets` id, or a local JSON/JSONL path."""

    kind: Literal["embedded", "hub", "local"] = "embedded"
    format: Literal["sharegpt", "ultrachat"] = "sharegpt"
    path: str | None = None          # hub id (kind=hub) or file path (kind=local)
    split: str = "train"             # hub split
    max_conversations: int | None = Field(None, ge=1)   # cap after cleaning (None = all)


class DataParams(Section):
    sources: dict[str, SourceParams] = {"sharegpt": SourceParams()}
    eval_size: int = Field(64, ge=1)                 # held-out conversations per source
    scales: dict[str, int] = {"small": 400, "large": 1600}   # training conversations per scale (nested subsets)
    max_user_turns: int = Field(2, ge=1)             # user->assistant pairs kept per conversation
    split_seed: int = 0


def run(params: DataParams, paths: Paths, report: Report) -> None:
    raise NotImplementedError("prepare is not built yet")
