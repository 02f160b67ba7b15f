"""report: paper-style tables, alpha_k figures and findings from the metrics -> reports/README.md.

Source of truth: the metrics JSON files that DVC tracks (`metrics/stepwise/<study>.json`, `metrics/e2e.json`),
not MLflow. The report is then a pure function of versioned files plus the provenance the pipeline hands in:
no tracking server is needed, and the same inputs give the same README (apart from its date line) and the same
PNG bytes. MLflow holds the same numbers for browsing.

What it writes (DESIGN §8, §10):
- `reports/README.md`: a findings section (one verdict per claim of the paper, computed from the numbers), one
  table per study in the paper's shape with the paper's own number beside ours where the setting matches
  (`stages/paper_numbers.yaml`), failed and missing trials, and provenance.
- `reports/figures/*.png`: alpha_k vs k per study, retention per drafter, tau and speedup bars.

Seeds: trials that differ only in `seed` are one setting; its cells read mean ± sample std (n seeds). A
difference smaller than `noise_sigmas` times the spread of the difference is called "within noise"; with one
seed per setting the spread is unknown and the verdict goes by the sign alone, saying so.

How each claim is decided (the weakest sub-verdict wins; a claim without its data is "not measured"):
- P1: retention of the deepest KV-only drafter > EAGLE-3's (depth study, else injection study).
- P2: step-wise MAT of the deepest KV-only > depth 1, and no later depth step beats the 1 -> 2 jump.
- P3: EAGLE-3's alpha_0 > the best KV-only alpha_0 (depth study, else injection study).
- H: MAT of the checkpoint-initialised hybrid (else the best hybrid) > EAGLE-3's, hybrid study.
- E: at the largest data scale decoded for both, the hybrid's relative tau gain over EAGLE-3 (paper tree, else
  the tuned one) < `much_smaller_ratio` x its relative step-wise MAT gain (scale study at that scale, else the
  hybrid study); without a clear step-wise gain there is nothing to shrink and the claim does not hold.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml
from pydantic import Field

from stages.common import Paths, Report, Section, StageError, atomic_path, write_text_atomic

PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.yaml")
PAPER_LABEL = "paper (Qwen3-8B)"
SETTING_KEYS = ("variant", "depth", "injection", "rope_fix", "init", "scale")
VARIANT_ORDER = ("kv_only", "hybrid", "cross_only", "eagle3", "prompt_lookup")
VARIANT_NAMES = {"eagle3": "EAGLE-3 (hidden-only)", "kv_only": "KV-only", "hybrid": "hybrid",
                 "cross_only": "cross-only", "prompt_lookup": "prompt lookup"}
HOLDS, FAILS, NOISE, MISSING = "holds", "does not hold", "within noise", "not measured"
PAPER_TREE = (8, 10, 60)


class ReportParams(Section):
    title: str = "KVShot reproduction"
    figure_width: float = 7.0
    figure_height: float = 4.5
    dpi: int = 110
    noise_sigmas: float = Field(2.0, ge=0)        # |diff| < noise_sigmas * spread -> "within noise"
    much_smaller_ratio: float = Field(0.5, gt=0)  # claim E: e2e relative gain < ratio * step-wise relative gain


# -- numbers --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stat:
    """A metric over the seeds of one setting: mean, sample std (None with one seed) and n."""

    mean: float
    std: float | None
    n: int

    @staticmethod
    def of(values: Iterable[float | None]) -> Stat | None:
        xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not xs:
            return None
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
        return Stat(mean, std, len(xs))

    def fmt(self, digits: int = 3, pct: bool = False) -> str:
        scale, unit = (100.0, "%") if pct else (1.0, "")
        d = 1 if pct else digits
        text = f"{self.mean * scale:.{d}f}{unit}"
        return text if self.std is None else f"{text} ± {self.std * scale:.{d}f}{unit}"


def diff_stat(a: Stat, b: Stat) -> Stat:
    """a - b with the spread of a difference of independent draws (unknown if neither side has seeds)."""
    var = [s.std ** 2 for s in (a, b) if s.std is not None]
    return Stat(a.mean - b.mean, math.sqrt(sum(var)) if var else None, min(a.n, b.n))


def compare(a: Stat | None, b: Stat | None, sigmas: float) -> tuple[str, str]:
    """Verdict on the claim a > b and a short note on the noise."""
    if a is None or b is None:
        return MISSING, "no data"
    d = diff_stat(a, b)
    if d.std is None:
        return (HOLDS if d.mean > 0 else FAILS), "one seed: spread unknown"
    note = f"diff {d.mean:+.3f}, {sigmas:g}σ = {sigmas * d.std:.3f}"
    if abs(d.mean) < sigmas * d.std:
        return NOISE, note
    return (HOLDS if d.mean > 0 else FAILS), note


def worst(*verdicts: str) -> str:
    """Combine sub-verdicts of one claim: the weakest one decides."""
    for v in (MISSING, FAILS, NOISE):
        if v in verdicts:
            return v
    return HOLDS


def mat_of(alpha: list[float]) -> float:
    """Step-wise chain MAT = 1 + sum_i prod_{j<=i} alpha_j (DESIGN §4)."""
    total, prod = 1.0, 1.0
    for a in alpha:
        prod *= a
        total += prod
    return total


# -- inputs ---------------------------------------------------------------------------------------------------

def _read_rows(path: Path) -> list[dict]:
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise StageError(f"{path}: expected a JSON list of objects, one per trial")
    return rows


def load_paper_numbers(path: Path = PAPER_NUMBERS) -> dict:
    """The paper's reference numbers (tables keyed by study), with their source."""
    return yaml.safe_load(Path(path).read_text())


def _setting(row: dict) -> tuple:
    return tuple(row.get(k) for k in SETTING_KEYS)


