"""The metrics files as pandas tables with intervals: what the report and its findings are computed from.

Source of truth: `metrics/stepwise/<study>.json` (one row per trial) and `metrics/e2e.json` (one row per drafter
and tree). Both are read into DataFrames; trials that differ only in their seed are one *setting*, whose cells
pool the seeds' counts.

Intervals (DESIGN §4): rows written by the current evaluate stage keep every held-out conversation's counts
(`per_conversation`); e2e rows keep every prompt's (`per_prompt`). A setting's bootstrap draws resample those
(and its seeds, when it has several, `models.stats`). Settings evaluated on the same conversations share the
conversation weights of each draw, so the difference of two settings' draws is a *paired* difference; settings
on other conversations draw independently. Rows from before per-conversation counts existed still give point
values; their intervals are missing (NaN), and no claim is decided on them.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from models.metrics import mat, retention
from models.stats import (ConversationCounts, Draws, counts_array, draws_from_sums, interval, multinomial_weights,
                          ratio_draws, resample, seed_t_weights)
from stages.common import Paths, StageError
from stages.sections import CKPT_CHILDREN, CONTINUED

# What makes a setting (everything but the seed): the row fields, with the defaults rows from before a field
# existed are read with.
SETTING_DEFAULTS: dict[str, Any] = {"variant": None, "depth": None, "injection": None, "rope_fix": None, "init": None,
                                    "scale": None, "fc_norm": False, "norm_output": False, "no_target": False,
                                    "token_context": False, "block_size": None, "context": None}
SETTING_KEYS = tuple(SETTING_DEFAULTS)
PAPER_TREE = (8, 10, 60)
LOOKUP_KIND = "tuned_lookup"
METRICS = ("step_mat", "chain_mat", "step_retention", "chain_retention")


def read_rows(path: Path) -> list[dict]:
    """A metrics file's rows; malformed JSON or a non-list is a one-line error naming the file."""
    try:
        rows = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise StageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise StageError(f"{path}: expected a JSON list of objects, one per trial")
    return rows


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else math.nan


def _extra(row: dict) -> dict[str, Any]:
    """Swept values beyond the setting keys (an ad-hoc `kvshot sweep lr=...`): they split settings too."""
    values = row.get("values") if isinstance(row.get("values"), dict) else {}
    return {k: v for k, v in sorted(values.items()) if k.split(".")[-1] not in (*SETTING_KEYS, "seed")}


def row_error(row: dict) -> str | None:
    """Why a trial row cannot be used, or None."""
    if row.get("status", "ok") != "ok":
        return str(row.get("error") or f"status {row.get('status')}")
    alpha = row.get("alpha")
    if not isinstance(alpha, list) or not alpha or not all(a is None or isinstance(a, (int, float)) for a in alpha):
        return "no alpha list in the metrics row"
    return None


def setting_columns(row: dict) -> dict[str, Any]:
    """A row's setting columns, each missing or null one read as its default."""
    return {k: row.get(k, d) if row.get(k) is not None else d for k, d in SETTING_DEFAULTS.items()}


def stepwise_frame(study: str, rows: list[dict]) -> pd.DataFrame:
    """One row per trial: the setting columns, status, seed and the raw row (kept for its lists)."""
    records = []
    for r in rows:
        rec = setting_columns(r)
        rec.update(study=study, trial=str(r.get("trial")), seed=r.get("seed"), error=row_error(r),
                   extra=json.dumps(_extra(r), sort_keys=True, default=str), row=r,
                   commit=r.get("git_commit"), fingerprint=r.get("fingerprint"), reused_from=r.get("reused_from"),
                   code=r.get("code"))
        records.append(rec)
    frame = pd.DataFrame.from_records(records, columns=[*SETTING_KEYS, "study", "trial", "seed", "error", "extra",
                                                        "row", "commit", "fingerprint", "reused_from", "code"])
    frame["setting"] = ["|".join(str(rec[k]) for k in (*SETTING_KEYS, "extra")) for rec in records]
    return frame


# -- a setting: point values and draws -------------------------------------------------------------------------

