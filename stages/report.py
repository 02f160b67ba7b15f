"""report: paper-style tables with intervals, figures and findings from the metrics -> reports/README.md.

A pure function of the DVC-tracked metrics files (`metrics/stepwise/<study>.json`, `metrics/e2e.json`) and the
provenance the pipeline hands in: no tracking server is needed, and the same inputs give the same README (apart
from its date line) and the same PNG bytes (the bootstrap is seeded). MLflow holds the same numbers for browsing.

What it writes (DESIGN §4, §8, §10):
- a findings section: one verdict per claim of the paper, decided by the 95% interval of a difference
  (`stages.findings`), "inconclusive" when the interval straddles 0;
- per study two tables from pandas DataFrames (`stages.results`): **step accuracy** acc_k, step retention and
  step MAT (the paper-comparable family, its numbers beside ours where the setting matches,
  `stages/paper_numbers.yaml`), with the compute-matched baseline each drafter is compared with; and **chain
  acceptance** α_k, chain retention, chain MAT with the number of chains alive per k and the data/target agreement;
- `reports/figures/*.png`: acc_k and α_k vs k per study (bands: 95% intervals), step retention, τ and speedup.
Every cell is `value [95% interval]`; an interval is `[–]` where the metrics lack per-conversation counts.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import yaml

from stages.common import Paths, Report, atomic_path, filter_text, write_text_atomic
from stages.engine_report import ENGINE_METRICS, engine_section
from stages.findings import MISSING, Verdict, findings, fmt, fmt_ci, like_with_like
from stages.results import (LOOKUP_KIND, PAPER_TREE, E2EGroup, Results, Setting, collect, label, read_rows,
                            scale_order, sort_key, variant_name)
from stages.sections import ReportParams  # noqa: F401 (re-exported: the stage's own section)

PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.yaml")
PAPER_LABEL = "paper (Qwen3-8B)"
FEW_CHAINS = 100   # an α_k on fewer chains than this (binomial sd up to 0.05) is shown as "few chains", no value


def load_paper_numbers(path: Path = PAPER_NUMBERS) -> dict:
    """The paper's reference numbers (tables keyed by study), with their source."""
    return yaml.safe_load(Path(path).read_text())


# -- cells -----------------------------------------------------------------------------------------------------

def cell(s: Setting, name: str, level: float, pct: bool = False) -> str:
    """`value [lo, hi]` of one metric of a setting (percent for retentions)."""
    v, (lo, hi) = s.value(name), s.ci(name, level)
    if not math.isfinite(v):
        return "–"
    if pct:
        ci = f"[{lo * 100:.1f}, {hi * 100:.1f}]" if math.isfinite(lo) else "[–]"
        return f"{v * 100:.1f}% {ci}"
    return f"{v:.3f} {fmt_ci(lo, hi)}"


def _paper_row(paper: dict | None, fields: dict) -> dict | None:
    """The paper's row for a setting: every key its `match` names equal ours, and none of our controls or
    options it does not name (a plain "eagle3" row is not EAGLE-3 continued or EAGLE-3.1)."""
    for row in (paper or {}).get("rows", []):
        match = row.get("match")
        if not match or not all(fields.get(k) == v for k, v in match.items()):
            continue
        if any(fields.get(k) and k not in match for k in ("no_target", "fc_norm", "norm_output")):
            continue
        if fields.get("init") == "continued" and "init" not in match:
            continue
        return row
    return None


def _paper_cell(row: dict | None, name: str) -> str:
    if not row or row.get(name) is None:
        return "–"
    if name == "retention":
        return f"{row[name] * 100:.1f}%"
    return f"{row[name]:.3f}" if name.startswith("alpha_") else f"{row[name]:.2f}"


def md_table(frame: pd.DataFrame) -> str:
    return frame.to_markdown(index=False, disable_numparse=True)


# -- baselines: who each drafter is compared with -------------------------------------------------------------

def _same_data(a: Setting, b: Setting) -> bool:
    return a.fields.get("scale") == b.fields.get("scale") and a.extra == b.extra


def _eagle3(x: Setting, continued: bool) -> bool:
    """A measured EAGLE-3 setting (not EAGLE-3.1), continued or trained from scratch."""
    f = x.fields
    return bool(x.n) and f.get("variant") == "eagle3" and (f.get("init") == "continued") == continued \
        and not f.get("fc_norm") and not f.get("norm_output")


def baseline_for(s: Setting, settings: list[Setting]) -> Setting | None:
    """The compute-matched baseline of a setting: EAGLE-3 continued for a checkpoint-initialised drafter (and the
    EAGLE-3 it continues for EAGLE-3 continued itself), the EAGLE-3 trained from scratch for the rest."""
    f = s.fields
    plain = [x for x in settings if _eagle3(x, continued=False) and _same_data(s, x)]
    continued = [x for x in settings if _eagle3(x, continued=True) and _same_data(s, x)]
    if f.get("variant") == "eagle3" and not (f.get("init") == "continued" or f.get("fc_norm") or f.get("norm_output")):
        return None
    if f.get("variant") in ("hybrid", "cross_only") and f.get("init") == "ckpt":
        return continued[0] if continued else None
    parent = s.extra.get("train.parent") if isinstance(s.extra.get("train.parent"), dict) else None
    if f.get("init") == "continued" and parent:
        return _parent_eagle3(s, parent, settings)
    return plain[0] if plain else None


def _parent_eagle3(s: Setting, parent: dict, settings: list[Setting]) -> Setting | None:
    """The EAGLE-3 that EAGLE-3 continued started from when `train.parent` gave it other train settings (the small
    scale's, say): the plain EAGLE-3 of the parent's scale whose other swept settings are the parent's or none."""
    scale = parent.get("scale", s.fields.get("scale"))
    own = {f"train.{k}": v for k, v in parent.items() if k != "scale"}
    found = [x for x in settings if _eagle3(x, continued=False) and x.fields.get("scale") == scale
             and x.extra in ({}, own)]
    return found[0] if found else None