def _row_error(row: dict) -> str | None:
    """Why a trial row cannot be used, or None."""
    if row.get("status", "ok") != "ok":
        return str(row.get("error") or f"status {row.get('status')}")
    alpha = row.get("alpha")
    if not isinstance(alpha, list) or not alpha or not all(a is None or isinstance(a, (int, float)) for a in alpha):
        return "no alpha list in the metrics row"
    return None


def _extra(row: dict) -> dict[str, Any]:
    """Swept values beyond the standard setting keys (an ad-hoc `kvshot sweep lr=...`): they split settings too."""
    values = row.get("values") if isinstance(row.get("values"), dict) else {}
    return {k: v for k, v in sorted(values.items()) if k.split(".")[-1] not in (*SETTING_KEYS, "seed")}


def _num(a: Any) -> float:
    """An alpha entry as a float; a step without valid positions (None/NaN) accepts nothing."""
    return float(a) if isinstance(a, (int, float)) and math.isfinite(a) else 0.0


@dataclass
class Setting:
    """One drafter setting of a study, aggregated over its seeds."""

    study: str
    fields: dict[str, Any]
    trials: list[str]
    alpha: list[Stat | None]
    mat: Stat | None
    retention: Stat | None
    failed: list[dict] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    chains: list[int] | None = None      # α_k's denominators (chains alive at step k), summed over seeds

    @property
    def n(self) -> int:
        return self.mat.n if self.mat else 0

    def a(self, k: int) -> Stat | None:
        return self.alpha[k] if k < len(self.alpha) else None

    def metric(self, name: str) -> Stat | None:
        if name.startswith("alpha_"):
            return self.a(int(name.split("_")[1]))
        return {"mat": self.mat, "retention": self.retention}[name]


def aggregate(study: str, rows: list[dict]) -> list[Setting]:
    """Group trial rows by setting (everything but seed/trial) and average the ok ones over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((_setting(row), json.dumps(_extra(row), default=str)), []).append(row)
    out = []
    for (key, extra), group in groups.items():
        ok = [r for r in group if _row_error(r) is None]
        failed = [{**r, "error": _row_error(r)} for r in group if _row_error(r) is not None]
        k_max = max((len(r["alpha"]) for r in ok), default=0)
        alpha = [Stat.of(r["alpha"][k] for r in ok if k < len(r["alpha"])) for k in range(k_max)]
        mats = [r.get("mat") if r.get("mat") is not None else mat_of([_num(a) for a in r["alpha"]]) for r in ok]
        rets = [r.get("retention") if r.get("retention") is not None else _retention(r["alpha"]) for r in ok]
        chains = [(r.get("counts") or {}).get("chain") for r in ok]
        chains = [sum(c[k] for c in chains if k < len(c)) for k in range(k_max)] \
            if ok and all(isinstance(c, list) for c in chains) else None
        out.append(Setting(study, dict(zip(SETTING_KEYS, key)), sorted(str(r.get("trial")) for r in group),
                           alpha, Stat.of(mats), Stat.of(rets), failed, json.loads(extra), chains))
    return out


def _retention(alpha: list[float | None]) -> float | None:
    """α_6/α_0; undefined (None) when no chain reached the last step, as the evaluate stage records it."""
    first, last = _num(alpha[0]), alpha[6] if len(alpha) > 6 else alpha[-1]
    if last is None or (isinstance(last, float) and math.isnan(last)):
        return None
    return float(last) / first if first else None


def sort_settings(settings: list[Setting], scale_order: list[str]) -> list[Setting]:
    def key(s: Setting) -> tuple:
        f = s.fields
        v = f.get("variant")
        scale = f.get("scale")
        depth = f.get("depth")
        return (VARIANT_ORDER.index(v) if v in VARIANT_ORDER else len(VARIANT_ORDER), str(v),
                scale_order.index(scale) if scale in scale_order else len(scale_order), str(scale),
                depth if isinstance(depth, int) else 10**6, str(depth),
                *((f.get(k) is None, str(f.get(k))) for k in ("injection", "rope_fix", "init")),
                json.dumps(s.extra, default=str))
    return sorted(settings, key=key)


# -- end to end -----------------------------------------------------------------------------------------------

@dataclass
class E2EGroup:
    """The end-to-end rows of one setting, split by tree kind and averaged over seeds."""

    fields: dict[str, Any]
    paper: dict[str, Stat | None]
    tuned: dict[str, Stat | None]
    tuned_tree: Any
    lossless: bool | None
    n_rows: int
    lookup: dict[str, Stat | None] | None = None    # the tuned tree with a prompt-lookup branch, when decoded
    lookup_tree: Any = None


LOOKUP_KIND = "tuned_lookup"


def _tree_kind(row: dict) -> str:
    kind = row.get("tree_kind")
    if kind:
        return str(kind)
    tree = row.get("tree")
    return "paper" if isinstance(tree, list) and tuple(tree) == PAPER_TREE else "tuned"


def _e2e_stats(rows: list[dict]) -> dict[str, Stat | None]:
    keys = ("tau", "speedup", "tokens_per_s", "baseline_tokens_per_s", "draft_time_share", "exact_match")
    return {k: Stat.of(r.get(k) for r in rows) for k in keys}


def _fastest(rows: list[dict]) -> tuple[Any, list[dict]]:
    """Rows of several trees for one setting: the fastest tree (as the e2e stage would pick it) and its rows."""
    by_tree: dict[str, list[dict]] = {}
    for r in rows:
        by_tree.setdefault(json.dumps(r.get("tree")), []).append(r)
    speed = {t: Stat.of(r.get("speedup") for r in rs) for t, rs in by_tree.items()}
    best = max(sorted(by_tree), key=lambda t: speed[t].mean if speed[t] else -1.0, default=None)
    return (json.loads(best), by_tree[best]) if best is not None else (None, [])


def aggregate_e2e(rows: list[dict], trial_settings: dict[str, dict]) -> list[E2EGroup]:
    """Group e2e rows by setting; a row whose trial is a step-wise trial takes that trial's setting fields."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("status", "ok") != "ok" or row.get("tau") is None:
            continue
        fields = {k: row.get(k) for k in SETTING_KEYS}
        fields.update({k: v for k, v in trial_settings.get(str(row.get("trial")), {}).items() if v is not None})
        groups.setdefault(tuple(fields[k] for k in SETTING_KEYS), []).append(row)
    out = []
    for key, group in groups.items():
        paper = [r for r in group if _tree_kind(r) == "paper"]
        tuned_tree, tuned = _fastest([r for r in group if _tree_kind(r) not in ("paper", LOOKUP_KIND)])
        lookup_tree, lookup = _fastest([r for r in group if _tree_kind(r) == LOOKUP_KIND])
        lossless = [r.get("lossless") for r in group if r.get("lossless") is not None]
        out.append(E2EGroup(dict(zip(SETTING_KEYS, key)), _e2e_stats(paper), _e2e_stats(tuned), tuned_tree,
                            all(lossless) if lossless else None, len(group),
                            _e2e_stats(lookup) if lookup else None, lookup_tree))
    return out