def within_range(name: str, ci: tuple[float, float]) -> tuple[float, float]:
    """An interval of a bounded metric cut to its range (accuracies in [0, 1], MAT and τ at least 1, retention and
    speedup at least 0): the seed term, a t-interval over few seeds, can reach past it, and the part outside holds no
    possible value, so the cut interval covers the truth as often. Differences are not bounded and never cut."""
    low, high = (0.0, 1.0) if name.startswith(("acc_", "alpha_")) else \
        (1.0, math.inf) if name.endswith("mat") or name == "tau" else \
        (0.0, math.inf) if name.endswith("retention") or name == "speedup" else (-math.inf, math.inf)
    lo, hi = ci
    return (lo if math.isnan(lo) else max(lo, low), hi if math.isnan(hi) else min(hi, high))


@dataclass
class Setting:
    """One drafter setting of a study, its seeds pooled."""

    study: str
    fields: dict[str, Any]
    extra: dict[str, Any]
    trials: list[str]
    seeds: int
    failed: list[dict]
    point: dict[str, float]                       # acc_k, alpha_k, chains_k, step/chain MAT and retention, ...
    counts: ConversationCounts | None = None      # None: rows without per-conversation counts
    draws: Draws | None = None
    commits: list[str] = field(default_factory=list)
    trial_seeds: list[Any] = field(default_factory=list)      # the seed of each trial, in `trials` order
    resampler: "Resampler | None" = field(default=None, repr=False)
    codes: list[str] = field(default_factory=list)            # the code hashes its rows were computed by
    # the trials its rows name as their baseline (the planner's, `pipeline.plan.baseline_of`); empty for rows
    # written before rows named one
    baselines: frozenset[str] = frozenset()
    # what its trials are in the experiment (the planner's, `pipeline.plan.role_of`: "trial", "parent",
    # "compute-matched control", "no-target control", "control with context"); empty for rows from before
    roles: frozenset[str] = frozenset()
    lrs: tuple[float, ...] = ()                   # the learning rates its rows were trained at (rows that record one)

    def is_role(self, role: str, by_fields: bool) -> bool:
        """Whether its trials have `role`: as their rows name it, else (rows from before) as `by_fields` says."""
        return role in self.roles if self.roles else by_fields

    @property
    def n(self) -> int:
        return self.seeds

    @property
    def steps(self) -> int:
        return sum(1 for k in self.point if k.startswith("acc_"))

    def value(self, name: str) -> float:
        return self.point.get(name, math.nan)

    def resampled(self, name: str) -> np.ndarray | None:
        return None if self.draws is None else self.draws.metric(name)

    def ci(self, name: str, level: float = 0.95) -> tuple[float, float]:
        d = self.resampled(name)
        return (math.nan, math.nan) if d is None else within_range(name, interval(d, level))

    @property
    def seed_labels(self) -> tuple[str, ...] | None:
        """The seeds this setting ran, sorted, when each is labelled once (what pairs two settings' seeds)."""
        return None if self.counts is None else self.counts.pairable_seeds

    def seed_point(self, name: str) -> dict[str, float]:
        """The metric of each seed on every conversation (label -> value); empty without labelled counts."""
        if self.counts is None or self.seed_labels is None:
            return {}
        counts = self.counts.by_seed()
        per = draws_from_sums(counts.data.sum(1).astype(np.float64))          # one "draw" per seed
        return dict(zip(counts.seed_ids, map(float, per.pooled_metric(name))))

    def only(self, seed: str) -> "Setting":
        """This setting restricted to one of its seeds (to compare a one-seed setting with its own seed's
        baseline), resampled on the same conversation weights."""
        if self.seed_labels is None or seed not in self.seed_labels:
            raise ValueError(f"setting {self.trials} has no seed {seed!r}")
        counts = self.counts.by_seed()
        i = counts.seed_ids.index(seed)
        one = ConversationCounts(counts.data[[i]], counts.ids, [seed])
        trials = [t for t, sd in zip(self.trials, self.trial_seeds) if str(sd) == seed] or self.trials
        sub = Setting(self.study, self.fields, self.extra, trials, 1, [], _point_from_counts(one, []), one, None,
                      self.commits, [seed])
        if self.resampler is not None:
            self.resampler.setting(sub)
        return sub


