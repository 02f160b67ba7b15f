"""The plan of a sweep: its trials, their names and the trials they depend on. Pure: no Ray, no files.

    trials = plan(cfg, parse_overrides(["depth=1,2,3,4"]))      # ad hoc grid -> study "adhoc"
    trials = plan(cfg, study="depth")                            # a study of the profile (grid + include + seeds)

The parts a study runs in are filters of its plan (`pipeline.parts`).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
from typing import Any, Literal

from pipeline.choices import Choice, RowsOf, choose, chosen_keys
from pipeline.config import Config, ConfigError, lookup, resolve_key, settings_key, with_values
from pipeline.fingerprint import TRIAL_SECTIONS
from pipeline.trial import CKPT_CHILDREN, CONTINUED, Trial, is_continued, needs_parent
from stages import validation

ADHOC = "adhoc"
VARIANT = "drafter.variant"
INIT = "drafter.init"
SEED = "train.seed"
PARENT = "train.parent"
# Drafter settings an eagle3 drafter does not use: a ckpt child's parent ignores them.
_EAGLE3_IGNORES = ("drafter.variant", "drafter.injection", "drafter.rope_fix", "drafter.init", "drafter.no_target",
                   "drafter.token_context", "drafter.block_size", "drafter.context")

Resolved = list[tuple[dict[str, Any], Config]]   # (the values a trial sets, its resolved config), in plan order
# What a trial is in its study's experiment (`role_of`; DESIGN §8).
Role = Literal["trial", "parent", "compute-matched control", "no-target control", "control with context"]


# -- names -------------------------------------------------------------------------------------------------------

def _token(key: str, value: Any) -> str:
    """A short readable name part for one varying value."""
    short = key.rsplit(".", 1)[-1]
    if short == "depth":
        text = f"d{value}"
    elif short == "rope_fix":
        text = "ropefix" if value else "norope"
    elif short in ("injection", "init", "scale", "variant"):
        text = str(value)
    elif short == "seed":
        text = f"s{value}"
    elif short == "no_target":
        text = "no_target" if value else "target"
    elif short == "token_context":
        text = "token_context" if value else "no_token_context"
    elif short == "context":
        text = str(value)
    elif short == "block_size":
        text = f"B{value}"
    elif short == "parent" and isinstance(value, dict):
        text = "from_" + "_".join(_token(f"train.{k}", v) for k, v in value.items()) if value else "from_own"
    elif short in ("fc_norm", "norm_output") and isinstance(value, bool):
        text = short if value else f"no_{short}"
    elif isinstance(value, bool):
        text = short if value else f"no_{short}"
    else:
        text = f"{short}{value}"
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", text).strip("_") or "x"


def trial_name(variant: str, values: dict[str, Any], naming_keys: list[str]) -> str:
    """`<variant>-<token>-...` from the values of `naming_keys` (those that vary across the plan), in order."""
    keys = [k for k in naming_keys if k in values and k != VARIANT]
    if variant == "eagle3" and values.get("drafter.fc_norm") is True and values.get("drafter.norm_output") is True:
        variant = "eagle3.1"            # both EAGLE-3.1 normalisations: the drafter has a name of its own
        keys = [k for k in keys if k not in ("drafter.fc_norm", "drafter.norm_output")]
    return "-".join([variant] + [_token(k, values[k]) for k in keys])


def _naming_keys(all_values: list[dict[str, Any]]) -> list[str]:
    """Keys (in first-seen order) whose value differs between trials or is missing from some."""
    keys: list[str] = []
    for v in all_values:
        keys += [k for k in v if k not in keys]
    varying = []
    for k in keys:
        seen = {json.dumps(v.get(k, "<unset>"), sort_keys=True, default=str) for v in all_values}
        if len(seen) > 1:
            varying.append(k)
    return varying


def varying_keys(trials: list[Trial]) -> list[str]:
    return _naming_keys([t.values for t in trials])


def _unique_names(named: list[tuple[str, dict[str, Any]]]) -> list[str]:
    counts: dict[str, int] = {}
    for n, _ in named:
        counts[n] = counts.get(n, 0) + 1
    out = []
    for n, v in named:
        if counts[n] > 1:   # same readable name, different config: disambiguate deterministically
            n = f"{n}-{hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:6]}"
        out.append(n)
    return out


# -- configs -----------------------------------------------------------------------------------------------------

def resolve_axes(axes: dict[str, list[Any]]) -> dict[str, list[Any]]:
    out = {}
    for key, values in axes.items():
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise ConfigError(f"grid axis {key!r} has no values")
        out[resolve_key(key)] = values
    return out


def _product(axes: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]



def eagle3_key(cfg: Config) -> str:
    """An eagle3 drafter trained for `cfg`: everything but the drafter settings it ignores (a ckpt child, its
    continued control and their eagle3 share it when `train.parent` is empty)."""
    return settings_key(cfg, TRIAL_SECTIONS, _EAGLE3_IGNORES)


def parent_config(cfg: Config, origin: str = "eagle3 parent") -> Config:
    """The eagle3 a ckpt child (or a continued eagle3) starts from: its own config as a plain eagle3, with the train
    settings of `train.parent` in place of its own."""
    values: dict[str, Any] = {VARIANT: "eagle3"}
    if is_continued(cfg):
        values[INIT] = "ckpt"           # a plain eagle3 (init is not read by eagle3 training)
    if cfg.train.parent:
        values.update({f"train.{k}": v for k, v in cfg.train.parent.items()})
        values[PARENT] = {}
    return with_values(cfg, values, origin=origin)


def _parent_key(cfg: Config) -> str:
    """The key (`eagle3_key`) of the eagle3 that `cfg` starts from."""
    return eagle3_key(parent_config(cfg)) if cfg.train.parent else eagle3_key(cfg)


def _config_key(cfg: Config) -> str:
    return json.dumps(cfg.model_dump(), sort_keys=True, default=str)


# -- the plan ----------------------------------------------------------------------------------------------------

def plan(cfg: Config, axes: dict[str, list[Any]] | None = None, study: str | None = None,
         rows_of: RowsOf | None = None) -> list[Trial]:
    """The trials of a sweep, parents first.

    - `study` names a study of the profile (`cfg.studies`): its grid, each `include` entry as a single trial, and
      its `seeds` (an axis over train.seed when given). `axes` on top add or replace grid axes; an axis with one
      value applies to every trial.
    - Otherwise the sweep is ad hoc: the grid is `axes` over `cfg` (variant defaults to the profile's), in a study
      named `study` or "adhoc".
    - hybrid/cross_only with init=ckpt depend on the eagle3 trial of the same data, training settings and seed;
      that trial is added when the plan lacks it. So is, once per parent, the compute-matched control such a
      child is compared with (DESIGN §4): an eagle3 with init=continued, the parent continued for the child's
      schedule. Its config is the parent's with init=continued, the same in every study, so its fingerprint is
      shared and it trains once. With `train.parent` (children of an eagle3 trained on other settings, say the
      small data scale's) the control is the child's own schedule as a continued eagle3, once per schedule.
    - A study with `choose: {KEY: VALIDATION}` plans each trial the validation study trains too at the value it
      chose there (`pipeline.choices`) from the finished rows `rows_of` gives (a workspace's); without them, or
      while they are missing, the choice is pending and the trial keeps the profile's value. Axes given on top
      that set KEY win over the choice.
    Names are `<variant>-<values that vary>`, unique and stable for the same plan.
    """
    axes = resolve_axes(axes or {})
    fixed = {k: v[0] for k, v in axes.items() if len(v) == 1}
    outer = {k: v for k, v in axes.items() if len(v) > 1}
    base = with_values(cfg, fixed, origin="override") if fixed else cfg
    grid, includes = _study_axes(cfg, study, outer, fixed)
    name = study or ADHOC
    resolved = _resolve(base, _combos(outer, grid, includes), name)
    picks = _apply_choices(cfg, study, resolved, axes, rows_of)
    validation_size = cfg.studies[study].validation if study in cfg.studies else None
    if validation_size:
        resolved = _on_validation(resolved, validation_size, name)
    _check_parents(resolved, name)
    parents_by_key = _add_parents(resolved, name)
    _add_controls(resolved, parents_by_key, name)
    if validation_size:
        resolved[:] = _on_validation(resolved, validation_size, name)
    return _trials(resolved, parents_by_key, name, picks)


def _study_axes(cfg: Config, study: str | None, outer: dict[str, list[Any]],
                fixed: dict[str, Any]) -> tuple[dict[str, list[Any]], list[dict[str, Any]]]:
    """The grid and the include entries of the study `study` (none for an ad-hoc sweep); its seeds join `outer`
    and the axes given on top (`outer`) leave its grid."""
    grid: dict[str, list[Any]] = {}
    includes: list[dict[str, Any]] = []
    if study is not None and study in cfg.studies:
        spec = cfg.studies[study]
        grid = resolve_axes(spec.grid)
        includes = [{resolve_key(k): v for k, v in entry.items()} for entry in spec.include]
        if spec.seeds is not None:
            if SEED in grid:
                raise ConfigError(f"studies.{study}: both `seeds` and the grid axis {SEED} set the seed; give one")
            outer.setdefault(SEED, list(spec.seeds))
        for k in outer:
            grid.pop(k, None)
    elif not outer and not fixed:
        known = ", ".join(sorted(cfg.studies)) or "none"
        what = f"unknown study {study!r}" if study else "nothing to sweep"
        raise ConfigError(f"{what}: give grid axes KEY=V1,V2 or a study of the profile (studies: {known})")
    return grid, includes


def _combos(outer: dict[str, list[Any]], grid: dict[str, list[Any]],
            includes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The values of every trial the grid and the includes ask for, under every combination of `outer`."""
    combos: list[dict[str, Any]] = []
    for o in _product(outer):
        combos += [{**g, **o} for g in _product(grid)] if grid or not includes else []
        combos += [{**o, **{k: v for k, v in inc.items()}} for inc in includes]
    if not combos:
        combos = [{}]
    return combos


def _resolve(base: Config, combos: list[dict[str, Any]], name: str) -> Resolved:
    """Each combination resolved over `base`, dropping exact duplicates (an include that repeats a grid point)."""
    resolved: Resolved = []
    seen: set[str] = set()
    for values in combos:
        desc = ", ".join(f"{k}={v}" for k, v in values.items()) or "base"
        trial_cfg = with_values(base, values, origin=f"study {name}: {desc}")
        key = _config_key(trial_cfg)
        if key not in seen:
            seen.add(key)
            if is_continued(trial_cfg):
                values = {**values, INIT: CONTINUED}     # named as such even when set for the whole sweep
            resolved.append((values, trial_cfg))
    return resolved


def _on_validation(resolved: Resolved, size: int, name: str) -> Resolved:
    """Every trial evaluated on the validation set of `size` conversations beyond its own data scale
    (stages/validation.py) instead of the eval split. Applied again once parents and controls are added: a parent
    trained at another scale (`train.parent`) is evaluated beyond its own."""
    out = []
    for values, trial_cfg in resolved:
        if trial_cfg.eval.data and validation.parse(trial_cfg.eval.data) is None:
            raise ConfigError(f"study {name}: both `validation` and eval.data={trial_cfg.eval.data} say what to "
                              "evaluate on; give one")
        if size > trial_cfg.eval.max_conversations:
            raise ConfigError(f"study {name}: validation={size} conversations, but eval.max_conversations="
                              f"{trial_cfg.eval.max_conversations} would evaluate fewer; raise it or lower validation")
        where = validation.relative_path(trial_cfg.train.scale, size)
        if trial_cfg.eval.data != where:
            trial_cfg = with_values(trial_cfg, {"eval.data": where}, origin=f"study {name}: validation")
        out.append((values, trial_cfg))
    return out


def _apply_choices(cfg: Config, study: str | None, resolved: Resolved, axes: dict[str, list[Any]],
                   rows_of: RowsOf | None) -> dict[int, list[Choice]]:
    """Set the values the study takes from its validation studies (`choose`) in the trials they train too; the
    choices by position in `resolved` (pending ones included)."""
    picks: dict[int, list[Choice]] = {}
    for key, by in chosen_keys(cfg, study).items():
        if key in axes:
            continue                                   # set on the command line: that value, not the choice
        candidates = plan(cfg, study=by)
        rows = rows_of(candidates) if rows_of else {}
        for i, (values, trial_cfg) in enumerate(resolved):
            picked = choose(trial_cfg, key, by, candidates, rows)
            if picked is None:
                continue
            if needs_parent(trial_cfg):
                raise ConfigError(f"studies.{study}.choose.{key}: {by} trains a drafter that starts from a "
                                  "checkpoint; a value is chosen for drafters trained from scratch")
            picks.setdefault(i, []).append(picked)
            if picked.value is not None and picked.value != lookup(trial_cfg, key):
                resolved[i] = (values, with_values(trial_cfg, {key: picked.value},
                                                   origin=f"study {study}: chosen by {by}"))
    return picks


def _check_parents(resolved: Resolved, name: str) -> None:
    """Only a drafter that starts from an eagle3 checkpoint may name `train.parent`."""
    for _, trial_cfg in resolved:
        if trial_cfg.train.parent and not needs_parent(trial_cfg):
            raise ConfigError(f"study {name}: {PARENT}={trial_cfg.train.parent} on a {trial_cfg.drafter.variant} "
                              f"with drafter.init={trial_cfg.drafter.init}: only a drafter that starts from an "
                              f"eagle3 checkpoint has a parent (init=ckpt hybrid/cross_only, or eagle3 init=continued)")


def _add_parents(resolved: Resolved, name: str) -> dict[str, int]:
    """Add the parents of ckpt-initialised children (and of continued eagle3s) that the plan lacks; -> the index in
    `resolved` of the eagle3 of every `eagle3_key`."""
    parents_by_key = {eagle3_key(c): i for i, (v, c) in enumerate(resolved)
                      if c.drafter.variant == "eagle3" and not is_continued(c)}
    for values, trial_cfg in list(resolved):
        if needs_parent(trial_cfg) and _parent_key(trial_cfg) not in parents_by_key:
            pvals = {k: v for k, v in values.items() if k not in _EAGLE3_IGNORES and k != PARENT}
            pvals[VARIANT] = "eagle3"
            pvals.update({f"train.{k}": v for k, v in trial_cfg.train.parent.items()})
            pcfg = parent_config(trial_cfg, origin=f"study {name}: eagle3 parent")
            parents_by_key[eagle3_key(pcfg)] = len(resolved)
            resolved.append((pvals, pcfg))
    return parents_by_key


def _add_controls(resolved: Resolved, parents_by_key: dict[str, int], name: str) -> None:
    """Add the compute-matched control of every ckpt child: its parent continued for the child's schedule, once per
    schedule (without `train.parent` a parent's children share its schedule, so once per parent)."""
    controlled = {eagle3_key(c) for _, c in resolved if is_continued(c)}
    for values, trial_cfg in list(resolved):
        key = eagle3_key(trial_cfg)
        if trial_cfg.drafter.variant in CKPT_CHILDREN and trial_cfg.drafter.init == "ckpt" and key not in controlled:
            # the parent continued with the child's train settings (its own, unless `train.parent` differs)
            pvals, pcfg = resolved[parents_by_key[_parent_key(trial_cfg)]]
            own = {k: v for k, v in values.items() if k.startswith("train.")} if trial_cfg.train.parent else {}
            schedule = {f"train.{k}": v for k, v in trial_cfg.train.model_dump().items()}
            resolved.append(({**pvals, **own, INIT: CONTINUED},
                             with_values(pcfg, {**schedule, INIT: CONTINUED},
                                         origin=f"study {name}: eagle3 continued")))
            controlled.add(key)


def _trials(resolved: Resolved, parents_by_key: dict[str, int], name: str,
            picks: dict[int, list[Choice]]) -> list[Trial]:
    """The named trials of study `name`, each child pointing at its parent; parents first (stable otherwise)."""
    naming = _naming_keys([v for v, _ in resolved])
    names = _unique_names([(trial_name(c.drafter.variant, v, naming), v) for v, c in resolved])
    trials = [Trial(name=n, study=name, values=v, config=c, choices=picks.get(i, []))
              for i, (n, (v, c)) in enumerate(zip(names, resolved))]
    for t in trials:
        if needs_parent(t.config):
            t.depends_on = trials[parents_by_key[_parent_key(t.config)]].name
    for t in trials:
        t.baseline, t.role = baseline_of(t, trials), role_of(t, trials)
    return sorted(trials, key=lambda t: t.depends_on is not None)


def _training(cfg: Config, chosen: set[str] | frozenset = frozenset()) -> str:
    """Everything but the drafter and the values chosen per trial (`chosen`: each arm at its own best learning
    rate): two trials with the same are trained on the same data, schedule and seed."""
    return settings_key(cfg, ("target", "data", "regenerate", "features", "train", "eval"), chosen)


def _plain_eagle3(cfg: Config) -> bool:
    d = cfg.drafter
    return d.variant == "eagle3" and not is_continued(cfg) and not d.fc_norm and not d.norm_output


def _hidden_block(cfg: Config) -> bool:
    return cfg.drafter.variant == "block" and (cfg.drafter.context or "hidden") == "hidden"


def baseline_of(t: Trial, trials: list[Trial]) -> str | None:
    """The trial `t` is compared with (DESIGN §8): a checkpoint-initialised drafter with EAGLE-3 continued for its
    schedule (its compute-matched control); EAGLE-3 continued with the EAGLE-3 it continues; a block drafter reading
    the KV with the hidden-context block drafter of its shape (block drafters run free, autoregressive ones are
    teacher-forced: never one comparison); every other drafter but the plain EAGLE-3 and the hidden block arm
    with the plain EAGLE-3 trained on the same data, schedule and seed. None where the plan holds no such trial."""
    cfg, d = t.config, t.config.drafter
    if is_continued(cfg):
        return t.depends_on
    if _plain_eagle3(cfg) or _hidden_block(cfg):
        return None

    def same_training(o: Trial) -> bool:      # each arm at its own chosen values (`choose`)
        chosen = {c.key for c in t.choices} | {c.key for c in o.choices}
        return _training(o.config, chosen) == _training(cfg, chosen)
    if d.variant == "block":
        def match(o: Trial) -> bool:
            return _hidden_block(o.config) and same_training(o) \
                and (o.config.drafter.depth, o.config.drafter.block_size) == (d.depth, d.block_size)
    elif d.variant in CKPT_CHILDREN and d.init == "ckpt":
        def match(o: Trial) -> bool:
            return is_continued(o.config) and eagle3_key(o.config) == eagle3_key(cfg)
    else:
        def match(o: Trial) -> bool:
            return _plain_eagle3(o.config) and same_training(o)
    return next((o.name for o in trials if o is not t and match(o)), None)


def role_of(t: Trial, trials: list[Trial]) -> Role:
    """What the trial is in its study's experiment: a drafter the study compares (`trial`); an EAGLE-3 that
    checkpoint-initialised drafters load, compared as itself too (`parent`); EAGLE-3 continued for the same schedule
    as those drafters (`compute-matched control`); a drafter of its variant's shape that reads no target
    information (`no-target control`), or that reads the prefix's own token embeddings (`control with context`)."""
    d = t.config.drafter
    if d.no_target:
        return "control with context" if d.token_context else "no-target control"
    if is_continued(t.config):
        return "compute-matched control"
    if any(o.depends_on == t.name for o in trials):
        return "parent"
    return "trial"


def waves(trials: list[Trial], finished: set[str] | frozenset = frozenset()) -> list[list[Trial]]:
    """Trials grouped so that every trial comes after the trial it depends on (`finished` ones need no wave)."""
    done: set[str] = set(finished)
    remaining = list(trials)
    out = []
    while remaining:
        wave = [t for t in remaining if t.depends_on is None or t.depends_on in done]
        if not wave:
            missing = sorted({t.depends_on for t in remaining})
            raise ConfigError(f"trials depend on trials not in the plan: {', '.join(missing)}")
        out.append(wave)
        done |= {t.name for t in wave}
        remaining = [t for t in remaining if t.name not in done]
    return out