# -- findings -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    claim: str
    statement: str
    verdict: str
    evidence: str


CLAIMS = {
    "P1": "KV-only decays more gracefully than hidden-only (higher retention α_6/α_0 than EAGLE-3)",
    "P2": "KV-only improves with depth (MAT), the largest jump from 1 to 2 layers",
    "P3": "hidden-only is better at k = 0 (EAGLE-3 α_0 above every KV-only drafter)",
    "H": "the hybrid beats EAGLE-3 on step-wise MAT",
    "E": "the end-to-end gain of the hybrid over EAGLE-3 (τ) is much smaller than its step-wise gain (MAT)",
}


def _ok(settings: list[Setting] | None, variant: str) -> list[Setting]:
    return [s for s in settings or [] if s.fields.get("variant") == variant and s.n > 0]


def _kv_and_eagle(studies: dict[str, list[Setting] | None]) -> tuple[str | None, list[Setting], Setting | None]:
    """The study that compares KV-only with EAGLE-3: depth if it has both, else injection."""
    for name in ("depth", "injection"):
        kv, eg = _ok(studies.get(name), "kv_only"), _ok(studies.get(name), "eagle3")
        if kv and eg:
            return name, kv, eg[0]
    return None, [], None


def _s(stat: Stat | None, pct: bool = False) -> str:
    return stat.fmt(pct=pct) if stat else "–"


def _depth(s: Setting) -> int:
    return int(s.fields.get("depth") or 1)


def claim_p1(studies: dict[str, list[Setting] | None], sigmas: float) -> Verdict:
    name, kv, eagle = _kv_and_eagle(studies)
    if eagle is None:
        return Verdict("P1", CLAIMS["P1"], MISSING, "needs KV-only and EAGLE-3 trials in the depth or injection study")
    # The paper's comparison: its deepest KV-only drafter against 1-layer EAGLE-3.
    best = max(kv, key=lambda s: (_depth(s), s.retention.mean if s.retention else -1))
    verdict, note = compare(best.retention, eagle.retention, sigmas)
    per = ", ".join(f"{_label(s)} {_s(s.retention, pct=True)}" for s in sort_settings(kv, []))
    return Verdict("P1", CLAIMS["P1"], verdict,
                   f"{name} study: {_label(best)} retention {_s(best.retention, pct=True)} vs EAGLE-3 "
                   f"{_s(eagle.retention, pct=True)} ({note}); all KV-only: {per}")


def claim_p2(studies: dict[str, list[Setting] | None], sigmas: float) -> Verdict:
    by_depth: dict[int, Setting] = {}
    for s in sort_settings(_ok(studies.get("depth"), "kv_only"), []):
        by_depth.setdefault(_depth(s), s)
    if 1 not in by_depth or 2 not in by_depth:
        return Verdict("P2", CLAIMS["P2"], MISSING, "needs KV-only trials at depths 1 and 2 in the depth study")
    depths = sorted(by_depth)
    mats = {d: by_depth[d].mat for d in depths}
    improve, note = compare(mats[depths[-1]], mats[1], sigmas)
    jumps = {(a, b): diff_stat(mats[b], mats[a]) for a, b in zip(depths, depths[1:])}
    first = jumps.pop((1, 2))
    # "Largest" means no later jump beats 1->2: a tie within noise is noise, a clear loss fails.
    largest = [compare(first, j, sigmas)[0] for j in jumps.values()]
    verdict = worst(improve, *largest)
    curve = ", ".join(f"{d}: {_s(mats[d])}" for d in depths)
    steps = ", ".join(f"{a}→{b}: {j.mean:+.3f}" for (a, b), j in [((1, 2), first), *jumps.items()])
    return Verdict("P2", CLAIMS["P2"], verdict,
                   f"MAT by depth {curve}; depth {depths[-1]} vs 1: {improve} ({note}); jumps {steps}")


def claim_p3(studies: dict[str, list[Setting] | None], sigmas: float) -> Verdict:
    name, kv, eagle = _kv_and_eagle(studies)
    if eagle is None:
        return Verdict("P3", CLAIMS["P3"], MISSING, "needs KV-only and EAGLE-3 trials in the depth or injection study")
    best = max(kv, key=lambda s: s.a(0).mean if s.a(0) else -1)
    verdict, note = compare(eagle.a(0), best.a(0), sigmas)
    return Verdict("P3", CLAIMS["P3"], verdict,
                   f"{name} study: EAGLE-3 α_0 {_s(eagle.a(0))} vs best KV-only ({_label(best)}) "
                   f"{_s(best.a(0))} ({note})")