def same_conversations(a: Setting, b: Setting) -> bool:
    """Evaluated on the same held-out conversations, as every comparison needs: settings of another data split
    (say, a study not yet rerun on a new split beside one that was) are not compared. Rows without per-conversation
    counts cannot tell, and are taken as the same."""
    ia, ib = (set(s.counts.ids) if s.counts is not None and s.counts.ids else None for s in (a, b))
    return ia is None or ib is None or ia == ib


def like_with_like(a: Setting, b: Setting) -> tuple[Setting, Setting]:
    """A one-seed setting against a several-seed one is compared with the other's same seed, when it ran it."""
    la, lb = a.seed_labels, b.seed_labels
    if a.n == 1 and b.n > 1 and la and lb and la[0] in lb:
        return a, b.only(la[0])
    if b.n == 1 and a.n > 1 and la and lb and lb[0] in la:
        return a.only(lb[0]), b
    return a, b


def _point_from_lists(rows: list[dict]) -> dict[str, float]:
    """Point values of rows without per-conversation counts: the mean over seeds of each row's own numbers."""
    K = max(len(r.get("acc") or r["alpha"]) for r in rows)
    out: dict[str, float] = {}
    for family in ("acc", "alpha"):
        for k in range(K):
            vals = [_num((r.get(family) or [])[k]) if k < len(r.get(family) or []) else math.nan for r in rows]
            vals = [v for v in vals if not math.isnan(v)]
            out[f"{family}_{k}"] = float(np.mean(vals)) if vals else math.nan
    def mean(key, fn):
        vals = [_num(r.get(key)) if r.get(key) is not None else fn(r) for r in rows]
        vals = [v for v in vals if not math.isnan(v)]
        return float(np.mean(vals)) if vals else math.nan
    lists = lambda r, f: [_num(a) for a in (r.get(f) or [])]   # noqa: E731
    out["step_mat"] = mean("step_mat", lambda r: mat(lists(r, "acc")) if r.get("acc") else math.nan)
    out["chain_mat"] = mean("chain_mat", lambda r: _num(r.get("mat")) if r.get("mat") is not None
                            else mat(lists(r, "alpha")))
    out["step_retention"] = mean("step_retention", lambda r: retention(lists(r, "acc")) if r.get("acc") else math.nan)
    out["chain_retention"] = mean("chain_retention", lambda r: _num(r.get("retention"))
                                  if r.get("retention") is not None else retention(lists(r, "alpha")))
    chains = [(r.get("counts") or {}).get("chain") for r in rows]
    if all(isinstance(c, list) for c in chains):
        for k in range(K):
            out[f"chains_{k}"] = float(sum(c[k] for c in chains if k < len(c)))
    out["agreement"] = mean("agreement", lambda r: math.nan)
    return out


def _point_from_counts(counts: ConversationCounts, rows: list[dict]) -> dict[str, float]:
    d = draws_from_sums(counts.data.sum((0, 1))[None].astype(np.float64))
    out = {f"acc_{k}": float(d.acc[0, k]) for k in range(counts.steps)}
    out.update({f"alpha_{k}": float(d.alpha[0, k]) for k in range(counts.steps)})
    out.update({f"chains_{k}": float(d.chains[0, k]) for k in range(counts.steps)})
    out.update({m: float(getattr(d, m)[0]) for m in METRICS})
    agree = [_num(r.get("agreement")) for r in rows]
    out["agreement"] = float(np.nanmean(agree)) if not all(math.isnan(a) for a in agree) else math.nan
    return out