def _vs_cell(s: Setting, base: Setting | None, metric: str, level: float) -> str:
    if base is None or s.n == 0:
        return "–"
    from models.stats import interval

    s, base = like_with_like(s, base)       # one seed: against its own seed's baseline
    diff = s.value(metric) - base.value(metric)
    a, b = s.resampled(metric), base.resampled(metric)
    ci = interval(a - b, level) if a is not None and b is not None else (math.nan, math.nan)
    one = " (seed " + base.seed_labels[0] + ")" if base.n == 1 and base.seed_labels else ""
    return f"{variant_name(base.fields)}{one}: {diff:+.3f} {fmt_ci(*ci, signed=True)}"


# -- the study tables ------------------------------------------------------------------------------------------

def _method(f: dict) -> str:
    if f.get("variant") == "kv_only" and not f.get("no_target"):
        return f"KV-only, {str(f.get('injection') or '–').replace('_', ' ')}"
    return variant_name(f)


def _rope(f: dict) -> str:
    return "yes" if f.get("variant") == "kv_only" and f.get("rope_fix") and not f.get("no_target") else \
        "no" if f.get("variant") == "kv_only" and not f.get("no_target") else "–"


def _init(f: dict) -> str:
    if f.get("variant") not in ("hybrid", "cross_only"):
        return "–"
    return {"ckpt": "EAGLE-3 checkpoint", "random": "random"}.get(f.get("init"), str(f.get("init")))


LabelCols = list[tuple[str, Callable[[dict], str] | None]]
# Per study: the label columns and the step metrics of the paper's table of the same name.
STUDY_SHAPES: dict[str, tuple[LabelCols, tuple[str, ...]]] = {
    "injection": ([("method", _method), ("RoPE fix", _rope)], ("acc_0", "acc_6", "step_retention", "step_mat")),
    "depth": ([("drafter", variant_name), ("layers", lambda f: str(f.get("depth") or 1))],
              ("acc_0", "acc_3", "acc_6", "step_retention", "step_mat")),
    "hybrid": ([("variant", variant_name), ("init", _init)], ("acc_0", "acc_3", "acc_6", "step_retention", "step_mat")),
    "block": ([("drafter", None)], ("acc_0", "acc_3", "acc_6", "step_retention", "step_mat")),
}
GENERIC: tuple[LabelCols, tuple[str, ...]] = ([("setting", None)], ("acc_0", "acc_3", "acc_6", "step_retention",
                                                                     "step_mat"))
HEAD = {"acc_0": "acc_0", "acc_3": "acc_3", "acc_6": "acc_6", "step_retention": "step retention",
        "step_mat": "step MAT", "alpha_0": "α_0", "alpha_3": "α_3", "alpha_6": "α_6",
        "chain_retention": "chain retention", "chain_mat": "chain MAT"}
# The paper's α_k columns are compared with our step accuracy (DESIGN §4)
PAPER_OF = {"acc_0": "alpha_0", "acc_3": "alpha_3", "acc_6": "alpha_6", "step_retention": "retention",
            "step_mat": "mat"}


def _labels(cols: LabelCols, s: Setting) -> list[str]:
    out = [fn(s.fields) if fn else label(s) for _, fn in cols]
    if s.extra and cols[0][1]:
        out[0] += " (" + ", ".join(f"{k}={v}" for k, v in s.extra.items()) + ")"
    return out


OTHER_CODE = "‡"     # marks a setting whose rows were computed by other code than the rest of the report's


def main_code(studies: dict[str, list[Setting] | None]) -> str | None:
    """The code hash most of the report's trials were computed by (None: no row records one)."""
    counts: dict[str, int] = {}
    for settings in studies.values():
        for s in settings or []:
            for c in s.codes:
                counts[c] = counts.get(c, 0) + s.n
    return max(sorted(counts), key=counts.get) if counts else None


def on_other_code(s: Setting, main: str | None) -> bool:
    return main is not None and bool(s.codes) and s.codes != [main]


def _seeds(s: Setting, main: str | None = None) -> str:
    text = f"{s.n} ({len(s.failed)} failed)" if s.failed else str(s.n)
    return text + (f" {OTHER_CODE}" if on_other_code(s, main) else "")


def step_table(study: str, settings: list[Setting], paper: dict | None, level: float,
               main: str | None = None) -> str:
    """Step accuracy (the paper-comparable α_k) in the paper's shape, with each drafter's baseline difference."""
    cols, metrics = STUDY_SHAPES.get(study, GENERIC)
    with_vs = any(baseline_for(s, settings) is not None for s in settings)
    with_cost = study == "block" and any(math.isfinite(s.value("train_s_per_step")) for s in settings)
    records = []
    for s in settings:
        rec = dict(zip([c for c, _ in cols], _labels(cols, s)))
        rec["seeds"] = _seeds(s, main)
        for m in metrics:
            rec[HEAD[m]] = "failed" if s.n == 0 else cell(s, m, level, pct="retention" in m)
        if with_vs:
            rec["Δ step MAT vs baseline"] = _vs_cell(s, baseline_for(s, settings), "step_mat", level)
        if with_cost:
            steps, per = s.value("train_steps"), s.value("train_s_per_step")
            rec["training"] = f"{int(steps)} steps, {per:.2f} s/step" if math.isfinite(per) else "–"
        if paper:
            prow = _paper_row(paper, s.fields)
            for m in metrics:
                rec[f"{'α_' + m[4:] if m.startswith('acc_') else HEAD[m]} {PAPER_LABEL}"] = \
                    _paper_cell(prow, PAPER_OF[m])
        records.append(rec)
    return md_table(pd.DataFrame.from_records(records))