def claim_h(studies: dict[str, list[Setting] | None], sigmas: float) -> Verdict:
    hyb, eg = _ok(studies.get("hybrid"), "hybrid"), _ok(studies.get("hybrid"), "eagle3")
    if not hyb or not eg:
        return Verdict("H", CLAIMS["H"], MISSING, "needs hybrid and EAGLE-3 trials in the hybrid study")
    # The paper's headline hybrid is the checkpoint-initialised one; without it, the best hybrid we have.
    ckpt = [s for s in hyb if s.fields.get("init") == "ckpt"]
    best = max(ckpt or hyb, key=lambda s: s.mat.mean)
    verdict, note = compare(best.mat, eg[0].mat, sigmas)
    return Verdict("H", CLAIMS["H"], verdict,
                   f"{_label(best)} MAT {_s(best.mat)} vs EAGLE-3 {_s(eg[0].mat)} ({note})")


def claim_e(studies: dict[str, list[Setting] | None], e2e: list[E2EGroup] | None, scale_order: list[str],
            sigmas: float, ratio: float) -> Verdict:
    def pick(variant: str, scale: str | None) -> E2EGroup | None:
        cands = [g for g in e2e or [] if g.fields.get("variant") == variant and g.fields.get("scale") == scale
                 and (g.paper["tau"] or g.tuned["tau"])]
        ckpt = [g for g in cands if g.fields.get("init") in ("ckpt", None)]
        return (ckpt or cands or [None])[0]

    scales = [g.fields.get("scale") for g in e2e or []]
    scales = sorted(set(scales), key=lambda s: (s in scale_order, scale_order.index(s) if s in scale_order else 0,
                                               str(s)))
    for scale in reversed(scales):    # the largest data scale with both drafters decoded, as in the paper
        h, e = pick("hybrid", scale), pick("eagle3", scale)
        if h and e:
            break
    else:
        return Verdict("E", CLAIMS["E"], MISSING, "needs end-to-end rows for hybrid and EAGLE-3 at one data scale")
    kind = "paper" if h.paper["tau"] and e.paper["tau"] else "tuned"
    th, te = getattr(h, kind)["tau"], getattr(e, kind)["tau"]
    if th is None or te is None:
        return Verdict("E", CLAIMS["E"], MISSING, "no τ measured on a common tree for hybrid and EAGLE-3")
    # Step-wise gain of the same drafters (scale study at that scale), else the hybrid study's.
    src, sh, se = None, None, None
    for name, want_scale in (("scale", scale), ("hybrid", None)):
        hs = [s for s in _ok(studies.get(name), "hybrid") if want_scale is None or s.fields.get("scale") == want_scale]
        es = [s for s in _ok(studies.get(name), "eagle3") if want_scale is None or s.fields.get("scale") == want_scale]
        if hs and es:
            ck = [s for s in hs if s.fields.get("init") == "ckpt"]
            src, sh, se = name, (ck or hs)[0].mat, es[0].mat
            break
    if src is None:
        return Verdict("E", CLAIMS["E"], MISSING, "no step-wise MAT for hybrid and EAGLE-3 to compare with")
    step_v, step_note = compare(sh, se, sigmas)
    rel_step = sh.mean / se.mean - 1
    rel_e2e = th.mean / te.mean - 1
    evidence = (f"step-wise MAT ({src} study) {_s(sh)} vs {_s(se)} = {rel_step:+.1%}; τ at the {kind} tree "
                f"(scale {scale}) {_s(th)} vs {_s(te)} = {rel_e2e:+.1%}")
    sp_h, sp_e = h.tuned["speedup"], e.tuned["speedup"]
    if sp_h and sp_e:
        evidence += f"; speedup (tuned tree) {_s(sp_h)} vs {_s(sp_e)}"
    if step_v != HOLDS:
        why = "no clear step-wise gain to shrink" if step_v == NOISE else "the hybrid has no step-wise gain"
        return Verdict("E", CLAIMS["E"], step_v,
                       f"{evidence} ({why}: {step_note})")
    # Much smaller: the e2e tau gain stays under ratio x the step-wise relative gain, in tau units.
    allowed = Stat(ratio * rel_step * te.mean, None, 1)
    verdict, note = compare(allowed, diff_stat(th, te), sigmas)
    return Verdict("E", CLAIMS["E"], verdict,
                   f"{evidence}; allowed e2e gain {ratio:g}× the step-wise one = {allowed.mean:+.3f} τ ({note})")


def findings(studies: dict[str, list[Setting] | None], e2e: list[E2EGroup] | None, scale_order: list[str],
             params: ReportParams) -> list[Verdict]:
    """One verdict per claim of the paper, computed from our numbers."""
    s = params.noise_sigmas
    return [claim_p1(studies, s), claim_p2(studies, s), claim_p3(studies, s), claim_h(studies, s),
            claim_e(studies, e2e, scale_order, s, params.much_smaller_ratio)]


# -- tables ---------------------------------------------------------------------------------------------------

def md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def _label(s: Setting) -> str:
    """A short human name of a setting, naming only what varies for its variant."""
    f = s.fields
    v = f.get("variant")
    parts = [VARIANT_NAMES.get(v, str(v))]
    depth = f.get("depth")
    if depth is not None and (v == "kv_only" or depth != 1):
        parts.append(f"{depth} layer" + ("s" if depth != 1 else ""))
    if v == "kv_only" and f.get("injection"):
        parts.append(str(f["injection"]).replace("_", " "))
    if v == "kv_only" and f.get("rope_fix"):
        parts.append("RoPE fix")
    if v in ("hybrid", "cross_only") and f.get("init"):
        parts.append(f"{f['init']} init")
    if f.get("scale") and s.study == "scale":
        parts.append(f"scale {f['scale']}")
    parts += [f"{k}={v}" for k, v in s.extra.items()]
    return ", ".join(parts)


def _paper_row(paper: dict | None, fields: dict) -> dict | None:
    for row in (paper or {}).get("rows", []):
        match = row.get("match")
        if match and all(fields.get(k) == v for k, v in match.items()):
            return row
    return None


def _seeds_cell(s: Setting) -> str:
    return f"{s.n} ({len(s.failed)} failed)" if s.failed else str(s.n)