def build_setting(study: str, group: pd.DataFrame) -> Setting:
    ok = group[group["error"].isna()]
    first = group.iloc[0]
    fields = {k: first[k] for k in SETTING_KEYS}
    failed = [{**r, "error": e} for r, e in zip(group.loc[group["error"].notna(), "row"],
                                                group.loc[group["error"].notna(), "error"])]
    rows = list(ok["row"])
    counts, point = None, {}
    if rows:
        packed = [r.get("per_conversation") for r in rows]
        if all(isinstance(p, dict) and p.get("valid") for p in packed):
            try:
                counts = counts_array(packed, seeds=list(ok["seed"]))
            except (ValueError, KeyError):
                counts = None      # seeds on different conversations: point values only
        point = _point_from_counts(counts, rows) if counts is not None else _point_from_lists(rows)
        for key in ("train_s_per_step", "train_steps"):   # what training cost, mean over seeds
            vals = [_num(r.get(key)) for r in rows if r.get(key) is not None]
            point[key] = float(np.mean(vals)) if vals else math.nan
    commits = sorted({str(c) for c in ok["commit"] if c})
    by_trial = dict(zip(group["trial"], group["seed"]))
    trials = sorted(group["trial"])
    codes = sorted({str(c) for c in ok["code"] if c})
    named = frozenset(str(r["baseline"]) for r in group["row"] if isinstance(r, dict) and r.get("baseline"))
    roles = frozenset(str(r["role"]) for r in group["row"] if isinstance(r, dict) and r.get("role"))
    lrs = tuple(sorted({float(r["lr"]) for r in rows if isinstance(r.get("lr"), (int, float))}))
    return Setting(study, fields, json.loads(first["extra"]), trials, len(rows), failed, point,
                   counts, None, commits, [by_trial[t] for t in trials], codes=codes, baselines=named, roles=roles,
                   lrs=lrs)


class Resampler:
    """Bootstrap draws for every setting, paired wherever two settings were evaluated on the same conversations
    (one weight matrix per set of conversation ids) and, among settings of several seeds, wherever they ran the
    same seeds (one seed-weight matrix per set of seed labels: seed n shares its data order and, for checkpoint-
    initialised trials, its parent run); deterministic for the same inputs."""

    def __init__(self, draws: int = 2000, seed: int = 0):
        self.n, self.seed = draws, seed
        self._weights: dict[tuple, np.ndarray] = {}

    def _rng(self, *key: str) -> np.random.Generator:
        h = hashlib.sha256("\0".join((str(self.seed), *key)).encode()).digest()
        return np.random.default_rng(int.from_bytes(h[:8], "little"))

    def weights(self, ids: tuple, kind: str = "conversations") -> np.ndarray:
        """[draws, len(ids)]: the same for every setting on these units (so their differences are paired)."""
        key = (kind, ids)
        if key not in self._weights:
            rng = self._rng(kind, *ids)
            self._weights[key] = (seed_t_weights(len(ids), self.n, rng) if kind == "seeds"
                                  else multinomial_weights(len(ids), self.n, rng))
        return self._weights[key]

    def setting(self, s: Setting) -> None:
        s.resampler = self
        if s.counts is None or not s.counts.ids:
            return
        ids = tuple(sorted(s.counts.ids))
        counts = s.counts.select(list(ids)).by_seed()
        labels = counts.pairable_seeds
        seed_w = self.weights(labels, kind="seeds") if labels and len(labels) > 1 else None
        rng = self._rng("seeds", s.study, *map(str, s.fields.values()), json.dumps(s.extra, sort_keys=True))
        s.draws = resample(counts, self.weights(ids), seed_w, rng)


def settings_of(study: str, rows: list[dict], resampler: Resampler | None = None) -> list[Setting]:
    """The rows grouped into settings; with `resampler`, each with its bootstrap draws (point values alone
    without)."""
    frame = stepwise_frame(study, rows)
    out = [build_setting(study, g) for _, g in frame.groupby("setting", sort=False)]
    for s in out if resampler is not None else []:
        resampler.setting(s)
    return out


# -- end to end ------------------------------------------------------------------------------------------------

@dataclass
class E2EKind:
    """One tree kind of one decoded setting: point values and, with per-prompt data, τ and speedup draws."""

    tree: Any
    point: dict[str, float]
    tau: np.ndarray | None = None
    speedup: np.ndarray | None = None
    tau_prompts: np.ndarray | None = None      # τ draws over prompts alone (seeds pooled, no seed term)
    prompts: int = 0
    prompt_ids: tuple[str, ...] = ()           # the prompts decoded (empty: rows without per-prompt data)

    def ci(self, name: str, level: float = 0.95) -> tuple[float, float]:
        d = getattr(self, name, None) if name in ("tau", "speedup") else None
        return (math.nan, math.nan) if d is None else within_range(name, interval(d, level))


