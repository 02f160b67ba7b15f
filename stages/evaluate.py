"""evaluate: step-wise acceptance (alpha_k, acc_k, MAT, retention) of trained drafters -> metrics/stepwise/."""
from __future__ import annotations

from pydantic import Field

from stages.common import Paths, Report, Section


class EvalParams(Section):
    data: str | None = None               # conversation JSONL; default: the held-out regenerated split
    max_conversations: int = Field(64, ge=1)
    max_len: int = Field(512, ge=8)


def run(params: EvalParams, run_dirs, paths: Paths, report: Report) -> list[dict]:
    raise NotImplementedError("evaluate is not built yet")