METRIC_HEAD = {"alpha_0": "α_0", "alpha_3": "α_3", "alpha_6": "α_6", "retention": "retention", "mat": "MAT",
               "tau_paper_tree": "τ (8, 10, 60)"}


def _variant_name(f: dict) -> str:
    return VARIANT_NAMES.get(f.get("variant"), str(f.get("variant")))


def _method(f: dict) -> str:
    if f.get("variant") == "eagle3":
        return _variant_name(f)
    return f"{_variant_name(f)}, {str(f.get('injection') or '–').replace('_', ' ')}"


def _rope(f: dict) -> str:
    return "–" if f.get("variant") == "eagle3" else ("yes" if f.get("rope_fix") else "no")


def _init(f: dict) -> str:
    if f.get("variant") == "eagle3":
        return "–"
    return {"ckpt": "EAGLE-3 checkpoint", "random": "random"}.get(f.get("init"), str(f.get("init")))


# Per study: the label columns and the metrics of the paper's table of the same name.
STUDY_SHAPES: dict[str, tuple[list[tuple[str, Callable[[dict], str]]], tuple[str, ...]]] = {
    "injection": ([("method", _method), ("RoPE fix", _rope)], ("alpha_0", "alpha_6", "mat")),
    "depth": ([("drafter", _variant_name), ("layers", lambda f: str(f.get("depth") or 1))],
              ("alpha_0", "alpha_3", "alpha_6", "retention", "mat")),
    "hybrid": ([("variant", _variant_name), ("init", _init)], ("alpha_0", "alpha_3", "alpha_6", "retention", "mat")),
}
GENERIC_METRICS = ("alpha_0", "alpha_3", "alpha_6", "retention", "mat")


FEW_CHAINS = 50   # an α_k measured on fewer chains than this shows its count


def _few_chains(stat: Stat | None, name: str, chains: list[int] | None) -> int | None:
    """The chain count behind an α_k cell when it is below FEW_CHAINS (and the cell has a value), else None."""
    if not (name.startswith("alpha_") and chains and stat is not None):
        return None
    k = int(name.split("_")[1])
    return chains[k] if k < len(chains) and chains[k] < FEW_CHAINS else None


def _metric_cell(stat: Stat | None, name: str, chains: list[int] | None = None) -> str:
    cell = _s(stat, pct=name == "retention")
    few = _few_chains(stat, name, chains)
    return cell if few is None else f"{cell} (n={few})"


def _paper_cell(row: dict | None, name: str) -> str:
    if not row or row.get(name) is None:
        return "–"
    if name == "retention":
        return f"{row[name] * 100:.1f}%"
    return f"{row[name]:.3f}" if name.startswith("alpha_") else f"{row[name]:.2f}"


def stepwise_table(study: str, settings: list[Setting], paper: dict | None) -> str:
    """A study's table in the paper's shape, the paper's number beside ours where the setting matches."""
    cols, metrics = STUDY_SHAPES.get(study, ([("setting", None)], GENERIC_METRICS))
    header = [c for c, _ in cols] + ["seeds"] + [METRIC_HEAD[m] for m in metrics]
    if paper:
        header += [f"{METRIC_HEAD[m]} {PAPER_LABEL}" for m in metrics]
    rows = []
    for s in settings:
        label = [fn(s.fields) if fn else _label(s) for _, fn in cols]
        if s.extra and cols[0][1]:
            label[0] += " (" + ", ".join(f"{k}={v}" for k, v in s.extra.items()) + ")"
        if s.n == 0:
            cells = ["failed"] * len(metrics)
        else:
            cells = [_metric_cell(s.metric(m), m, s.chains) for m in metrics]
        if paper:
            prow = _paper_row(paper, s.fields)
            cells += [_paper_cell(prow, m) for m in metrics]
        rows.append(label + [_seeds_cell(s)] + cells)
    table = md_table(header, rows)
    if any(s.n and _few_chains(s.metric(m), m, s.chains) is not None for s in settings for m in metrics):
        table += (f"\n\n(n=…): α_k is measured on the chains still alive at step k; below {FEW_CHAINS} the count is "
                  "shown, as such an α_k is noisy.")
    return table


def _paper_notes(paper: dict | None, metrics: Iterable[str]) -> str:
    rows = [r for r in (paper or {}).get("rows", []) if not r.get("match")]
    if not rows:
        return ""
    items = []
    for r in rows:
        vals = ", ".join(f"{METRIC_HEAD.get(m, m)} {_paper_cell(r, m)}" for m in metrics if r.get(m) is not None)
        items.append(f"{r['label']}: {vals}")
    return f"Paper rows without a counterpart here ({PAPER_LABEL}): " + "; ".join(items) + "."


def _tree(t: Any) -> str:
    return "(" + ", ".join(str(x) for x in t) + ")" if isinstance(t, list) else "n/a"