def same_prompts(a: E2EKind, b: E2EKind) -> bool:
    """Decoded on the same prompts (`same_conversations`' rule for τ and speedup)."""
    return not a.prompt_ids or not b.prompt_ids or set(a.prompt_ids) == set(b.prompt_ids)


@dataclass
class E2EGroup:
    fields: dict[str, Any]
    trials: list[str]
    kinds: dict[str, E2EKind]          # "paper", "tuned", "tuned_lookup"
    lossless: bool | None
    n_rows: int
    studies: set[str] = field(default_factory=set)    # the studies its drafters came from (none: a baseline)
    n_seeds: int = 1                                   # the training seeds decoded


def tree_kind(row: dict) -> str:
    kind = row.get("tree_kind")
    if kind:
        return str(kind)
    tree = row.get("tree")
    return "paper" if isinstance(tree, list) and tuple(tree) == PAPER_TREE else "tuned"


E2E_POINT = ("tau", "speedup", "tokens_per_s", "baseline_tokens_per_s", "draft_time_share", "exact_match")


def _e2e_kind(rows: list[dict], resampler: Resampler) -> E2EKind:
    """One tree kind of a setting from its rows, one per decoded seed. With per-prompt data on the same prompts,
    τ and speedup are pooled over seeds and prompts (Σ accepted / Σ rounds, Σ tokens / Σ seconds), and their
    draws resample both: prompts by one weight matrix per prompt set, seeds by one per set of seed labels, so
    two settings decoded on the same prompts and seeds are paired (as the step-wise draws are)."""
    point = {k: float(np.nanmean([_num(r.get(k)) for r in rows])) if any(r.get(k) is not None for r in rows)
             else math.nan for k in E2E_POINT}
    trees = [r.get("tree") for r in rows]
    kind = E2EKind(trees[0] if all(t == trees[0] for t in trees) else trees, point)
    per = [r.get("per_prompt") for r in rows]
    if not all(isinstance(p, dict) and p.get("rounds") for p in per):
        return kind
    ids = [tuple(str(i) for i in p.get("ids") or range(len(p["rounds"]))) for p in per]
    seeds = [str(r.get("seed")) for r in rows]
    if len(set(ids)) != 1 or len(set(seeds)) != len(rows):
        return kind     # seeds decoded on different prompts (or one seed twice): point values only

    order = sorted(range(len(rows)), key=lambda i: seeds[i])     # the seed weights' columns: sorted labels
    names = ("accepted", "rounds") + (("tokens", "seconds", "greedy_tokens", "greedy_seconds")
                                      if all(p.get("greedy_seconds") for p in per) else ())
    a = {n: np.asarray([per[i][n] for i in order], dtype=np.float64) for n in names}     # [seeds, prompts]
    w = resampler.weights(ids[0], "prompts")
    sw = resampler.weights(tuple(sorted(seeds)), "seeds") if len(rows) > 1 else np.ones((w.shape[0], 1))
    kind.tau = ratio_draws(a["accepted"], a["rounds"], w, sw)
    kind.tau_prompts = ratio_draws(a["accepted"].sum(0), a["rounds"].sum(0), w)
    kind.prompts, kind.prompt_ids = len(ids[0]), ids[0]
    kind.point["tau"] = float(a["accepted"].sum() / a["rounds"].sum())
    if "tokens" in a:
        rate = ratio_draws(a["tokens"], a["seconds"], w, sw)
        base = ratio_draws(a["greedy_tokens"], a["greedy_seconds"], w, sw)
        with np.errstate(divide="ignore", invalid="ignore"):
            kind.speedup = rate / base
        if len(rows) > 1:
            kind.point["speedup"] = float((a["tokens"].sum() / a["seconds"].sum())
                                          / (a["greedy_tokens"].sum() / a["greedy_seconds"].sum()))
    return kind


