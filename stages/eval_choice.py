"""The eval split the regenerate stage evaluates, chosen among prepare's candidates by prompt length.

prepare draws, per source, `eval_size` eval rows and a reserve of further candidates (split `reserve`), ranked by
`scale_rank`, without knowing the target's tokenizer; `choose_eval` takes the first `eval_size` of them whose first
prompt fits `regenerate.max_prompt_tokens` and keeps the further fitting ones as spares (stages/regenerate.py
refills from them while an eval row gets no answer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from stages.common import StageError

EVAL = "eval"
RESERVE = "reserve"             # prepare's spare eval candidates (see stages.prepare)


def opening(row: dict) -> list[dict]:
    """The history the first answer is asked for from: a leading system message and the first user turn."""
    msgs = row["messages"]
    first = next((m for m in msgs if m.get("role") == "user"), None)
    if first is None:
        raise StageError(f"prepared row {row['id']!r}: no user turn")
    return [dict(m) for m in msgs[:1] if m.get("role") == "system"] + [dict(first)]


@dataclass
class EvalChoice:
    rows: list[dict]             # the eval rows to regenerate now (split `eval`)
    spare: list[dict]            # further fitting candidates, in rank order, for eval rows that get no answer
    size: int                    # eval rows wanted: the number prepare put in the eval split
    counts: dict[str, int]


def choose_eval(candidates: list[dict], too_long: Callable[[list[dict]], bool]) -> EvalChoice:
    """The first `size` eval candidates (eval and reserve rows, by `scale_rank`) whose first prompt fits.

    `size` is the number of rows prepare put in the eval split (data.eval_size); the reserve only fills in."""
    size = sum(r.get("split") == EVAL for r in candidates)
    ranked = sorted(candidates, key=lambda r: (r.get("scale_rank", 0), r["id"]))
    fits = [not too_long(opening(r)) for r in ranked]
    fitting = [i for i, ok in enumerate(fits) if ok]
    used = fitting[:size]
    seen = used[-1] + 1 if len(used) == size and used else len(ranked)   # the candidates the choice looked at
    chosen = [dict(ranked[i], split=EVAL) for i in used]
    counts = {"eval_candidates": len(ranked), "eval_wanted": size, "eval_chosen": len(chosen),
              "eval_over_long": fits[:seen].count(False),
              "eval_from_reserve": sum(ranked[i].get("split") == RESERVE for i in used)}
    return EvalChoice(chosen, [dict(ranked[i], split=EVAL) for i in fitting[size:]], size, counts)
