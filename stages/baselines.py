"""Who each drafter is compared with, and the difference from it: the report's compute-matched baselines.

A drafter initialised from a trained EAGLE-3 (the hybrid and cross-only from its checkpoint, EAGLE-3 continued)
has had more training than one trained from scratch, so it is compared with EAGLE-3 continued for the same
schedule, never with the EAGLE-3 it started from; a block drafter reading the KV with the hidden-context block
drafter of its shape (block drafters run free, autoregressive ones are teacher-forced: their step accuracies are
never one comparison); everything else with the EAGLE-3 trained from scratch on the same data (DESIGN §8). The
report's tables (`stages.report`) show the difference this module computes; rows that name their baseline (the
planner's, `pipeline.plan.baseline_of`) are compared with it, older rows by the same rules read from the settings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from stages.results import Setting, like_with_like, same_conversations
from stages.sections import CKPT_CHILDREN, CONTINUED


def same_data(a: Setting, b: Setting) -> bool:
    """Trained on the same data scale with the same other swept settings, evaluated on the same conversations."""
    return a.fields.get("scale") == b.fields.get("scale") and a.extra == b.extra and same_conversations(a, b)


def measured_eagle3(x: Setting, continued: bool) -> bool:
    """A measured EAGLE-3 setting (not EAGLE-3.1), continued or trained from scratch."""
    f = x.fields
    return bool(x.n) and f.get("variant") == "eagle3" and (f.get("init") == CONTINUED) == continued \
        and not f.get("fc_norm") and not f.get("norm_output")


def baseline_for(s: Setting, settings: list[Setting]) -> Setting | None:
    """The compute-matched baseline of a setting: EAGLE-3 continued for a checkpoint-initialised drafter (and the
    EAGLE-3 it continues for EAGLE-3 continued itself), the hidden-context block drafter of its shape for a block
    drafter reading the KV (a block drafter runs free: its step accuracy is never compared with a teacher-forced
    one), the EAGLE-3 trained from scratch for the rest."""
    if s.baselines:    # the planner named it: the setting holding those trials
        named = [x for x in settings if x.n and s.baselines & set(x.trials) and same_conversations(s, x)]
        return named[0] if named else None
    # rows from before rows named their baseline: the same rules, read from the settings
    f = s.fields
    if f.get("variant") == "block":
        return block_baseline(s, settings)
    plain = [x for x in settings if measured_eagle3(x, continued=False) and same_data(s, x)]
    continued = [x for x in settings if measured_eagle3(x, continued=True) and same_data(s, x)]
    if f.get("variant") == "eagle3" and not (f.get("init") == CONTINUED or f.get("fc_norm") or f.get("norm_output")):
        return None
    if f.get("variant") in CKPT_CHILDREN and f.get("init") == "ckpt":
        return continued[0] if continued else None
    parent = s.extra.get("train.parent") if isinstance(s.extra.get("train.parent"), dict) else None
    if f.get("init") == CONTINUED and parent:
        return parent_eagle3(s, parent, settings)
    return plain[0] if plain else None


def _context(x: Setting) -> str:
    return x.fields.get("context") or "hidden"


def block_baseline(s: Setting, settings: list[Setting]) -> Setting | None:
    """The hidden-context block drafter of the same depth, block size and data (None for that drafter itself)."""
    if _context(s) == "hidden":
        return None
    found = [x for x in settings if x.n and x.fields.get("variant") == "block" and _context(x) == "hidden"
             and all(x.fields.get(k) == s.fields.get(k) for k in ("depth", "block_size")) and same_data(s, x)]
    return found[0] if found else None


def parent_eagle3(s: Setting, parent: dict, settings: list[Setting]) -> Setting | None:
    """The EAGLE-3 that EAGLE-3 continued started from when `train.parent` gave it other train settings (the small
    scale's, say): the plain EAGLE-3 of the parent's scale whose other swept settings are the parent's or none."""
    scale = parent.get("scale", s.fields.get("scale"))
    own = {f"train.{k}": v for k, v in parent.items() if k != "scale"}
    found = [x for x in settings if measured_eagle3(x, continued=False) and x.fields.get("scale") == scale
             and x.extra in ({}, own) and same_conversations(s, x)]
    return found[0] if found else None


@dataclass(frozen=True)
class Difference:
    """A setting's metric minus its baseline's, with the interval of the paired bootstrap."""
    baseline: Setting                 # as compared: a one-seed setting's is its own seed's
    value: float
    interval: tuple[float, float]     # NaN, NaN without per-conversation counts


def difference(s: Setting, base: Setting, metric: str, level: float) -> Difference:
    """`metric` of `s` minus that of its baseline `base`, like with like (one seed: against its own seed's
    baseline), the interval over the same resamples of both."""
    from models.stats import interval

    s, base = like_with_like(s, base)
    diff = s.value(metric) - base.value(metric)
    a, b = s.resampled(metric), base.resampled(metric)
    ci = interval(a - b, level) if a is not None and b is not None else (math.nan, math.nan)
    return Difference(base, diff, ci)


__all__ = ["Difference", "baseline_for", "block_baseline", "difference", "measured_eagle3", "parent_eagle3",
           "same_data"]