def chain_table(settings: list[Setting], level: float) -> str:
    """Chain acceptance α_k (what tree decoding sees), with the chains alive at each k."""
    records = []
    few = False
    for s in settings:
        rec = {"setting": label(s), "seeds": _seeds(s)}
        for k in (0, 3, 6):
            name = f"alpha_{k}"
            if s.n == 0:
                rec[HEAD[name]] = "failed"
                continue
            n = s.value(f"chains_{k}")
            if math.isfinite(n) and n < FEW_CHAINS:
                rec[HEAD[name]] = f"few chains (n={int(n)})"
                few = True
            else:
                rec[HEAD[name]] = cell(s, name, level)
        last = s.value(f"chains_{s.steps - 1}") if s.steps else math.nan
        if not s.n:
            rec["chain retention"] = "failed"
        elif math.isfinite(last) and last < FEW_CHAINS:
            rec["chain retention"] = f"few chains (n={int(last)} at k={s.steps - 1})"
            few = True
        else:
            rec["chain retention"] = cell(s, "chain_retention", level, pct=True)
        rec["chain MAT"] = cell(s, "chain_mat", level) if s.n else "failed"
        chains = [s.value(f"chains_{k}") for k in range(s.steps)]
        rec["chains k=0..6"] = " / ".join(str(int(c)) for c in chains if math.isfinite(c)) or "–"
        agree = s.value("agreement")
        rec["data = target top-1"] = f"{agree:.1%}" if math.isfinite(agree) else "–"
        records.append(rec)
    text = md_table(pd.DataFrame.from_records(records))
    if few:
        text += (f"\n\nfew chains (n=…): α_k is measured on the chains still alive at step k; on fewer than "
                 f"{FEW_CHAINS} its value is too uncertain to show (and so is the chain retention α_6/α_0), the count "
                 "is shown instead.")
    return text


def _paper_notes(paper: dict | None, names: tuple[str, ...], matched: set[int]) -> str:
    rows = [r for i, r in enumerate((paper or {}).get("rows", [])) if i not in matched]
    if not rows:
        return ""
    items = []
    for r in rows:
        vals = ", ".join(f"{n} {_paper_cell(r, n)}" for n in names if r.get(n) is not None)
        items.append(f"{r['label']}: {vals}")
    return f"Paper rows without a counterpart here ({PAPER_LABEL}): " + "; ".join(items) + "."


def _matched(paper: dict | None, fields_list: list[dict]) -> set[int]:
    rows = (paper or {}).get("rows", [])
    out = set()
    for f in fields_list:
        r = _paper_row(paper, f)
        if r is not None:
            out.add(next(i for i, x in enumerate(rows) if x is r))
    return out


def _tree(t: Any) -> str:
    """(3, 2, 5); one tree per decoded seed when their tuned trees differ: (2, 3, 5) / (4, 2, 8)."""
    if isinstance(t, list) and t and all(isinstance(x, list) for x in t):
        return " / ".join(_tree(x) for x in t)
    return "(" + ", ".join(str(x) for x in t) + ")" if isinstance(t, list) else "n/a"


def _kind_cell(g: E2EGroup | None, kind: str, name: str, level: float, digits: int = 2, suffix: str = "") -> str:
    if g is None or kind not in g.kinds:
        return "–"
    k = g.kinds[kind]
    v = k.point.get(name, math.nan)
    if not math.isfinite(v):
        return "–"
    lo, hi = k.ci(name, level)
    ci = f" {fmt_ci(lo, hi, digits)}" if name in ("tau", "speedup") else ""
    return f"{v:.{digits}f}{suffix}{ci}"


def scale_table(settings: list[Setting], e2e: list[E2EGroup], paper: dict | None, data_sizes: dict,
                level: float, labels: Callable[[dict], str] | None = None,
                pool: list[Setting] | None = None) -> str:
    """Variant x data scale: step MAT and its baseline difference, τ at the paper and tuned trees, speedup, ...
    (`labels` names a row's drafter; the scale study's names variant and init)."""
    def scale_cell(scale: Any) -> str:
        size = data_sizes.get(scale) if isinstance(data_sizes, dict) and scale is not None else None
        return "–" if scale is None else f"{scale} ({size})" if isinstance(size, (int, float)) else str(scale)

    def same(fields: dict, g: E2EGroup) -> bool:
        return all(g.fields.get(k) == fields.get(k) for k in fields)

    with_lookup = any(LOOKUP_KIND in g.kinds for g in e2e)
    used: set[int] = set()
    lines: list[tuple[dict, Setting | None, E2EGroup | None]] = []
    for s in settings:
        g = next((g for g in e2e if same(s.fields, g)), None)
        if g is not None:
            used.add(id(g))
        lines.append((s.fields, s, g))
    lines += [(g.fields, None, g) for g in e2e if id(g) not in used]
    records = []
    for fields, s, g in lines:
        prow = _paper_row(paper, fields)
        rec = {"drafter": labels(fields) if labels else variant_name(fields) + (
                   f", {fields['init']} init" if fields.get("variant") in ("hybrid", "cross_only")
                   and fields.get("init") else ""),
               "data scale": scale_cell(fields.get("scale")),
               # step-wise seeds, and how many of them were decoded when not all (the e2e columns' seeds)
               "seeds": (_seeds(s) + (f", {g.n_seeds} decoded" if g and g.n_seeds != s.n else "")) if s else "–",
               "step MAT": ("failed" if s.n == 0 else cell(s, "step_mat", level)) if s else "–",
               "Δ step MAT vs baseline": _vs_cell(s, baseline_for(s, pool or settings), "step_mat", level)
               if s else "–",
               f"τ {_tree(list(PAPER_TREE))}": _kind_cell(g, "paper", "tau", level),
               f"τ {_tree(list(PAPER_TREE))} {PAPER_LABEL}":
                   f"{prow['tau_paper_tree']:.2f}" if prow and prow.get("tau_paper_tree") is not None else "–",
               "tuned tree": _tree(g.kinds["tuned"].tree) if g and "tuned" in g.kinds else "–",
               "τ (tuned)": _kind_cell(g, "tuned", "tau", level),
               "speedup (tuned)": _kind_cell(g, "tuned", "speedup", level, suffix="x"),
               "drafting share": (f"{g.kinds['tuned'].point['draft_time_share']:.0%}"
                                  if g and "tuned" in g.kinds and math.isfinite(g.kinds['tuned'].point[
                                      'draft_time_share']) else "–"),
               "exact match": (f"{g.kinds['tuned'].point['exact_match']:.0%}"
                               if g and "tuned" in g.kinds and math.isfinite(g.kinds['tuned'].point['exact_match'])
                               else "–"),
               "lossless": "–" if g is None or g.lossless is None else ("yes" if g.lossless else "NO")}
        if g is None and s is not None:
            rec[f"τ {_tree(list(PAPER_TREE))}"] = "not decoded"
        if with_lookup:
            lk = g.kinds.get(LOOKUP_KIND) if g else None
            rec["speedup, tuned + lookup (τ)"] = (f"{lk.point['speedup']:.2f}x ({lk.point['tau']:.2f}) at "
                                                  f"{_tree(lk.tree)}" if lk else "–")
        records.append(rec)
    return md_table(pd.DataFrame.from_records(records))