def scale_table(settings: list[Setting], e2e: list[E2EGroup], paper: dict | None,
                data_sizes: dict) -> str:
    """Variant x data scale: step-wise MAT, tau at the paper tree, tau and speedup at the tuned tree, ..."""
    def scale_cell(scale: Any) -> str:
        size = data_sizes.get(scale) if isinstance(data_sizes, dict) and scale is not None else None
        return "–" if scale is None else f"{scale} ({size})" if isinstance(size, (int, float)) else str(scale)

    def match(fields: dict, g: E2EGroup) -> bool:
        return all(g.fields.get(k) == fields.get(k) for k in SETTING_KEYS)

    with_lookup = any(g.lookup for g in e2e)
    header = ["variant", "data scale", "seeds", "MAT (step-wise)", f"τ {_tree(list(PAPER_TREE))}",
              f"τ {_tree(list(PAPER_TREE))} {PAPER_LABEL}", "tuned tree", "τ (tuned)", "speedup (tuned)",
              "drafting share", "exact match", "lossless"] + (["speedup, tuned + lookup (τ)"] if with_lookup else [])
    used: set[int] = set()
    lines: list[tuple[dict, Setting | None, E2EGroup | None]] = []
    for s in settings:
        g = next((g for g in e2e if match(s.fields, g)), None)
        if g is not None:
            used.add(id(g))
        lines.append((s.fields, s, g))
    lines += [(g.fields, None, g) for g in e2e if id(g) not in used]
    rows = []
    for fields, s, g in lines:
        v = fields.get("variant")
        name = VARIANT_NAMES.get(v, str(v))
        if v in ("hybrid", "cross_only") and fields.get("init"):
            name += f", {fields['init']} init"
        prow = _paper_row(paper, fields)
        mat = ("failed" if s.n == 0 else _s(s.mat)) if s else "–"
        seeds = _seeds_cell(s) if s else "–"
        if g is None:
            e2e_cells = ["not decoded"] + ["–"] * 5
        else:
            share, exact = g.tuned["draft_time_share"], g.tuned["exact_match"] or g.paper["exact_match"]
            e2e_cells = [_s(g.paper["tau"]), _tree(g.tuned_tree), _s(g.tuned["tau"]), _s(g.tuned["speedup"]),
                         _s(share, pct=True), _s(exact, pct=True)]
        lossless = "–" if g is None or g.lossless is None else ("yes" if g.lossless else "NO")
        paper_tau = f"{prow['tau_paper_tree']:.2f}" if prow and prow.get("tau_paper_tree") is not None else "–"
        lookup = []
        if with_lookup:
            lk = g.lookup if g is not None else None
            lookup = [f"{_s(lk['speedup'])} ({_s(lk['tau'])}) at {_tree(g.lookup_tree)}" if lk else "–"]
        rows.append([name, scale_cell(fields.get("scale")), seeds, mat, e2e_cells[0], paper_tau, *e2e_cells[1:],
                     lossless, *lookup])
    return md_table(header, rows)


def e2e_baselines(rows: list[dict]) -> str:
    """The baselines decoded in the same run as the drafters (means over the rows that carry them)."""
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
    text = ("Baselines in the same run: " + "; ".join(parts) + ".") if parts else ""
    if any(r.get("drafter_weights") == "int8" for r in rows):
        text += " The drafters ran with int8 weight-only linears (e2e.drafter_weights=int8)."
    return text.strip()


# -- figures --------------------------------------------------------------------------------------------------

def _figure(params: ReportParams, nrows: int = 1, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(nrows, ncols, figsize=(params.figure_width, params.figure_height), dpi=params.dpi)
    return plt, fig, ax


def _save(plt, fig, path: Path, params: ReportParams) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        # No metadata: the same numbers give the same bytes.
        fig.savefig(tmp, format="png", dpi=params.dpi, metadata={"Software": None})
    plt.close(fig)


def plot_alpha(study: str, settings: list[Setting], paper: dict | None, path: Path, params: ReportParams) -> None:
    """alpha_k vs k, one line per setting (band: ± std over seeds; hollow markers: the paper's points)."""
    plt, fig, ax = _figure(params)
    colors = plt.get_cmap("tab10").colors
    has_paper = False
    for i, s in enumerate(x for x in settings if x.n > 0):
        c = colors[i % len(colors)]
        ks = [k for k, a in enumerate(s.alpha) if a is not None]
        mean = [s.alpha[k].mean for k in ks]
        ax.plot(ks, mean, "-o", color=c, ms=3.5, lw=1.6, label=f"{_label(s)} (n={s.n})")
        if s.n > 1:
            std = [s.alpha[k].std or 0.0 for k in ks]
            ax.fill_between(ks, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                            color=c, alpha=0.15, lw=0)
        prow = _paper_row(paper, s.fields)
        pts = [(k, prow[f"alpha_{k}"]) for k in range(7) if prow and prow.get(f"alpha_{k}") is not None]
        if pts:
            has_paper = True
            ax.plot(*zip(*pts), "o", mfc="none", mec=c, ms=7, mew=1.4)
    if has_paper:
        ax.plot([], [], "o", mfc="none", mec="0.3", ms=7, label=f"hollow: {PAPER_LABEL}")
    # Zoom on the data (the curves of a grid are often close together), never beyond [0, 1].
    lo, hi = ax.dataLim.y0, ax.dataLim.y1
    pad = max(0.05, 0.1 * (hi - lo)) if math.isfinite(lo) and math.isfinite(hi) else 0.5
    ax.set(xlabel="speculative step k", ylabel="α_k (step-wise acceptance)",
           ylim=(max(0.0, lo - pad), min(1.0, hi + pad)) if math.isfinite(lo) else (0, 1),
           title=f"α_k vs k — {study} study")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", ncol=2 if len(settings) > 4 else 1, framealpha=0.85)
    _save(plt, fig, path, params)


def plot_retention(studies: dict[str, list[Setting]], papers: dict, path: Path, params: ReportParams) -> None:
    """Retention alpha_6/alpha_0 per drafter setting of every study, the paper's value as a black tick."""
    plt, fig, ax = _figure(params)
    labels, vals, errs, marks = [], [], [], []
    for study, settings in studies.items():
        for s in settings:
            if s.retention is None:
                continue
            labels.append(f"{study}: {_label(s)}")
            vals.append(s.retention.mean)
            errs.append(s.retention.std or 0.0)
            prow = _paper_row(papers.get(study), s.fields)
            marks.append(prow.get("retention") if prow else None)
    y = list(range(len(labels)))[::-1]
    ax.barh(y, vals, xerr=errs, color="tab:blue", alpha=0.75, height=0.7, error_kw={"lw": 1})
    pts = [(m, yy) for m, yy in zip(marks, y) if m is not None]
    if pts:
        ax.plot(*zip(*pts), "|", color="black", ms=12, mew=2, label=PAPER_LABEL)
        ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(y, labels, fontsize=7 if len(labels) > 8 else 8)
    ax.set(xlabel="retention α_6 / α_0", xlim=(0, max([1.0, *[v + e for v, e in zip(vals, errs)]])),
           title="Retention per drafter")
    ax.grid(axis="x", alpha=0.3)
    _save(plt, fig, path, params)


def plot_e2e(groups: list[E2EGroup], path: Path, params: ReportParams) -> None:
    """tau at the paper and the tuned tree, and speedup at the tuned tree (with the lookup branch beside it, when
    decoded), per decoded setting."""
    plt, fig, (ax1, ax2) = _figure(params, 1, 2)
    short = {**VARIANT_NAMES, "eagle3": "EAGLE-3"}
    names = [f"{short.get(g.fields.get('variant'), g.fields.get('variant'))}"
             + (f"\n{g.fields['scale']}" if g.fields.get("scale") else "") for g in groups]
    x = range(len(groups))
    w = 0.38
    for off, kind, color, lab in ((-w / 2, "paper", "tab:blue", f"tree {_tree(list(PAPER_TREE))}"),
                                  (w / 2, "tuned", "tab:orange", "tuned tree")):
        stats = [getattr(g, kind)["tau"] for g in groups]
        ax1.bar([i + off for i in x], [s.mean if s else 0 for s in stats], w,
                yerr=[(s.std or 0) if s else 0 for s in stats], color=color, label=lab, error_kw={"lw": 1})
    ax1.set(ylabel="τ (accepted + 1 per round)", title="τ")
    bars = [("tuned", "tab:green", "drafter")]
    if any(g.lookup for g in groups):
        bars.append(("lookup", "tab:purple", "drafter + lookup branch"))
    w2 = 0.6 / len(bars)
    for i, (kind, color, lab) in enumerate(bars):
        sp = [(getattr(g, kind) or {}).get("speedup") for g in groups]
        ax2.bar([j + (i - (len(bars) - 1) / 2) * w2 for j in x], [s.mean if s else 0 for s in sp], w2,
                yerr=[(s.std or 0) if s else 0 for s in sp], color=color, label=lab, error_kw={"lw": 1})
    ax2.axhline(1.0, color="0.3", lw=1, ls="--")
    ax2.set(ylabel="speedup vs greedy", title="speedup (tuned tree)")
    if len(bars) > 1:
        ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), names, fontsize=7, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
    ax1.legend(fontsize=7)
    _save(plt, fig, path, params)


