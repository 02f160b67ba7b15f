"""report: paper-style tables with intervals, figures and findings from the metrics -> reports/README.md.

A pure function of the DVC-tracked metrics files (`metrics/stepwise/<study>.json`, `metrics/e2e.json`) and the
provenance the pipeline hands in: no tracking server is needed, and the same inputs give the same README (apart
from its date line) and the same PNG bytes (the bootstrap is seeded). MLflow holds the same numbers for browsing.

What it writes (DESIGN §4, §8, §10):
- a findings section (`stages.report_findings`): one verdict per claim of the paper, decided by the 95% interval
  of a difference (`stages.findings`), "inconclusive" when the interval straddles 0, and beside it the claims
  decided together (Holm's step-down);
- per study two tables from pandas DataFrames (`stages.results`): **step accuracy** acc_k, step retention and
  step MAT (the paper-comparable family, its numbers beside ours where the setting matches,
  `stages/paper_numbers.yaml`), with the compute-matched baseline each drafter is compared with
  (`stages.baselines`); and **chain acceptance** α_k, chain retention, chain MAT with the number of chains alive
  per k and the data/target agreement;
- `reports/figures/*.png` (`stages.report_figures`): acc_k and α_k vs k per study (bands: 95% intervals), step
  retention, τ and speedup.
Every cell is `value [95% interval]` (`stages.report_cells`); an interval is `[–]` where the metrics lack
per-conversation counts. `run` assembles the README from named sections, one function each; the serving engines'
section is `stages.engine_report`'s, the provenance tables `stages.report_provenance`'s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import yaml

from stages.baselines import baseline_for, difference
from stages.common import Paths, Report, write_text_atomic
from stages.engine_report import ENGINE_METRICS, engine_section
from stages.findings import MISSING, Verdict, fmt_ci
from stages.report_cells import PAPER_LABEL, cell, md_table, paper_cell, paper_row, tree_text
from stages.report_figures import FigureDir, plot_e2e, plot_retention, plot_steps
from stages.report_findings import demonstration_steps, findings_section, verdicts
from stages.report_provenance import (OTHER_CODE, main_code, not_run_yet, on_other_code, parts_provenance,
                                      planned_not_run, provenance_table, study_provenance)
from stages.report_validation import is_validation, validation_section
from stages.results import (LOOKUP_KIND, PAPER_TREE, E2EGroup, Results, Setting, collect, label, read_rows,
                            scale_order, sort_key, variant_name)
from stages.sections import CKPT_CHILDREN, ReportParams  # noqa: F401 (ReportParams re-exported: the stage's own section)

PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.yaml")
FEW_CHAINS = 100   # an α_k on fewer chains than this (binomial sd up to 0.05) is shown as "few chains", no value


def load_paper_numbers(path: Path = PAPER_NUMBERS) -> dict:
    """The paper's reference numbers (tables keyed by study), with their source."""
    return yaml.safe_load(Path(path).read_text())


def _vs_cell(s: Setting, base: Setting | None, metric: str, level: float) -> str:
    """A setting's difference from its baseline (`stages.baselines`), naming the baseline and, when only one seed
    of it was compared, that seed."""
    if base is None or s.n == 0:
        return "–"
    d = difference(s, base, metric, level)
    one = " (seed " + d.baseline.seed_labels[0] + ")" if d.baseline.n == 1 and d.baseline.seed_labels else ""
    f = d.baseline.fields
    name = f"block, {f.get('context') or 'hidden'} context" if f.get("variant") == "block" else variant_name(f)
    return f"{name}{one}: {d.value:+.3f} {fmt_ci(*d.interval, signed=True)}"


# -- the study tables ------------------------------------------------------------------------------------------

def _method(f: dict) -> str:
    if f.get("variant") == "kv_only" and not f.get("no_target"):
        return f"KV-only, {str(f.get('injection') or '–').replace('_', ' ')}"
    return variant_name(f)


def _rope(f: dict) -> str:
    return "yes" if f.get("variant") == "kv_only" and f.get("rope_fix") and not f.get("no_target") else \
        "no" if f.get("variant") == "kv_only" and not f.get("no_target") else "–"