def e2e_baselines(rows: list[dict]) -> str:
    """The baselines decoded in the same run as the drafters; rows decoded in several runs (a study decoded in
    parts) get one sentence per run, named by its trials, since each run's speedups are over its own greedy."""
    ok = [r for r in rows if r.get("status", "ok") == "ok"]
    runs: dict = {}
    for r in ok:   # every row of a run carries that run's one greedy measurement
        runs.setdefault(r.get("baseline_tokens_per_s"), []).append(r)
    if len(runs) <= 1:
        return _run_baselines(rows, "Baselines in the same run")
    return " ".join(_run_baselines(run, "Baselines in the run of " + ", ".join(
        sorted({str(r.get("trial")) for r in run}))) for run in runs.values())


def _run_baselines(rows: list[dict], lead: str) -> str:
    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r.get("status", "ok") == "ok"]
        return sum(vals) / len(vals) if vals else None

    parts = []
    if (base := mean("baseline_tokens_per_s")) is not None:
        parts.append(f"plain greedy `generate` {base:.1f} tokens/s (the speedup reference)")
        if (off := mean("spec_off_tokens_per_s")) is not None:
            parts.append(f"our loop with speculation off {off / base:.2f}x")
    if (pl := mean("prompt_lookup_speedup")) is not None:
        parts.append(f"transformers' prompt lookup {pl:.2f}x (τ {mean('prompt_lookup_tau'):.2f})")
    if (lk := mean("lookup_loop_speedup")) is not None:
        parts.append(f"n-gram lookup alone in our loop {lk:.2f}x (τ {mean('lookup_loop_tau'):.2f})")
    text = (f"{lead}: " + "; ".join(parts) + ".") if parts else ""
    if any(r.get("drafter_weights") == "int8" for r in rows):
        text += " The drafters ran with int8 weight-only linears (e2e.drafter_weights=int8)."
    return text.strip()


def e2e_check_note(rows: list[dict]) -> str:
    """What *lossless* and *exact match* mean for the rows decoded in bf16 (empty when every row is fp32, where
    lossless is exact equality)."""
    low = [r for r in rows if r.get("status", "ok") == "ok" and r.get("dtype") not in (None, "float32")]
    if not low:
        return ""
    tol = max(float(r.get("tie_tolerance") or 0.0) for r in low)
    gap = max(float(r.get("max_tie_gap") or 0.0) for r in low)
    return (f"Decoded in {low[0]['dtype']}: *exact match* is the share of prompts whose output equals plain greedy "
            f"decoding token for token; *lossless* means every other one departs from it only at a near tie of "
            f"the target (top-2 logit gap ≤ {tol:g}; the largest here {gap:.3f}). The reason: a verification pass "
            f"over several tokens rounds differently from one token at a time. In fp32 (`e2e.dtype=float32`) "
            f"lossless requires exact equality.")


# -- figures ---------------------------------------------------------------------------------------------------

def _figure(params: ReportParams, nrows: int = 1, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(nrows, ncols, figsize=(params.figure_width, params.figure_height), dpi=params.dpi)
    return plt, fig, ax


def _save(plt, fig, path: Path, params: ReportParams) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=params.dpi, metadata={"Software": None})   # same numbers, same bytes
    plt.close(fig)


def plot_steps(study: str, settings: list[Setting], paper: dict | None, path: Path, params: ReportParams) -> None:
    """acc_k (left, the paper's points hollow) and chain α_k (right) vs k, one line per setting, 95% bands."""
    plt, fig, (ax1, ax2) = _figure(params, 1, 2)
    fig.set_size_inches(params.figure_width * 1.6, params.figure_height)
    colors = plt.get_cmap("tab10").colors
    has_paper = False
    for i, s in enumerate(x for x in settings if x.n > 0):
        c = colors[i % len(colors)]
        for ax, family in ((ax1, "acc"), (ax2, "alpha")):
            ks = [k for k in range(s.steps) if math.isfinite(s.value(f"{family}_{k}"))]
            ys = [s.value(f"{family}_{k}") for k in ks]
            ax.plot(ks, ys, "-o", color=c, ms=3.5, lw=1.6, label=f"{label(s)} (n={s.n})")
            cis = [s.ci(f"{family}_{k}", params.level) for k in ks]
            if cis and all(math.isfinite(lo) for lo, _ in cis):
                ax.fill_between(ks, [lo for lo, _ in cis], [hi for _, hi in cis], color=c, alpha=0.15, lw=0)
        prow = _paper_row(paper, s.fields)
        pts = [(k, prow[f"alpha_{k}"]) for k in range(7) if prow and prow.get(f"alpha_{k}") is not None]
        if pts:
            has_paper = True
            ax1.plot(*zip(*pts), "o", mfc="none", mec=c, ms=7, mew=1.4)
    if has_paper:
        ax1.plot([], [], "o", mfc="none", mec="0.3", ms=7, label=f"hollow: {PAPER_LABEL} α_k")
    for ax, title, ylabel in ((ax1, "step accuracy acc_k (paper's α_k)", "acc_k"),
                              (ax2, "chain acceptance α_k", "α_k (chain)")):
        lo, hi = ax.dataLim.y0, ax.dataLim.y1
        pad = max(0.05, 0.1 * (hi - lo)) if math.isfinite(lo) and math.isfinite(hi) else 0.5
        ax.set(xlabel="speculative step k", ylabel=ylabel, title=f"{title} — {study}",
               ylim=(max(0.0, lo - pad), min(1.0, hi + pad)) if math.isfinite(lo) else (0, 1))
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=6, loc="best", ncol=2 if len(settings) > 4 else 1, framealpha=0.85)
    _save(plt, fig, path, params)