# -- the stage ------------------------------------------------------------------------------------------------

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


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _scale_order(context: dict, rows: Iterable[dict]) -> list[str]:
    """Data scales from smallest to largest: by the sizes the pipeline hands in, else by first appearance."""
    seen: list[str] = []
    for r in rows:
        if r.get("scale") is not None and r["scale"] not in seen:
            seen.append(r["scale"])
    sizes = context.get("data_sizes")
    if isinstance(sizes, dict) and all(isinstance(sizes.get(s), (int, float)) for s in seen):
        seen.sort(key=lambda s: sizes[s])
    return seen


@dataclass
class Results:
    """Everything the report shows, read and aggregated from the metrics files."""

    names: list[str]                          # studies: the configured ones first, then any others found
    configured: list[str]
    raw: dict[str, list[dict] | None]         # None: no metrics file
    studies: dict[str, list[Setting] | None]
    e2e_rows: list[dict] | None
    e2e: list[E2EGroup] | None
    scale_order: list[str]
    inputs: list[tuple[str, str]]             # (path, sha256 prefix) of every file read


def collect(context: dict, paths: Paths) -> Results:
    """Read metrics/stepwise/<study>.json for every configured study and metrics/e2e.json, and aggregate them."""
    configured = list(context.get("studies") or [])
    found = sorted(p.stem for p in (paths.root / "metrics" / "stepwise").glob("*.json"))
    names = configured + [n for n in found if n not in configured]
    inputs: list[tuple[str, str]] = []
    raw: dict[str, list[dict] | None] = {}
    for name in names:
        p = paths.stepwise_metrics(name)
        raw[name] = _read_rows(p) if p.is_file() else None
        if raw[name] is not None:
            inputs.append((str(p.relative_to(paths.root)), _sha(p)))
    e2e_rows = _read_rows(paths.e2e_metrics) if paths.e2e_metrics.is_file() else None
    if e2e_rows is not None:
        inputs.append((str(paths.e2e_metrics.relative_to(paths.root)), _sha(paths.e2e_metrics)))

    scale_order = _scale_order(context, [r for rows in raw.values() for r in rows or []] + (e2e_rows or []))
    studies = {n: (sort_settings(aggregate(n, rows), scale_order) if rows is not None else None)
               for n, rows in raw.items()}
    e2e = None
    if e2e_rows is not None:
        # An e2e row names its drafter by trial; trial names are unique within a study (the scale study unless
        # the row says otherwise), so the trial carries the full setting even when the row omits fields.
        trial_settings = {}
        for study in ["scale", *sorted({str(r["study"]) for r in e2e_rows if r.get("study")})]:
            trial_settings.update({str(r.get("trial")): {k: r.get(k) for k in SETTING_KEYS}
                                   for r in raw.get(study) or []})
        e2e = aggregate_e2e(e2e_rows, trial_settings)
        e2e.sort(key=lambda g: (
            VARIANT_ORDER.index(g.fields.get("variant")) if g.fields.get("variant") in VARIANT_ORDER else 99,
            scale_order.index(g.fields.get("scale")) if g.fields.get("scale") in scale_order else 99,
            *(str(g.fields.get(k)) for k in SETTING_KEYS)))
    return Results(names, configured, raw, studies, e2e_rows, e2e, scale_order, inputs)


