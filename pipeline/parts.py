"""The parts of a study: filters of its plan (`studies.STUDY.parts`, `--only`), each run alone with the parents
and controls its trials need, so a study runs in pieces that combine by trial name.

    parts = check_parts(trials, cfg, "depth")                    # its parts, each a filter of the plan
    mine = plan_part(trials, part_filter(cfg, "depth", "seed1")) # one part, with the parents it needs
    expand_parts(cfg, ["all"])                                   # every part of every study, in run order
"""
from __future__ import annotations

from typing import Any

from pipeline.config import Config, ConfigError, lookup
from pipeline.plan import eagle3_key, resolve_axes
from pipeline.trial import CKPT_CHILDREN, Trial, is_continued
from stages.common import filter_text

WHOLE = "(whole)"   # the one part of a study that names none
ALL = "all"


def config_matches(config: Config | dict, only: dict[str, list[Any]]) -> bool:
    """Whether a resolved config (or its dump, as a plan file holds it) takes one of the allowed values of every
    key of `only` (KEY -> values)."""
    return all(lookup(config, k) in vals for k, vals in resolve_axes(only).items())


def trial_matches(t: Trial, only: dict[str, list[Any]]) -> bool:
    """Whether a trial's config takes one of the allowed values of every key of `only` (KEY -> values)."""
    return config_matches(t.config, only)


def plan_part(trials: list[Trial], only: dict[str, list[Any]]) -> list[Trial]:
    """The part of a plan whose settings take the `only` values (KEY -> allowed values), with the parent and the
    compute-matched control of each ckpt child kept; names stay the whole plan's. A study run in parts (one data
    scale now, the other later) so names each trial as the whole study does, and its parts combine by name."""
    only = resolve_axes(only)
    kept = {t.name for t in trials if trial_matches(t, only)}
    if not kept:
        raise ConfigError(f"--only {filter_text(only)}: no trial of the plan has these settings (`--dry-run` "
                          "without it lists them)")
    # the control of a kept child: the continued eagle3 of its schedule (its parent's children share one unless
    # `train.parent` gives them other settings than the parent's)
    schedules = {eagle3_key(t.config) for t in trials if t.name in kept and t.variant in CKPT_CHILDREN
                 and t.config.drafter.init == "ckpt"}
    controls = {t.name for t in trials if is_continued(t.config) and eagle3_key(t.config) in schedules}
    kept |= controls
    parents = {t.depends_on for t in trials if t.name in kept and t.depends_on}
    kept |= parents
    return [t for t in trials if t.name in kept]


def decodes_any(cfg: Config, study: str, trials: list[Trial]) -> bool:
    """Whether the study decodes some of these trials end to end (its `e2e`: all of them, or a filter)."""
    wants = cfg.studies[study].e2e
    return wants is True or (isinstance(wants, dict) and any(trial_matches(t, wants) for t in trials))


def part_filter(cfg: Config, study: str | None, part: str) -> dict[str, list[Any]]:
    """The `--only` filter of the named part of a study (`studies.STUDY.parts.PART`)."""
    spec = cfg.studies.get(study) if study else None
    if spec is None:
        raise ConfigError(f"--part {part}: needs --study, a study of this profile "
                          f"({', '.join(sorted(cfg.studies)) or 'none'})")
    if part not in spec.parts:
        has = f"its parts: {', '.join(spec.parts)}" if spec.parts else "it has no parts"
        raise ConfigError(f"--part {part}: not a part of study {study} ({has})")
    return resolve_axes(spec.parts[part])


def check_parts(trials: list[Trial], cfg: Config, study: str | None) -> dict[str, list[Trial]]:
    """A study's parts with the trials each runs; a ConfigError when a part matches no trial or a trial of the
    plan lies in no part (run part by part, the study would never finish). {} for a study without parts."""
    spec = cfg.studies.get(study) if study else None
    if spec is None or not spec.parts:
        return {}
    parts: dict[str, list[Trial]] = {}
    for name, only in spec.parts.items():
        try:
            parts[name] = plan_part(trials, only)
        except ConfigError:
            raise ConfigError(f"studies.{study}.parts.{name}: no trial of the plan has these settings") from None
    covered = {t.name for part in parts.values() for t in part}
    left = [t.name for t in trials if t.name not in covered]
    if left:
        raise ConfigError(f"studies.{study}.parts: no part runs {', '.join(left)}; add a part whose filter "
                          "matches them")
    return parts


def expand_parts(cfg: Config, specs: list[str]) -> list[tuple[str, str]]:
    """(study, part) in run order from `kvshot repro --part` specs: `STUDY/PART`; `STUDY`, every part of the study
    (a study without parts is one, `(whole)`); `all`, every part of every study in the profile's study order, the
    order DVC runs them (a validation study before the study that chooses from it). A part named twice runs once."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        study, slash, part = spec.partition("/")
        studies = list(cfg.studies) if spec == ALL else [study]
        if any(s not in cfg.studies for s in studies) or (slash and not part):
            raise ConfigError(f"--part {spec!r}: expected STUDY/PART, STUDY or {ALL} with a study of this profile "
                              f"({', '.join(cfg.studies) or 'none'})")
        if part and part not in cfg.studies[study].parts:
            has = f"its parts: {', '.join(cfg.studies[study].parts)}" if cfg.studies[study].parts else \
                f"it has no parts: --part {study} runs it whole"
            raise ConfigError(f"--part {spec!r}: not a part of study {study} ({has})")
        for s in studies:
            for p in ([part] if part else list(cfg.studies[s].parts) or [WHOLE]):
                if (s, p) not in out:
                    out.append((s, p))
    return out