def plot_retention(studies: dict[str, list[Setting]], papers: dict, path: Path, params: ReportParams) -> None:
    """Step retention acc_6/acc_0 per setting of every study, 95% intervals, the paper's value as a black tick."""
    plt, fig, ax = _figure(params)
    labels, vals, lows, highs, marks = [], [], [], [], []
    for study, settings in studies.items():
        for s in settings:
            v = s.value("step_retention")
            if not math.isfinite(v):
                continue
            lo, hi = s.ci("step_retention", params.level)
            labels.append(f"{study}: {label(s)}")
            vals.append(v)
            lows.append(v - lo if math.isfinite(lo) else 0.0)
            highs.append(hi - v if math.isfinite(hi) else 0.0)
            prow = _paper_row(papers.get(study), s.fields)
            marks.append(prow.get("retention") if prow else None)
    y = list(range(len(labels)))[::-1]
    ax.barh(y, vals, xerr=[lows, highs], color="tab:blue", alpha=0.75, height=0.7, error_kw={"lw": 1})
    pts = [(m, yy) for m, yy in zip(marks, y) if m is not None]
    if pts:
        ax.plot(*zip(*pts), "|", color="black", ms=12, mew=2, label=PAPER_LABEL)
        ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(y, labels, fontsize=6 if len(labels) > 12 else 7)
    ax.set(xlabel="step retention acc_6 / acc_0", xlim=(0, max([1.05, *[v + h for v, h in zip(vals, highs)]])),
           title="Step retention per drafter (95% intervals)")
    ax.grid(axis="x", alpha=0.3)
    fig.set_size_inches(params.figure_width, max(params.figure_height, 0.28 * len(labels) + 1.2))
    _save(plt, fig, path, params)


def plot_e2e(groups: list[E2EGroup], path: Path, params: ReportParams) -> None:
    """τ at the paper and the tuned tree, and speedup at the tuned tree (with the lookup branch when decoded)."""
    plt, fig, (ax1, ax2) = _figure(params, 1, 2)
    names = [label(g, with_scale=True).replace(", ", "\n", 1) for g in groups]
    x = range(len(groups))

    def bars(ax, kinds, metric):
        w = 0.8 / len(kinds)
        for i, (kind, color, lab) in enumerate(kinds):
            vals, err_lo, err_hi = [], [], []
            for g in groups:
                k = g.kinds.get(kind)
                v = k.point.get(metric, math.nan) if k else math.nan
                lo, hi = k.ci(metric, params.level) if k else (math.nan, math.nan)
                vals.append(v if math.isfinite(v) else 0.0)
                err_lo.append(v - lo if math.isfinite(lo) else 0.0)
                err_hi.append(hi - v if math.isfinite(hi) else 0.0)
            ax.bar([j + (i - (len(kinds) - 1) / 2) * w for j in x], vals, w, yerr=[err_lo, err_hi], color=color,
                   label=lab, error_kw={"lw": 1})

    bars(ax1, [("paper", "tab:blue", f"tree {_tree(list(PAPER_TREE))}"), ("tuned", "tab:orange", "tuned tree")], "tau")
    ax1.set(ylabel="τ (accepted + 1 per round)", title="τ")
    kinds = [("tuned", "tab:green", "drafter")]
    if any(LOOKUP_KIND in g.kinds for g in groups):
        kinds.append((LOOKUP_KIND, "tab:purple", "drafter + lookup branch"))
    bars(ax2, kinds, "speedup")
    ax2.axhline(1.0, color="0.3", lw=1, ls="--")
    ax2.set(ylabel="speedup vs greedy", title="speedup (tuned tree)")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), names, fontsize=6, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    _save(plt, fig, path, params)


# -- the stage -------------------------------------------------------------------------------------------------

def _ctx(context: dict, key: str) -> str:
    v = context.get(key)
    if v is None or v == "" or v == {}:
        return "unknown"
    if key == "wall_time_s" and isinstance(v, (int, float)):
        return f"{v:.0f} s ({v / 60:.1f} min)"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {json.dumps(x) if isinstance(x, (dict, list)) else x}" for k, x in v.items())
    return str(v)


def _stage_times(times: dict) -> str:
    return ", ".join(f"{k} {v:.0f} s" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in sorted(times.items()))


def study_key(command: str, study: str, parts: dict | None = None) -> str:
    """The stage record key of `command` (sweep, e2e) for `study`, or for a part of it run with `--only`
    (parts: resolved KEY -> values): `sweep:STUDY --only KEY=V1,V2`."""
    only = sorted((parts or {}).items())
    return f"{command}:{study}" + "".join(f" --only {k}={','.join(map(str, vs))}" for k, vs in only)


def study_entries(record: dict, command: str, study: str) -> list:
    """What a stage record (timings, machines) holds for `command` (sweep, e2e) of `study`: its whole run's entry
    and those of its parts (`sweep:STUDY --only KEY=V`, run in one workspace one after the other)."""
    key = study_key(command, study)
    return [v for k, v in record.items() if k == key or k.startswith(key + " --only ")]