def _fastest(rows: list[dict]) -> list[dict]:
    """Rows of several trees for one kind: per decoded seed, those of its fastest tree (as the e2e stage picks
    it; each seed's drafter keeps its own tuned tree)."""
    by_seed: dict[str, list[dict]] = {}
    for r in rows:
        by_seed.setdefault(str(r.get("seed")), []).append(r)
    out = []
    for seed in sorted(by_seed):
        by_tree: dict[str, list[dict]] = {}
        for r in by_seed[seed]:
            by_tree.setdefault(json.dumps(r.get("tree")), []).append(r)
        speed = {t: np.nanmean([_num(r.get("speedup")) for r in rs]) for t, rs in by_tree.items()}
        best = max(sorted(by_tree), key=lambda t: speed[t] if not math.isnan(speed[t]) else -1.0, default=None)
        out += by_tree[best] if best is not None else []
    return out


def e2e_groups(rows: list[dict], trial_settings: dict[tuple, dict], resampler: Resampler) -> list[E2EGroup]:
    """Group e2e rows by setting; a row named by a step-wise trial (its study's, else the scale study's) takes
    that trial's setting fields."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("status", "ok") != "ok" or row.get("tau") is None:
            continue
        fields = {k: row.get(k, d) if row.get(k) is not None else d for k, d in SETTING_DEFAULTS.items()}
        trial = str(row.get("trial"))
        known = trial_settings.get((str(row.get("study")), trial)) or trial_settings.get(("scale", trial)) or {}
        fields.update({k: v for k, v in known.items() if v is not None})
        groups.setdefault(tuple(fields[k] for k in SETTING_KEYS), []).append(row)
    out = []
    for key, group in groups.items():
        kinds = {}
        for kind in ("paper", "tuned", LOOKUP_KIND):
            chosen = [r for r in group if tree_kind(r) == kind]
            if kind != "paper":
                chosen = _fastest(chosen)
            if chosen:
                kinds[kind] = _e2e_kind(chosen, resampler)
        lossless = [r.get("lossless") for r in group if r.get("lossless") is not None]
        out.append(E2EGroup(dict(zip(SETTING_KEYS, key)), sorted({str(r.get("trial")) for r in group}), kinds,
                            all(lossless) if lossless else None, len(group),
                            {str(r["study"]) for r in group if r.get("study")}, len({r.get("seed") for r in group})))
    return out


# -- everything ------------------------------------------------------------------------------------------------

@dataclass
class Results:
    """Every study's settings and the e2e groups, read and resampled from the metrics files."""

    names: list[str]                              # the configured studies first, then any others found
    configured: list[str]
    raw: dict[str, list[dict] | None]             # None: no metrics file
    studies: dict[str, list[Setting] | None]
    e2e_rows: list[dict] | None
    e2e: list[E2EGroup] | None
    inputs: list[tuple[str, str]]                 # (path, sha256 prefix) of every file read
    level: float = 0.95


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def collect(context: dict, paths: Paths, draws: int = 2000, level: float = 0.95) -> Results:
    """Read metrics/stepwise/<study>.json for every configured study (and any other found) and metrics/e2e.json."""
    configured = list(context.get("studies") or [])
    found = sorted(p.stem for p in (paths.root / "metrics" / "stepwise").glob("*.json"))
    names = configured + [n for n in found if n not in configured]
    resampler = Resampler(draws)
    inputs: list[tuple[str, str]] = []
    raw: dict[str, list[dict] | None] = {}
    studies: dict[str, list[Setting] | None] = {}
    for name in names:
        p = paths.stepwise_metrics(name)
        raw[name] = read_rows(p) if p.is_file() else None
        if raw[name] is not None:
            inputs.append((str(p.relative_to(paths.root)), _sha(p)))
        studies[name] = settings_of(name, raw[name], resampler) if raw[name] is not None else None
    e2e_rows = read_rows(paths.e2e_metrics) if paths.e2e_metrics.is_file() else None
    e2e = None
    if e2e_rows is not None:
        inputs.append((str(paths.e2e_metrics.relative_to(paths.root)), _sha(paths.e2e_metrics)))
        # an e2e row names its drafter by study and trial, whose step-wise row carries the full setting
        trial_settings = {(study, str(r.get("trial"))): {k: r.get(k) for k in SETTING_KEYS}
                          for study, rows in raw.items() for r in rows or []}
        e2e = e2e_groups(e2e_rows, trial_settings, resampler)
    return Results(names, configured, raw, studies, e2e_rows, e2e, inputs, level)


