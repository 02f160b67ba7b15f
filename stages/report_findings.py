"""The report's Findings section: one verdict per claim, alone and decided together with the other claims.

A verdict is shown as its interval reads it, except:
- in a demonstration (the report's trials trained under DEMO_FRACTION of the `decisive_steps` that decide a claim)
  every verdict is *not decided at this training length*, with what its interval would read;
- a verdict reading a study whose plan holds trials without rows yet is marked provisional;
- a decided verdict whose every difference rests on one seed is marked *one seed*: its interval has no seed term,
  so it speaks of the seed-0 drafters, not of retraining them (and it passes the claims-together column easily).
Beside each verdict, the claims decided together (`findings.family_wise`, Holm's step-down): what a reader who
takes all of the verdicts at once may rely on.
"""
from __future__ import annotations

import math

import pandas as pd

from stages.findings import CLAIM_STUDIES, FAILS, HOLDS, MISSING, ONE_SEED, Verdict, family_wise, findings
from stages.report_cells import md_table
from stages.report_provenance import PROVISIONAL, provisional_note, waiting_studies
from stages.results import E2EGroup, Setting
from stages.sections import ReportParams

NOT_DECIDED = "not decided at this training length"
DEMO_FRACTION = 0.5     # trials trained less than this share of `decisive_steps` make every verdict a demonstration
TOGETHER = "with the other claims (Holm)"


def trained_steps(studies: dict[str, list[Setting] | None]) -> float:
    """The median optimizer steps of the trials behind the report's settings (NaN: not recorded)."""
    steps = [s.value("train_steps") for settings in studies.values() for s in settings or [] if s.n]
    steps = [x for x in steps if math.isfinite(x)]
    return float(pd.Series(steps).median()) if steps else math.nan


def demonstration_steps(params: ReportParams, studies: dict[str, list[Setting] | None]) -> float | None:
    """The median optimizer steps of the report's trials when they trained too little (under DEMO_FRACTION of the
    `decisive_steps` that decide a claim) for any verdict to say anything; None when the verdicts decide."""
    steps = trained_steps(studies)
    demo = params.decisive_steps is not None and math.isfinite(steps) and steps < DEMO_FRACTION * params.decisive_steps
    return steps if demo else None


def verdicts(params: ReportParams, studies: dict, e2e: list[E2EGroup] | None,
             scales: list[str]) -> tuple[list[Verdict], dict[str, str]]:
    """Every claim's verdict at the report's level, and the measured claims' verdicts decided together."""
    def at(level: float) -> list[Verdict]:
        return findings(studies, e2e, scales, params.much_smaller_ratio, level)
    alone = at(params.level)
    return alone, family_wise(lambda level: alone if level == params.level else at(level), params.level)


def _intro(pct: int, together: dict[str, str]) -> list[str]:
    return ["## Findings", "",
            f"A claim *holds* or *does not hold* only when the {pct}% interval of its difference excludes 0; "
            "otherwise it is *inconclusive* (the interval is in the evidence); *not measured*: no data (or only "
            "data evaluated on other conversations); *one seed*: decided on one seed in every difference it reads, "
            "so about those seed-0 drafters alone (its interval has no seed term). Drafters "
            "initialised from a trained EAGLE-3 are compared with EAGLE-3 continued for the same schedule "
            "(compute-matched), never with the EAGLE-3 they started from. Each verdict holds its level alone; "
            f"*{TOGETHER}* decides the {len(together)} measured claims together, so that the chance that any of "
            f"them is decided wrongly stays at {100 - pct}% (Holm's step-down: with m claims still open, a claim "
            f"is decided when its interval at level 1 − {(100 - pct) / 100:g}/m excludes 0; decided claims leave, "
            "and the rest are tried again at the smaller m).", ""]


def findings_section(params: ReportParams, alone: list[Verdict], together: dict[str, str],
                     demo_steps: float | None, pending: dict[str, dict[str, str]]) -> list[str]:
    """The claims table: each verdict alone and together with the others; in a demonstration (`demo_steps`: too
    little training) each marked not decided; a verdict whose studies' plans hold trials without rows yet
    (`pending`) marked provisional."""
    md = _intro(round(params.level * 100), together)
    demo = demo_steps is not None
    if demo:
        md += [f"**A demonstration, not a decision.** These drafters trained {demo_steps:.0f} optimizer steps "
               f"(median over trials), {demo_steps / params.decisive_steps:.0%} of the {params.decisive_steps} that "
               "decide a claim (the study profile's): no verdict below says anything about the paper's claims; each "
               "says what its interval would read, marked *not decided at this training length*. The decisions are "
               "in the study profile's report.", ""]

    def shown(verdict: str, one_seed: bool) -> str:
        text = f"**{NOT_DECIDED}** (interval: {verdict})" if demo and verdict != MISSING else f"**{verdict}**"
        return f"{text} ({ONE_SEED})" if one_seed and verdict in (HOLDS, FAILS) else text
    waiting = waiting_studies({v.claim: CLAIM_STUDIES.get(v.claim, ()) for v in alone if v.verdict != MISSING},
                              pending)
    rows = [[v.claim, v.statement,
             shown(v.verdict, v.one_seed) + (f" ({PROVISIONAL})" if waiting.get(v.claim) else ""),
             shown(together[v.claim], v.one_seed) if v.claim in together else "–", v.evidence] for v in alone]
    md.append(md_table(pd.DataFrame(rows, columns=["claim", "statement", "verdict", TOGETHER, "evidence"])))
    return md + ["", *([provisional_note(waiting, pending), ""] if any(waiting.values()) else [])]