def study_time(times: dict, command: str, study: str) -> float | None:
    """Seconds `command` took for `study`, its parts summed; None when none is recorded."""
    parts = [v for v in study_entries(times, command, study) if isinstance(v, (int, float))]
    return round(sum(parts), 1) if parts else None


def _study_provenance(res: Results, context: dict) -> pd.DataFrame:
    """Per study: trials, the commits its rows came from, its wall time (the sweep command's, else the sum of its
    trials' own), the time its end-to-end decoding took (when it decoded alone) and the machine its sweep ran on
    (studies combined from several workspaces ran on several)."""
    times = context.get("stage_times_s") if isinstance(context.get("stage_times_s"), dict) else {}
    machines = context.get("stage_machines") if isinstance(context.get("stage_machines"), dict) else {}
    records = []
    for name in res.names:
        rows = res.raw.get(name)
        if rows is None:
            continue
        commits = sorted({str(r.get("git_commit")) for r in rows if r.get("git_commit")})
        wall = study_time(times, "sweep", name)
        trained = [r.get("wall_s") for r in rows if isinstance(r.get("wall_s"), (int, float)) and not r.get("cached")
                   and not r.get("reused_from")]
        wall_text = f"{wall / 60:.1f} min (sweep)" if isinstance(wall, (int, float)) else \
            f"{sum(trained) / 60:.1f} min (sum of trials)" if trained else "unknown"
        decoding = study_time(times, "e2e", name)
        codes = sorted({str(r.get("code"))[:12] for r in rows if r.get("code")})
        records.append({"study": name, "trials": str(len(rows)), "commits": ", ".join(commits) or "unknown",
                        "code": ", ".join(codes) + (f" ({sum(not r.get('code') for r in rows)} rows not recorded)"
                                                     if codes and not all(r.get("code") for r in rows) else "")
                        or "not recorded",
                        "wall time": wall_text,
                        "end to end": f"{decoding / 60:.1f} min" if isinstance(decoding, (int, float)) else "–",
                        "machine": "; ".join(sorted(set(map(str, study_entries(machines, "sweep", name)))))
                        or "not recorded"})
    return pd.DataFrame.from_records(records, columns=["study", "trials", "commits", "code", "wall time",
                                                       "end to end", "machine"])


def _not_run_yet(context: dict, measured: set[str]) -> list[list[str]]:
    """Trials the profile plans in a study that has metrics but for which no row of their settings exists yet (the
    parts' `missing` trials, `pipeline.budget`): one problem row each, naming the part that runs it."""
    replayed = context.get("parts_replayed") if isinstance(context.get("parts_replayed"), dict) else {}
    out, seen = [], set()
    for key, got in replayed.items():
        study, _, part = key.partition("/")
        for trial in (got.get("missing") or []) if isinstance(got, dict) and study in measured else []:
            if (study, trial) not in seen:
                seen.add((study, trial))
                where = f"`kvshot repro --part {study}/{part}`" if part != "(whole)" else f"study {study}"
                out.append([study, str(trial), "–", "not run yet", f"planned by the profile; {where} runs it"])
    return out


def _replayed_text(got: dict) -> str:
    """A part's trials replayed as one sweep: measured, or with the trials that have no row yet estimated from
    the paces of their drafter settings (`pipeline.budget.estimated_seconds`)."""
    if isinstance(got.get("replayed_s"), (int, float)):
        return f"{got['replayed_s'] / 60:.1f} min"
    if isinstance(got.get("estimated_s"), (int, float)):
        n = len(got.get("estimated") or [])
        return f"about {got['estimated_s'] / 60:.0f} min ({n} of {got.get('trials', '?')} trials not run yet, " \
               f"estimated from paces)"
    return "–"


def _parts_provenance(context: dict, budget_min: float | None) -> pd.DataFrame:
    """Per study part (`studies.STUDY.parts`; a study without parts is one, `(whole)`): its filter, its trials'
    measured times replayed as one sweep (`parts_replayed`) and, when it ran in one go (`kvshot repro --part`),
    that run's wall time, the data stages' share, whether the workspace was fresh, and where and at which
    commit."""
    parts = context.get("study_parts") if isinstance(context.get("study_parts"), dict) else {}
    runs = context.get("parts_run") if isinstance(context.get("parts_run"), dict) else {}
    replayed = context.get("parts_replayed") if isinstance(context.get("parts_replayed"), dict) else {}
    if not parts:
        return pd.DataFrame()
    named_parts = {study: parts.get(study) or {"(whole)": {}} for study in context.get("studies") or parts}
    records = []
    for study, named in named_parts.items():
        for name, only in named.items():
            run = runs.get(f"{study}/{name}")
            got = replayed.get(f"{study}/{name}") or {}
            row = {"study": study, "part": name,
                   "filter": filter_text(only or {}) or "–",
                   "trials": str(got.get("trials", "–")),
                   "trials' times replayed": _replayed_text(got)}
            if isinstance(run, dict) and isinstance(run.get("wall_s"), (int, float)):
                wall, data = run["wall_s"] / 60, float(run.get("data_stages_s") or 0) / 60
                row.update({"wall time (one go)": f"{wall:.1f} min",
                            "data stages": f"{data:.1f} min" + (", fresh workspace" if run.get("fresh") else
                                                                ", already there"),
                            "commit": str(run.get("commit", "unknown")), "machine": str(run.get("machine", "unknown"))})
                if budget_min is not None:
                    row["within budget"] = ("yes" if wall <= budget_min else "no") if run.get("fresh") else \
                        "– (not from a fresh workspace)"
            else:
                row.update({"wall time (one go)": "not run in one go", "data stages": "–", "commit": "–",
                            "machine": "–"})
                if budget_min is not None:
                    row["within budget"] = "–"
            records.append(row)
    return pd.DataFrame.from_records(records)


