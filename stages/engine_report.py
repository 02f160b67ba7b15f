"""The report's table of serving engines (metrics/engine.json, `stages/engine.py`): per drafter and draft length,
vLLM's acceptance beside kvshot's chain acceptance on the same prompts, with a paired prompt-bootstrap interval of
their difference, and each engine's speedup over its own plain decoding.

Where the interval of the difference excludes 0, the two implementations accept differently on the same drafter,
weights and prompts, so one of them has a bug; in bf16 a near-tie may flip a draft here and there, so the table
says in which precision the rows were decoded. *Lossless* follows kvshot's e2e rule: in bf16 every departure from
vLLM's own plain greedy output must sit at a near tie of that run's scores; in fp32 the output must be identical.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from models.stats import interval, multinomial_weights, ratio_draws

ENGINE_METRICS = Path("metrics") / "engine.json"     # written by the e2e stage (stages/engine.py) beside e2e.json


def _tau_draws(accepted: list, rounds: list, weights: np.ndarray) -> np.ndarray:
    """Mean acceptance length (1 + accepted drafts per round) under prompt weights [R, n]."""
    return 1.0 + ratio_draws(np.asarray(accepted, float), np.asarray(rounds, float), weights)


def _drafting(share: float | None) -> str:
    """The share of an engine's time spent drafting, where it was measured (kvshot's proposer inside vLLM, and
    kvshot's loop; an eagle3 export drafts inside vLLM's step)."""
    return "" if share is None else f"; drafting {share:.0%}"


def _lossless(r: dict) -> str:
    """yes/no, the share of prompts decoded identically, and in bf16 the largest gap a departure sat at"""
    text = f"{'yes' if r['lossless'] else 'no'} ({r['exact_match']:.0%} identical"
    if r.get("tie_tolerance") and r["exact_match"] < 1:
        text += f"; departures at gaps ≤ {r.get('max_tie_gap', 0.0):.3f}"
    return text + ")"


def engine_frame(rows: list[dict], draws: int = 2000, level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One record per served drafter and draft length (rows not served say why in one record each)."""
    rng = np.random.default_rng(seed)
    records = []
    for r in rows:
        base = {"drafter": r.get("trial"), "study": r.get("study"), "draft tokens": r.get("draft_tokens"),
                "vLLM route": r.get("engine_route", "eagle3 export")}   # rows before the KV route
        if r.get("status") != "ok":
            records.append({**base, "vLLM τ": "–", "kvshot τ": "–", "vLLM − kvshot": str(r.get("status")),
                            "lossless": "–", "vLLM speedup": "–", "kvshot speedup": "–"})
            continue
        pp = r["per_prompt"]
        w = multinomial_weights(len(pp["drafts"]), draws, rng)
        eng = _tau_draws(pp["accepted"], pp["drafts"], w)
        ours = _tau_draws(pp["kvshot_accepted"], pp["kvshot_rounds"], w)
        lo, hi = interval(eng - ours, level)
        pos = " / ".join(f"{a:.2f}" for a in r["accepted_per_pos"])
        kv_pos = " / ".join(f"{a:.2f}" for a in r["kvshot_accepted_per_pos"])
        records.append({**base, "vLLM τ": f"{r['tau']:.3f} ({pos})", "kvshot τ": f"{r['kvshot_tau']:.3f} ({kv_pos})",
                        "vLLM − kvshot": f"{r['tau'] - r['kvshot_tau']:+.3f} [{lo:+.3f}, {hi:+.3f}]",
                        "lossless": _lossless(r),
                        "vLLM speedup": f"{r['speedup']:.2f}x ({r['tokens_per_s']:.1f} tok/s"
                                        f"{_drafting(r.get('proposer_share'))})",
                        "kvshot speedup": f"{r['kvshot_speedup']:.2f}x ({r['kvshot_tokens_per_s']:.1f} tok/s"
                                          f"{_drafting(r.get('kvshot_draft_share'))})"})
    return pd.DataFrame.from_records(records)


def _tie_note(rows: list[dict]) -> str:
    """What lossless means for bf16 rows (nothing when every row is fp32 or written before the rule)"""
    low = [r for r in rows if r.get("dtype") not in (None, "float32") and r.get("tie_tolerance")]
    if not low:
        return ""
    tol = max(r["tie_tolerance"] for r in low)
    return (f" In {low[0]['dtype']}, *lossless* means every output that is not identical to vLLM's own plain "
            f"greedy output departs from it only at a near tie of that run (top-1 log-probability minus the chosen "
            f"token's ≤ {tol:g}), the rule kvshot's own rows follow: a verification pass over several tokens rounds "
            "differently from one token at a time.")


def engine_section(rows: list[dict] | None, level: float = 0.95) -> list[str]:
    """Markdown lines of the engines section; none without engine rows."""
    if not rows:
        return []
    ok = [r for r in rows if r.get("status") == "ok"]
    first = ok[0] if ok else rows[0]
    versions = sorted({str(r.get("engine_version")) for r in ok})
    lead = (f"vLLM {', '.join(versions) or '?'} (CPU build) served each drafter (EAGLE-3 heads as an eagle3 "
            "export; the others through kvshot's own proposer inside vLLM, eager, their speedup over an eager plain "
            f"run) on the same {first.get('num_prompts')} prompts as kvshot ({first.get('max_new_tokens')} new "
            f"tokens each, {first.get('dtype')}, batch 1, end of sequence ignored). τ is the mean acceptance "
            "length (accepted drafts + 1 per verification round), per position in brackets; kvshot decodes the "
            "drafter as a chain of as many draft tokens. The difference carries a paired prompt-bootstrap "
            "interval: one that excludes 0 means the two implementations accept differently. Each speedup is over "
            "the engine's own plain greedy decoding; \"drafting\" is the share of the engine's time spent "
            "drafting, where measured (benchmarks/engine.py splits a round further)." + _tie_note(ok))
    frame = engine_frame(rows, level=level)
    return ["## Serving engines", "", lead, "", frame.to_markdown(index=False), ""]