def run(params: ReportParams, context: dict, paths: Paths, report: Report) -> None:
    """Read the metrics JSON, write reports/README.md and reports/figures/*.png (atomically)."""
    context = dict(context or {})
    papers = load_paper_numbers()
    tables = papers.get("tables", {})
    res = collect(context, paths)
    names, configured, raw, studies, e2e_rows, e2e = (res.names, res.configured, res.raw, res.studies,
                                                      res.e2e_rows, res.e2e)
    verdicts = findings(studies, e2e, res.scale_order, params)
    inputs = res.inputs

    fig_dir = paths.reports / "figures"
    written: list[str] = []

    def figure(name: str, draw: Callable[[Path], None]) -> str:
        draw(fig_dir / name)
        written.append(name)
        return f"figures/{name}"

    md = [f"# {params.title}", "",
          "Step-wise and end-to-end results of the KVShot drafter grid, read from the DVC-tracked metrics files "
          "listed under Provenance. Cells are mean ± sample std over seeds (n in the `seeds` column; no ± means "
          f"one seed). Columns marked **{PAPER_LABEL}** are the paper's own numbers for the same setting "
          f"({tables and 'see `stages/paper_numbers.yaml`'}); its target and data scale differ from ours, so "
          "compare shapes and orderings, not absolute values.", "",
          "## Findings", "",
          f"Verdicts: *{HOLDS}*, *{FAILS}*, *{NOISE}* (the difference is under {params.noise_sigmas:g}× the "
          f"spread over seeds), *{MISSING}* (no data).", ""]
    md.append(md_table(["claim", "statement", "verdict", "evidence"],
                       [[v.claim, v.statement, f"**{v.verdict}**", v.evidence] for v in verdicts]))
    md.append("")

    titles = {"injection": "Injection study (KV-only, 1 layer)", "depth": "Depth study (KV-only vs EAGLE-3)",
              "hybrid": "Hybrid study (hybrid and cross-only vs EAGLE-3)",
              "scale": "Scale study (end to end)"}
    for name in names:
        md += [f"## {titles.get(name, f'Study: {name}')}", ""]
        settings = studies[name]
        paper = tables.get(name)
        if paper:
            md += [f"Paper: {paper['title']}; {paper['data']}.", ""]
        if settings is None:
            md += [f"**missing**: no `{paths.stepwise_metrics(name).relative_to(paths.root)}` "
                   "(the study is configured but produced no metrics).", ""]
            if name != "scale":
                continue
        if name == "scale":
            if e2e is None:
                md += ["**missing**: no `metrics/e2e.json` (nothing was decoded end to end).", ""]
            md += [scale_table(settings or [], e2e or [], paper, context.get("data_sizes") or {}), ""]
            baselines = e2e_baselines(e2e_rows or [])
            if baselines:
                md += [baselines, ""]
            note = _paper_notes(paper, ["tau_paper_tree"])
            md += [x for x in (note, (paper or {}).get("note", "").strip()) if x]
            md.append("")
            if e2e:
                md += [f"![τ and speedup]({figure('e2e.png', lambda p: plot_e2e(e2e, p, params))})", ""]
        else:
            md += [stepwise_table(name, settings, paper), ""]
            note = _paper_notes(paper, GENERIC_METRICS)
            if note:
                md += [note, ""]
        if settings and any(s.n > 0 for s in settings):
            img = figure(f"alpha_{name}.png", lambda p: plot_alpha(name, settings, paper, p, params))
            md += [f"![α_k vs k, {name} study]({img})", ""]

    present = {n: s for n, s in studies.items() if s}
    if any(s.retention for ss in present.values() for s in ss):
        img = figure("retention.png", lambda p: plot_retention(present, tables, p, params))
        md += ["## Retention", "", f"![retention per drafter]({img})", ""]

    md += ["## Failed and missing trials", ""]
    problems = [[n, "–", "–", "missing", f"no {paths.stepwise_metrics(n).relative_to(paths.root)}"]
                for n in names if raw[n] is None]
    for n in names:
        for s in studies[n] or []:
            problems += [[n, str(r.get("trial")), _label(s), "failed", str(r["error"]).splitlines()[0][:200]]
                         for r in sorted(s.failed, key=lambda r: str(r.get("trial")))]
    if e2e_rows is None:
        problems.append(["e2e", "–", "–", "missing", "no metrics/e2e.json"])
    else:
        problems += [["e2e", str(r.get("trial")), VARIANT_NAMES.get(r.get("variant"), str(r.get("variant"))),
                      "failed", str(r.get("error") or "no tau").splitlines()[0][:200]]
                     for r in e2e_rows if r.get("status", "ok") != "ok" or r.get("tau") is None]
    md += [md_table(["study", "trial", "setting", "state", "error"], problems) if problems else "None.", ""]

    md += ["## Provenance", "",
           md_table(["item", "value"],
                    [["profile", _ctx(context, "profile")], ["target", _ctx(context, "target")],
                     ["data sizes", _ctx(context, "data_sizes")], ["git commit", _ctx(context, "git_commit")],
                     ["date", _ctx(context, "date")], ["hardware", _ctx(context, "hardware")],
                     ["total wall time", _ctx(context, "wall_time_s")],
                     *([["stage wall times", _stage_times(context["stage_times_s"])]]
                       if isinstance(context.get("stage_times_s"), dict) and context["stage_times_s"] else []),
                     ["studies configured", ", ".join(configured) or "unknown"],
                     *[[f"input `{p}`", f"sha256 {h}"] for p, h in inputs],
                     ["paper numbers", " ".join(str(papers.get("source", "")).split())]]), ""]

    for stale in sorted(fig_dir.glob("*.png")) if fig_dir.is_dir() else []:
        if stale.name not in written:   # a figure of a study that is gone must not linger
            stale.unlink()
    write_text_atomic(paths.reports / "README.md", "\n".join(md))
    n_failed = sum(len(s.failed) for ss in present.values() for s in ss)
    report({"report/settings": float(sum(len(s) for s in present.values())), "report/failed_trials": float(n_failed),
            "report/claims_holding": float(sum(v.verdict == HOLDS for v in verdicts))})