TITLES = {"injection": "Injection study (KV-only, 1 layer)", "depth": "Depth study (KV-only vs EAGLE-3)",
          "hybrid": "Hybrid study (hybrid and cross-only vs EAGLE-3)", "scale": "Scale study (end to end)",
          "block": "Block study (block-wise drafters vs autoregressive ones, equal training steps)"}


NOT_DECIDED = "not decided at this training length"
DEMO_FRACTION = 0.5     # trials trained less than this share of `decisive_steps` make every verdict a demonstration


def trained_steps(studies: dict[str, list[Setting] | None]) -> float:
    """The median optimizer steps of the trials behind the report's settings (NaN: not recorded)."""
    steps = [s.value("train_steps") for settings in studies.values() for s in settings or [] if s.n]
    steps = [x for x in steps if math.isfinite(x)]
    return float(pd.Series(steps).median()) if steps else math.nan


def run(params: ReportParams, context: dict, paths: Paths, report: Report) -> None:
    """Read the metrics JSON, write reports/README.md and reports/figures/*.png (atomically)."""
    context = dict(context or {})
    papers = load_paper_numbers()
    tables = papers.get("tables", {})
    res = collect(context, paths, draws=params.bootstrap_draws, level=params.level)
    order = scale_order(context, [r for rows in res.raw.values() for r in rows or []] + (res.e2e_rows or []))
    studies = {n: sorted(s, key=lambda x: sort_key(x.fields, order, x.extra)) if s is not None else None
               for n, s in res.studies.items()}
    e2e = sorted(res.e2e or [], key=lambda g: sort_key(g.fields, order))
    verdicts = findings(studies, e2e if res.e2e is not None else None, order, params.much_smaller_ratio, params.level)
    code = main_code(studies)

    fig_dir = paths.reports / "figures"
    written: list[str] = []

    def figure(name: str, draw: Callable[[Path], None]) -> str:
        draw(fig_dir / name)
        written.append(name)
        return f"figures/{name}"

    pct = round(params.level * 100)
    md = [f"# {params.title}", "",
          "Step-wise and end-to-end results of the KVShot drafter grid, read from the DVC-tracked metrics files "
          f"listed under Provenance. Every cell is `value [{pct}% interval]`: a bootstrap over the held-out "
          "conversations (over e2e prompts for τ and speedup), over the seeds too where a setting has several "
          "(pooled in the value); `[–]` where the metrics hold no per-conversation counts. Two metric families, "
          "never mixed: **step accuracy** acc_k (unconditional, teacher-forced: the paper's α_k, so the paper's "
          f"columns, marked **{PAPER_LABEL}**, sit beside it) and **chain acceptance** α_k (conditional on every "
          "earlier step, stopping where the data leaves the target's greedy path: what tree decoding sees). The "
          "paper's target and data scale differ from ours: compare shapes and orderings, not absolute values.", "",
          "## Findings", "",
          f"A claim *holds* or *does not hold* only when the {pct}% interval of its difference excludes 0; "
          "otherwise it is *inconclusive* (the interval is in the evidence); *not measured*: no data. Drafters "
          "initialised from a trained EAGLE-3 are compared with EAGLE-3 continued for the same schedule "
          "(compute-matched), never with the EAGLE-3 they started from.", ""]
    steps = trained_steps(studies)
    demo = params.decisive_steps is not None and math.isfinite(steps) and steps < DEMO_FRACTION * params.decisive_steps
    if demo:
        md += [f"**A demonstration, not a decision.** These drafters trained {steps:.0f} optimizer steps (median over "
               f"trials), {steps / params.decisive_steps:.0%} of the {params.decisive_steps} that decide a claim "
               "(the study profile's): no verdict below says anything about the paper's claims; each says what its "
               "interval would read, marked *not decided at this training length*. The decisions are in the study "
               "profile's report.", ""]
    shown = [f"**{NOT_DECIDED}** (interval: {v.verdict})" if demo and v.verdict != MISSING else f"**{v.verdict}**"
             for v in verdicts]
    md.append(md_table(pd.DataFrame([[v.claim, v.statement, text, v.evidence] for v, text in zip(verdicts, shown)],
                                    columns=["claim", "statement", "verdict", "evidence"])))
    md.append("")

    for name in res.names:
        md += [f"## {TITLES.get(name, f'Study: {name}')}", ""]
        settings = studies[name]
        paper = tables.get(name)
        if paper:
            md += [f"Paper: {paper['title']}; {paper['data']}.", ""]
        if settings is None:
            md += [f"**missing**: no `{paths.stepwise_metrics(name).relative_to(paths.root)}` "
                   "(the study is configured but produced no metrics).", ""]
            if name != "scale":
                continue
        matched = _matched(paper, [s.fields for s in settings or []])
        own = [g for g in e2e if name in g.studies]
        if name == "scale":
            if res.e2e is None:
                md += ["**missing**: no `metrics/e2e.json` (nothing was decoded end to end).", ""]
            elsewhere = {s for g in e2e for s in g.studies if s != "scale" and s in res.names}
            shown = [g for g in e2e if "scale" in g.studies or not (g.studies & elsewhere)]
            md += [scale_table(settings or [], shown, paper, context.get("data_sizes") or {}, params.level), ""]
            rows = [r for r in res.e2e_rows or [] if r.get("study") not in elsewhere]
            md += [x for text in (e2e_baselines(rows), e2e_check_note(rows)) if text for x in (text, "")]
            note = _paper_notes(paper, ("tau_paper_tree",), matched)
            md += [x for x in (note, (paper or {}).get("note", "").strip()) if x]
            md.append("")
            if e2e:
                md += [f"![τ and speedup]({figure('e2e.png', lambda p: plot_e2e(e2e, p, params))})", ""]
        if settings:
            if name != "scale":
                md += ["Step accuracy (the paper-comparable α_k):", "", step_table(name, settings, paper,
                                                                                  params.level, code), ""]
                if any(on_other_code(s, code) for s in settings):
                    md += [f"{OTHER_CODE}: computed by other code than the rest of this report (code hash "
                           f"{', '.join(c[:12] for s in settings if on_other_code(s, code) for c in s.codes)} "
                           f"against {code[:12]}): its numbers may not be comparable; rerunning its part "
                           "retrains it.", ""]
            if name != "scale" and own:
                decoded = [s for s in settings if any(all(g.fields.get(k) == s.fields.get(k) for k in s.fields)
                                                      for g in own)]
                md += ["End to end (lossless tree decoding):", "",
                       scale_table(decoded, own, None, context.get("data_sizes") or {}, params.level,
                                   labels=lambda f: label(Setting(name, f, {}, [], 0, [], {})), pool=settings), ""]
                rows = [r for r in res.e2e_rows or [] if r.get("study") == name]
                md += [x for text in (e2e_baselines(rows), e2e_check_note(rows)) if text for x in (text, "")]
                note = _paper_notes(paper, ("alpha_0", "alpha_3", "alpha_6", "retention", "mat"), matched)
                if note:
                    md += [note, ""]
            md += ["Chain acceptance (what tree decoding sees):", "", chain_table(settings, params.level), ""]
            if any(s.n > 0 for s in settings):
                img = figure(f"alpha_{name}.png", lambda p: plot_steps(name, settings, paper, p, params))
                md += [f"![acc_k and α_k vs k, {name} study]({img})", ""]

    engine_file = paths.root / ENGINE_METRICS
    md += engine_section(read_rows(engine_file) if engine_file.is_file() else None, params.level)

    present = {n: s for n, s in studies.items() if s}
    if any(math.isfinite(s.value("step_retention")) for ss in present.values() for s in ss):
        img = figure("retention.png", lambda p: plot_retention(present, tables, p, params))
        md += ["## Retention", "", f"![step retention per drafter]({img})", ""]

    md += ["## Failed and missing trials", ""]
    problems = [[n, "–", "–", "missing", f"no {paths.stepwise_metrics(n).relative_to(paths.root)}"]
                for n in res.names if res.raw[n] is None]
    for n in res.names:
        for s in studies[n] or []:
            problems += [[n, str(r.get("trial")), label(s), "failed", str(r["error"]).splitlines()[0][:200]]
                         for r in sorted(s.failed, key=lambda r: str(r.get("trial")))]
    problems += _not_run_yet(context, {n for n in res.names if res.raw[n] is not None})
    if res.e2e_rows is None:
        problems.append(["e2e", "–", "–", "missing", "no metrics/e2e.json"])
    else:
        problems += [["e2e", str(r.get("trial")), variant_name({"variant": r.get("variant")}), "failed",
                      str(r.get("error") or "no tau").splitlines()[0][:200]]
                     for r in res.e2e_rows if r.get("status", "ok") != "ok" or r.get("tau") is None]
    md += [md_table(pd.DataFrame(problems, columns=["study", "trial", "setting", "state", "error"]))
           if problems else "None.", ""]

    prov = [["profile", _ctx(context, "profile")], ["target", _ctx(context, "target")],
            ["data sizes", _ctx(context, "data_sizes")], ["git commit", _ctx(context, "git_commit")],
            ["date", _ctx(context, "date")], ["hardware", _ctx(context, "hardware")],
            ["total wall time", _ctx(context, "wall_time_s")]]
    if context.get("regenerated"):   # `kvshot study-results`: written elsewhere than its rows were measured
        prov.insert(3, ["report", "regenerated from committed metrics (`kvshot study-results`): the commit, date "
                                  "and hardware below are the regeneration's; each study's machine is in the "
                                  "per-study table"])
    if isinstance(context.get("stage_times_s"), dict) and context["stage_times_s"]:
        prov.append(["stage wall times", _stage_times(context["stage_times_s"])])
    prov += [["studies configured", ", ".join(res.configured) or "unknown"],
             ["intervals", f"{pct}% percentile bootstrap, {params.bootstrap_draws} draws, seeded"],
             *[[f"input `{p}`", f"sha256 {h}"] for p, h in res.inputs],
             ["paper numbers", " ".join(str(papers.get("source", "")).split())]]
    md += ["## Provenance", "", md_table(pd.DataFrame(prov, columns=["item", "value"])), ""]
    studies_prov = _study_provenance(res, context)
    if len(studies_prov):
        md += ["Per study:", "", md_table(studies_prov), ""]
    parts_prov = _parts_provenance(context, params.budget_min)
    if len(parts_prov):
        budget = f" (the budget: {params.budget_min:g} min each, from a fresh workspace)" if params.budget_min else ""
        md += [f"Per part: each part of a study runs in one go with `kvshot repro --part STUDY/PART`{budget}; "
               "its trials' times replayed: the wall times its trials' rows record, wherever they ran, replayed as "
               "one sweep (`ray.max_concurrent` at a time, each child after its parent), before its data stages "
               "and its decoding (a trial with no row yet at the seconds per step of its setting's rows, times its "
               "own steps):", "", md_table(parts_prov), ""]

    for stale in sorted(fig_dir.glob("*.png")) if fig_dir.is_dir() else []:
        if stale.name not in written:   # a figure of a study that is gone must not linger
            stale.unlink()
    write_text_atomic(paths.reports / "README.md", "\n".join(md))
    n_failed = sum(len(s.failed) for ss in present.values() for s in ss)
    report({"report/settings": float(sum(len(s) for s in present.values())), "report/failed_trials": float(n_failed),
            "report/claims_holding": float(0 if demo else sum(v.verdict == "holds" for v in verdicts))})


__all__ = ["MISSING", "ReportParams", "Verdict", "e2e_baselines", "e2e_check_note", "load_paper_numbers", "run"]