def _init(f: dict) -> str:
    if f.get("variant") not in CKPT_CHILDREN:
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
            prow = paper_row(paper, s.fields)
            for m in metrics:
                rec[f"{'α_' + m[4:] if m.startswith('acc_') else HEAD[m]} {PAPER_LABEL}"] = \
                    paper_cell(prow, PAPER_OF[m])
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
        text += ("\n\nfew chains (n=…): α_k is measured on the chains still alive at step k; on fewer than "
                 f"{FEW_CHAINS} its value is too uncertain to show (and so is the chain retention α_6/α_0), the "
                 "count is shown instead.")
    return text


def _paper_notes(paper: dict | None, names: tuple[str, ...], matched: set[int]) -> str:
    rows = [r for i, r in enumerate((paper or {}).get("rows", [])) if i not in matched]
    if not rows:
        return ""
    items = []
    for r in rows:
        vals = ", ".join(f"{n} {paper_cell(r, n)}" for n in names if r.get(n) is not None)
        items.append(f"{r['label']}: {vals}")
    return f"Paper rows without a counterpart here ({PAPER_LABEL}): " + "; ".join(items) + "."


def matched_rows(paper: dict | None, fields_list: list[dict]) -> set[int]:
    rows = (paper or {}).get("rows", [])
    out = set()
    for f in fields_list:
        r = paper_row(paper, f)
        if r is not None:
            out.add(next(i for i, x in enumerate(rows) if x is r))
    return out


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
        prow = paper_row(paper, fields)
        rec = {"drafter": labels(fields) if labels else variant_name(fields) + (
                   f", {fields['init']} init" if fields.get("variant") in CKPT_CHILDREN
                   and fields.get("init") else ""),
               "data scale": scale_cell(fields.get("scale")),
               # step-wise seeds, and how many of them were decoded when not all (the e2e columns' seeds)
               "seeds": (_seeds(s) + (f", {g.n_seeds} decoded" if g and g.n_seeds != s.n else "")) if s else "–",
               "step MAT": ("failed" if s.n == 0 else cell(s, "step_mat", level)) if s else "–",
               "Δ step MAT vs baseline": _vs_cell(s, baseline_for(s, pool or settings), "step_mat", level)
               if s else "–",
               f"τ {tree_text(list(PAPER_TREE))}": _kind_cell(g, "paper", "tau", level),
               f"τ {tree_text(list(PAPER_TREE))} {PAPER_LABEL}":
                   f"{prow['tau_paper_tree']:.2f}" if prow and prow.get("tau_paper_tree") is not None else "–",
               "tuned tree": tree_text(g.kinds["tuned"].tree) if g and "tuned" in g.kinds else "–",
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
            rec[f"τ {tree_text(list(PAPER_TREE))}"] = "not decoded"
        if with_lookup:
            lk = g.kinds.get(LOOKUP_KIND) if g else None
            rec["speedup, tuned + lookup (τ)"] = (f"{lk.point['speedup']:.2f}x ({lk.point['tau']:.2f}) at "
                                                  f"{tree_text(lk.tree)}" if lk else "–")
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


# -- the sections ----------------------------------------------------------------------------------------------

TITLES = {"injection": "Injection study (KV-only, 1 layer)", "depth": "Depth study (KV-only vs EAGLE-3)",
          "hybrid": "Hybrid study (hybrid and cross-only vs EAGLE-3)", "scale": "Scale study (end to end)",
          "block": "Block study (block-wise drafters vs autoregressive ones, equal training steps)"}
# The study whose drafters are compared end to end across data scales: its table is variant x data scale (step MAT
# beside τ and speedup), not the step accuracy table the other studies get, and it holds the e2e rows of drafters
# decoded outside any other study.
SCALE_STUDY = "scale"

@dataclass(frozen=True)
class Inputs:
    """What the sections read: the stage's params and provenance, the paper's numbers, and the metrics collected
    into settings and e2e groups, sorted for display (variant, then data scale smallest first)."""
    params: ReportParams
    context: dict
    paths: Paths
    papers: dict                                  # stages/paper_numbers.yaml: the paper's tables and their source
    res: Results
    studies: dict[str, list[Setting] | None]      # None: the study's metrics file is missing
    validation: dict[str, list[Setting]]          # studies evaluated on a validation set (not in `studies`)
    e2e: list[E2EGroup]
    scales: list[str]                             # data scales, smallest first
    code: str | None                              # the code hash most of the report's trials were computed by
    figures: FigureDir

    @property
    def tables(self) -> dict:
        """The paper's tables, keyed by study."""
        return self.papers.get("tables", {})

    @property
    def present(self) -> dict[str, list[Setting]]:
        """The studies with at least one setting."""
        return {n: s for n, s in self.studies.items() if s}


def read_inputs(params: ReportParams, context: dict, paths: Paths) -> Inputs:
    """Collect and resample the metrics files under `paths` (the bootstrap is seeded: same files, same
    intervals) and sort every study's settings for display."""
    context = dict(context or {})
    papers = load_paper_numbers()
    res = collect(context, paths, draws=params.bootstrap_draws, level=params.level)
    scales = scale_order(context, [r for rows in res.raw.values() for r in rows or []] + (res.e2e_rows or []))
    studies = {n: sorted(s, key=lambda x: sort_key(x.fields, scales, x.extra)) if s is not None else None
               for n, s in res.studies.items()}
    validation = {n: studies.pop(n) or [] for n in list(studies) if is_validation(res.raw.get(n))}
    e2e = sorted(res.e2e or [], key=lambda g: sort_key(g.fields, scales))
    return Inputs(params, context, paths, papers, res, studies, validation, e2e, scales, main_code(studies),
                  FigureDir(paths.reports / "figures"))


def _introduction(params: ReportParams) -> list[str]:
    pct = round(params.level * 100)
    return [f"# {params.title}", "",
            "Step-wise and end-to-end results of the KVShot drafter grid, read from the DVC-tracked metrics files "
            f"listed under Provenance. Every cell is `value [{pct}% interval]`: a bootstrap over the held-out "
            "conversations (over e2e prompts for τ and speedup), over the seeds too where a setting has several "
            "(pooled in the value); `[–]` where the metrics hold no per-conversation counts. Two metric families, "
            "never mixed: **step accuracy** acc_k (unconditional, teacher-forced: the paper's α_k, so the paper's "
            f"columns, marked **{PAPER_LABEL}**, sit beside it) and **chain acceptance** α_k (conditional on every "
            "earlier step, stopping where the data leaves the target's greedy path: what tree decoding sees). The "
            "paper's target and data scale differ from ours: compare shapes and orderings, not absolute values. "
            "Every term (acc_k, chain α_k, step MAT, τ, tree, compute-matched, fingerprint, part, verdict) is "
            "defined in the repository's glossary, `docs/glossary.md`.", ""]


def _study_section(inp: Inputs, name: str) -> list[str]:
    """A study's heading and the paper table it follows, then its tables: the scale study's variant x data scale
    table, or step accuracy (and end to end for its decoded drafters); chain acceptance for every study."""
    settings, paper = inp.studies[name], inp.tables.get(name)
    md = [f"## {TITLES.get(name, f'Study: {name}')}", ""]
    if paper:
        md += [f"Paper: {paper['title']}; {paper['data']}.", ""]
    if settings is None:
        md += [f"**missing**: no `{inp.paths.stepwise_metrics(name).relative_to(inp.paths.root)}` "
               "(the study is configured but produced no metrics).", ""]
    matched = matched_rows(paper, [s.fields for s in settings or []])
    if name == SCALE_STUDY:   # its end-to-end table stands even without step-wise metrics
        md += _scale_study_section(inp, settings or [], paper, matched)
    elif settings:
        md += _step_accuracy_section(inp, name, settings, paper)
        md += _end_to_end_section(inp, name, settings, paper, matched)
    if settings:
        md += _chain_section(inp, name, settings, paper)
    return md


def _run_notes(rows: list[dict]) -> list[str]:
    """The baselines decoded beside the drafters and, in bf16, what lossless means: a paragraph each."""
    return [x for text in (e2e_baselines(rows), e2e_check_note(rows)) if text for x in (text, "")]


def _scale_study_section(inp: Inputs, settings: list[Setting], paper: dict | None, matched: set[int]) -> list[str]:
    """Variant x data scale, with every e2e group not shown in another study's end-to-end table (a study decoded
    on its own keeps its rows there), and the τ/speedup figure of every decoded drafter."""
    res, params = inp.res, inp.params
    md = []
    if res.e2e is None:
        md += ["**missing**: no `metrics/e2e.json` (nothing was decoded end to end).", ""]
    elsewhere = {s for g in inp.e2e for s in g.studies if s != SCALE_STUDY and s in res.names}
    shown = [g for g in inp.e2e if SCALE_STUDY in g.studies or not (g.studies & elsewhere)]
    md += [scale_table(settings, shown, paper, inp.context.get("data_sizes") or {}, params.level), ""]
    md += _run_notes([r for r in res.e2e_rows or [] if r.get("study") not in elsewhere])
    note = _paper_notes(paper, ("tau_paper_tree",), matched)
    md += [x for x in (note, (paper or {}).get("note", "").strip()) if x]
    md.append("")
    if inp.e2e:
        img = inp.figures.add("e2e.png", lambda p: plot_e2e(inp.e2e, p, params))
        md += [f"![τ and speedup]({img})", ""]
    return md


def _step_accuracy_section(inp: Inputs, name: str, settings: list[Setting], paper: dict | None) -> list[str]:
    """The paper-comparable table, with a note on rows computed by other code than the rest of the report's."""
    code = inp.code
    md = ["Step accuracy (the paper-comparable α_k):", "",
          step_table(name, settings, paper, inp.params.level, code), ""]
    if any(on_other_code(s, code) for s in settings):
        md += [f"{OTHER_CODE}: computed by other code than the rest of this report (code hash "
               f"{', '.join(c[:12] for s in settings if on_other_code(s, code) for c in s.codes)} "
               f"against {code[:12]}): its numbers may not be comparable; rerunning its part retrains it.", ""]
    return md


def _end_to_end_section(inp: Inputs, name: str, settings: list[Setting], paper: dict | None,
                        matched: set[int]) -> list[str]:
    """The study's drafters decoded end to end (none: no section), each compared with its baseline among all the
    study's settings, and the paper rows no setting of ours matched."""
    own = [g for g in inp.e2e if name in g.studies]
    if not own:
        return []
    decoded = [s for s in settings if any(all(g.fields.get(k) == s.fields.get(k) for k in s.fields) for g in own)]
    md = ["End to end (lossless tree decoding):", "",
          scale_table(decoded, own, None, inp.context.get("data_sizes") or {}, inp.params.level,
                      labels=lambda f: label(Setting(name, f, {}, [], 0, [], {})), pool=settings), ""]
    md += _run_notes([r for r in inp.res.e2e_rows or [] if r.get("study") == name])
    note = _paper_notes(paper, ("alpha_0", "alpha_3", "alpha_6", "retention", "mat"), matched)
    if note:
        md += [note, ""]
    return md


def _chain_section(inp: Inputs, name: str, settings: list[Setting], paper: dict | None) -> list[str]:
    """Chain acceptance, and the acc_k/α_k figure when any setting was measured."""
    md = ["Chain acceptance (what tree decoding sees):", "", chain_table(settings, inp.params.level), ""]
    if any(s.n > 0 for s in settings):
        img = inp.figures.add(f"alpha_{name}.png", lambda p: plot_steps(name, settings, paper, p, inp.params))
        md += [f"![acc_k and α_k vs k, {name} study]({img})", ""]
    return md


def _engines_section(inp: Inputs) -> list[str]:
    """The serving engines beside kvshot's loop (e2e.engines); none without their rows."""
    engine_file = inp.paths.root / ENGINE_METRICS
    return engine_section(read_rows(engine_file) if engine_file.is_file() else None, inp.params.level)


def _retention_section(inp: Inputs) -> list[str]:
    """Step retention of every drafter of every study in one figure (none without a retention)."""
    present = inp.present
    if not any(math.isfinite(s.value("step_retention")) for ss in present.values() for s in ss):
        return []
    img = inp.figures.add("retention.png", lambda p: plot_retention(present, inp.tables, p, inp.params))
    return ["## Retention", "", f"![step retention per drafter]({img})", ""]


def _problems_section(inp: Inputs) -> list[str]:
    """Missing metrics files, failed trials (their first error line), trials planned but not run yet."""
    res, paths = inp.res, inp.paths
    problems = [[n, "–", "–", "missing", f"no {paths.stepwise_metrics(n).relative_to(paths.root)}"]
                for n in res.names if res.raw[n] is None]
    for n in res.names:
        for s in inp.studies.get(n) or inp.validation.get(n) or []:
            problems += [[n, str(r.get("trial")), label(s), "failed", str(r["error"]).splitlines()[0][:200]]
                         for r in sorted(s.failed, key=lambda r: str(r.get("trial")))]
    problems += not_run_yet(inp.context, {n for n in res.names if res.raw[n] is not None})
    if res.e2e_rows is None:
        problems.append(["e2e", "–", "–", "missing", "no metrics/e2e.json"])
    else:
        problems += [["e2e", str(r.get("trial")), variant_name({"variant": r.get("variant")}), "failed",
                      str(r.get("error") or "no tau").splitlines()[0][:200]]
                     for r in res.e2e_rows if r.get("status", "ok") != "ok" or r.get("tau") is None]
    return ["## Failed and missing trials", "",
            md_table(pd.DataFrame(problems, columns=["study", "trial", "setting", "state", "error"]))
            if problems else "None.", ""]


def _provenance_section(inp: Inputs) -> list[str]:
    """The run's record, then one row per study and one per study part (when the profile names parts)."""
    params = inp.params
    md = ["## Provenance", "",
          md_table(provenance_table(inp.context, inp.res, params, inp.papers.get("source", ""))), ""]
    studies_prov = study_provenance(inp.res, inp.context)
    if len(studies_prov):
        md += ["Per study:", "", md_table(studies_prov), ""]
    parts_prov = parts_provenance(inp.context, params.budget_min)
    if len(parts_prov):
        budget = f" (the budget: {params.budget_min:g} min each, from a fresh workspace)" if params.budget_min else ""
        md += [f"Per part: each part of a study runs in one go with `kvshot repro --part STUDY/PART`{budget}; "
               "its trials' times replayed: the wall times its trials' rows record, wherever they ran, replayed as "
               "one sweep (`ray.max_concurrent` at a time, each child after its parent), before its data stages "
               "and its decoding (a trial with no row yet at the seconds per step of its setting's rows, times its "
               "own steps):", "", md_table(parts_prov), ""]
    return md


def _stage_metrics(inp: Inputs, alone: list[Verdict], demo: bool) -> dict[str, float]:
    """What the stage reports to the pipeline (no claim holds in a demonstration)."""
    present = inp.present
    n_failed = sum(len(s.failed) for ss in present.values() for s in ss)
    return {"report/settings": float(sum(len(s) for s in present.values())), "report/failed_trials": float(n_failed),
            "report/claims_holding": float(0 if demo else sum(v.verdict == "holds" for v in alone))}


# -- the stage -------------------------------------------------------------------------------------------------

def run(params: ReportParams, context: dict, paths: Paths, report: Report) -> None:
    """Read the metrics JSON, write reports/README.md and reports/figures/*.png (atomically)."""
    inp = read_inputs(params, context, paths)
    alone, together = verdicts(params, inp.studies, inp.e2e if inp.res.e2e is not None else None, inp.scales)
    demo_steps = demonstration_steps(params, inp.studies)
    pending = planned_not_run(inp.context)      # a study not run at all waits too (B: block_lr's choice)
    md = _introduction(params) + findings_section(params, alone, together, demo_steps, pending)
    for name in inp.res.names:
        md += _study_section(inp, name) if name not in inp.validation else \
            validation_section(name, inp.validation[name], inp.res.raw[name] or [],
                               {n: inp.res.raw[n] for n in inp.studies}, params.level)
    md += _engines_section(inp) + _retention_section(inp) + _problems_section(inp) + _provenance_section(inp)
    inp.figures.remove_stale()
    write_text_atomic(paths.reports / "README.md", "\n".join(md))
    report(_stage_metrics(inp, alone, demo_steps is not None))


__all__ = ["MISSING", "ReportParams", "Verdict", "e2e_baselines", "e2e_check_note", "load_paper_numbers", "run"]