# -- names -----------------------------------------------------------------------------------------------------

VARIANT_NAMES = {"eagle3": "EAGLE-3 (hidden-only)", "kv_only": "KV-only", "hybrid": "hybrid",
                 "cross_only": "cross-only", "block": "block", "prompt_lookup": "prompt lookup"}
VARIANT_ORDER = ("kv_only", "hybrid", "cross_only", "block", "eagle3", "prompt_lookup")


def variant_name(f: dict) -> str:
    """The drafter family as the tables name it (EAGLE-3.1 and the controls by their own names)."""
    v = f.get("variant")
    if v == "eagle3":
        name = "EAGLE-3.1" if f.get("fc_norm") and f.get("norm_output") else \
            "EAGLE-3 + fc norm" if f.get("fc_norm") else "EAGLE-3 + normed output" if f.get("norm_output") \
            else "EAGLE-3 (hidden-only)"
        return f"{name} continued" if f.get("init") == CONTINUED else name
    if v == "kv_only" and f.get("no_target"):
        return ("token-context control (no target information)" if f.get("token_context")
                else "no target information (control)")
    name = VARIANT_NAMES.get(v, str(v))
    if v in CKPT_CHILDREN and (f.get("fc_norm") or f.get("norm_output")):
        name += " (EAGLE-3.1 norms)" if f.get("fc_norm") and f.get("norm_output") else " (one EAGLE-3.1 norm)"
    return name


def label(s: "Setting | E2EGroup", with_scale: bool | None = None) -> str:
    """A short human name of a setting, naming only what varies for its variant."""
    f = s.fields
    v = f.get("variant")
    parts = [variant_name(f)]
    depth = f.get("depth")
    if depth is not None and (v in ("kv_only", "block") or depth != 1):
        parts.append(f"{depth} layer" + ("s" if depth != 1 else ""))
    if v == "kv_only" and f.get("injection") and not f.get("no_target"):
        parts.append(str(f["injection"]).replace("_", " "))
    if v == "kv_only" and f.get("rope_fix") and not f.get("no_target"):
        parts.append("RoPE fix")
    if v in CKPT_CHILDREN and f.get("init"):
        parts.append(f"{f['init']} init")
    if v == "block":
        size = f.get("block_size")
        parts.append(f"{f.get('context') or 'hidden'} context, B={int(size) if size == size and size else size}")
    study = getattr(s, "study", None)
    if f.get("scale") and (with_scale if with_scale is not None else study == "scale"):
        parts.append(f"scale {f['scale']}")
    parts += [f"{k}={x}" for k, x in (getattr(s, "extra", None) or {}).items()]
    return ", ".join(parts)


def sort_key(fields: dict, scale_order: list[str], extra: dict | None = None) -> tuple:
    v = fields.get("variant")
    scale, depth = fields.get("scale"), fields.get("depth")
    return (VARIANT_ORDER.index(v) if v in VARIANT_ORDER else len(VARIANT_ORDER), str(v),
            bool(fields.get("no_target")), bool(fields.get("token_context")), fields.get("init") == CONTINUED,
            scale_order.index(scale) if scale in scale_order else len(scale_order), str(scale),
            depth if isinstance(depth, int) else 10**6, str(depth),
            *((fields.get(k) is None, str(fields.get(k))) for k in ("injection", "rope_fix", "init", "fc_norm",
                                                                    "norm_output", "context", "block_size")),
            json.dumps(extra or {}, default=str))


def scale_order(context: dict, rows: list[dict]) -> list[str]:
    """Data scales from smallest to largest: by the sizes the pipeline hands in, else by first appearance."""
    seen: list[str] = []
    for r in rows:
        if r.get("scale") is not None and r["scale"] not in seen:
            seen.append(r["scale"])
    sizes = context.get("data_sizes")
    if isinstance(sizes, dict) and all(isinstance(sizes.get(s), (int, float)) for s in seen):
        seen.sort(key=lambda s: sizes[s])
    return seen
