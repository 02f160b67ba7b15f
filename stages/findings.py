"""The paper's claims decided from our numbers, by intervals (DESIGN §4).

Every claim is a difference of two settings' metrics (or a conjunction of such differences). A difference holds
when its 95% bootstrap interval lies above 0, fails when it lies below, and is *inconclusive* otherwise: with the
interval in the sentence. Differences between settings evaluated on the same conversations are paired (the
same resampled conversations on both sides); where a setting has several seeds its interval carries a t-interval
term over seeds (`models.stats`), over the per-seed differences when both settings ran the same seeds, and every
such verdict prints those per-seed differences. Like is compared with like: a setting run at one seed is compared
with its own seed's baseline (never a baseline pooled over seeds it never had), and its verdict says "one seed".
A claim whose settings are missing is *not measured*.

- P1: the deepest KV-only drafter keeps more of its accuracy than EAGLE-3 (step retention acc_6/acc_0) *and* is
  more accurate at step 6 (acc_6) *and* uses the target (acc_0 above the no-target control's, and above the
  control with context of its own depth, a causal language model over the prefix tokens, where one was trained).
- P2: KV-only step MAT grows with depth (deepest vs 1 layer) and the 1 -> 2 jump is the largest.
- P3: EAGLE-3's acc_0 is above the deepest KV-only drafter's (P1's); the other KV-only drafters are shown beside it.
- H: the EAGLE-3-initialised hybrid beats *EAGLE-3 continued for the same schedule* (the compute-matched
  baseline, never the parent alone) on step MAT.
- E: at the largest data scale decoded for both, the hybrid's relative τ gain over EAGLE-3 continued is smaller
  than `much_smaller_ratio` x its relative step-MAT gain (there must be a clear step-wise gain to shrink).
- B: the block-wise question (the paper's proposal): the block drafter reading the target KV (the arm run at the
  most seeds: `decisive_kv_arm`) beats the one reading projected hidden states, step-wise (step MAT, both
  free-running block drafters) and end to end (τ at the paper's tree, one tree shared by both). Block drafters'
  step accuracy is free-running, an autoregressive drafter's teacher-forced: the two families are never compared
  on step metrics.
P1 and P3 are decided on the deepest KV-only drafter, B on the KV-reading block arm run at the most seeds: which
settings decide is fixed by the design, never picked by their results (the best of several noisy settings would
favour a verdict by chance, and could decide on one seed while another setting ran at five).
Step metrics are the paper-comparable family (its α_k); chain acceptance is shown beside them in the tables.

Each verdict holds its level alone. Read together, six claims at 95% each would let some verdict be decided by
chance far more often than 5% of the time, so `family_wise` also decides the measured claims together, by Holm's
step-down on the same intervals: the chance that any of them is decided wrongly stays at 1 - level.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from models.stats import FAILS, HOLDS, INCONCLUSIVE, decide, interval, seed_differences
from stages.baselines import baseline_for
from stages.common import fmt
from stages.results import E2EGroup, E2EKind, Setting, label, like_with_like, same_conversations, same_prompts
from stages.sections import CONTINUED

MISSING = "not measured"
ONE_SEED = "one seed"   # how a difference resting on one seed, and a verdict decided on such alone, say so
CLAIMS = {
    "P1": "KV-only decays more gracefully than hidden-only: the deepest KV-only drafter above EAGLE-3 on step "
          "retention acc_6/acc_0 and on acc_6, and above the no-target controls at step 0 (without context, and "
          "with context at its own depth where trained)",
    "P2": "KV-only improves with depth (step MAT), the largest jump from 1 to 2 layers",
    "P3": "hidden-only is better at k = 0 (EAGLE-3's acc_0 above the deepest KV-only drafter's; the other KV-only "
          "drafters shown beside it)",
    "H": "the hybrid (EAGLE-3 checkpoint init) beats EAGLE-3 continued for the same schedule on step MAT",
    "E": "the hybrid's end-to-end τ gain over EAGLE-3 continued is much smaller than its step-wise MAT gain",
    "B": "block-wise drafting lets the KV path pay off: the KV-reading block drafter (the arm run at the most seeds) "
         "beats the hidden-state block drafter (step MAT and τ)",
}
# The studies each claim's verdict reads (B: the block study, at the learning rates block_lr chooses).
CLAIM_STUDIES: dict[str, tuple[str, ...]] = {"P1": ("injection", "depth"), "P2": ("depth",),
                                             "P3": ("injection", "depth"), "H": ("hybrid",), "E": ("scale",),
                                             "B": ("block", "block_lr")}
NAMES = {"acc_0": "acc_0", "acc_6": "acc_6", "step_mat": "step MAT", "step_retention": "step retention",
         "chain_mat": "chain MAT", "tau": "τ"}


@dataclass(frozen=True)
class Verdict:
    claim: str
    statement: str
    verdict: str
    evidence: str
    one_seed: bool = False      # every difference it is decided on rests on one seed (no seed term in its interval)


def fmt_ci(lo: float, hi: float, digits: int = 3, signed: bool = False) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "[–]"
    f = "+.{d}f" if signed else ".{d}f"
    return f"[{lo:{f.format(d=digits)}}, {hi:{f.format(d=digits)}}]"


def pct_ci(draws: np.ndarray | None, level: float) -> str:
    """The interval of relative changes, in percent."""
    lo, hi = interval(draws, level) if draws is not None else (math.nan, math.nan)
    return f"[{lo:+.1%}, {hi:+.1%}]" if math.isfinite(lo) and math.isfinite(hi) else "[–]"


@dataclass
class Contrast:
    """a − b on one metric: its point value, resampled values and verdict on "a − b > 0"; `seeds` says on which
    seeds it rests ("one seed (0)", "3 seeds: +0.07 / +0.21 / +0.15", ...)."""

    verdict: str
    diff: float
    ci: tuple[float, float]
    text: str
    seeds: str = ""


def seed_note(a: Setting, b: Setting, metric: str) -> str:
    """What the difference's seeds are: one seed, the per-seed differences, or unpaired seed counts."""
    if a.n <= 1 and b.n <= 1:
        labels = a.seed_labels or b.seed_labels
        return f"{ONE_SEED} ({labels[0]})" if labels else ONE_SEED
    diffs = seed_differences(a.seed_point(metric), b.seed_point(metric))
    if a.seed_labels and a.seed_labels == b.seed_labels and diffs:
        return f"{len(diffs)} paired seeds, per seed " + " / ".join(f"{d:+.3f}" for d in diffs.values())
    return f"seeds not paired ({a.n} vs {b.n})"


def contrast(a: Setting, b: Setting, metric: str, level: float = 0.95) -> Contrast:
    """a − b on `metric`, like with like; not measured where the two were evaluated on different conversations
    (another data split: `same_conversations`)."""
    a, b = like_with_like(a, b)
    seeds = seed_note(a, b, metric)
    name = NAMES.get(metric, metric)
    if not same_conversations(a, b):
        return Contrast(MISSING, math.nan, (math.nan, math.nan),
                        f"{name} {label(a)} vs {label(b)}: not compared, evaluated on different held-out "
                        f"conversations ({len(a.counts.ids)} vs {len(b.counts.ids)}: another data split)", seeds)
    da, db = a.resampled(metric), b.resampled(metric)
    diff = a.value(metric) - b.value(metric)
    if da is None or db is None:
        verdict, ci = INCONCLUSIVE, (math.nan, math.nan)
        note = "no interval: the rows lack per-conversation counts"
    else:
        verdict, ci = decide(da - db, level)
        note = f"difference {fmt(diff)} {fmt_ci(*ci, signed=True)}"
    text = (f"{name} {label(a)} {fmt(a.value(metric))} {fmt_ci(*a.ci(metric, level))} vs {label(b)} "
            f"{fmt(b.value(metric))} {fmt_ci(*b.ci(metric, level))}: {note} ({seeds})")
    return Contrast(verdict, diff, ci, text, seeds)


def on_one_seed(*contrasts: Contrast) -> bool:
    """Whether every one of these differences rests on one seed: a verdict decided on them says about the seed-0
    drafters, not about retraining them."""
    return bool(contrasts) and all(c.seeds.startswith(ONE_SEED) for c in contrasts)


def combine(*verdicts: str) -> str:
    """A conjunction of sub-claims: any failure fails it; then missing data; then any doubt."""
    if FAILS in verdicts:
        return FAILS
    if MISSING in verdicts:
        return MISSING
    return HOLDS if all(v == HOLDS for v in verdicts) else INCONCLUSIVE


# -- picking settings ------------------------------------------------------------------------------------------

def _ok(settings: list[Setting] | None) -> list[Setting]:
    return [s for s in settings or [] if s.n > 0]


def plain_eagle3(s: Setting) -> bool:
    f = s.fields
    return f.get("variant") == "eagle3" and f.get("init") != CONTINUED and not f.get("fc_norm") \
        and not f.get("norm_output")


def continued_eagle3(s: Setting | E2EGroup) -> bool:
    """EAGLE-3 continued for a checkpoint-initialised drafter's schedule (its compute-matched control), by its
    settings: e2e rows do not name roles."""
    f = s.fields
    return f.get("variant") == "eagle3" and f.get("init") == CONTINUED and not f.get("fc_norm") \
        and not f.get("norm_output")


def kv_reader(s: Setting) -> bool:
    return s.fields.get("variant") == "kv_only" and not s.fields.get("no_target")


def no_target(s: Setting) -> bool:
    """The paper's no-target control: no target information and no context (token t+1 and its own chain)."""
    f = s.fields
    return f.get("variant") == "kv_only" and s.is_role(
        "no-target control", bool(f.get("no_target")) and not f.get("token_context"))


def token_control(s: Setting) -> bool:
    """The control with context: a causal language model of the drafter's shape over the prefix's tokens."""
    f = s.fields
    return f.get("variant") == "kv_only" and s.is_role(
        "control with context", bool(f.get("no_target")) and bool(f.get("token_context")))


def _depth(s: Setting) -> int:
    return int(s.fields.get("depth") or 1)


def deepest_kv_only(kv: list[Setting]) -> Setting:
    """The KV-only drafter P1 and P3 are decided on: the deepest, among those the one run at the most seeds, then
    the first listed (never the one with the best result)."""
    return min(kv, key=lambda s: (-_depth(s), -s.n))


def kv_and_eagle(studies: dict[str, list[Setting] | None]) -> tuple[str | None, list[Setting], Setting | None]:
    """The study that compares KV-only with EAGLE-3: depth if it has both, else injection."""
    for name in ("depth", "injection"):
        ok = _ok(studies.get(name))
        kv, eg = [s for s in ok if kv_reader(s)], [s for s in ok if plain_eagle3(s)]
        if kv and eg:
            return name, kv, eg[0]
    return None, [], None


def control(studies: dict[str, list[Setting] | None], which=no_target, depth: int | None = None,
            like: Setting | None = None) -> Setting | None:
    """A control of kind `which` (the no-target control, or `token_control`), at `depth` when given, evaluated
    on the conversations of `like` where one such is (else any: the comparison then says why it is not made)."""
    found = [s for name in dict.fromkeys(("injection", "depth", *studies)) for s in _ok(studies.get(name))
             if which(s) and (depth is None or _depth(s) == depth)]
    same = [s for s in found if like is None or same_conversations(like, s)]
    return (same or found or [None])[0]


# -- the claims ------------------------------------------------------------------------------------------------

def claim_p1(studies: dict, level: float) -> Verdict:
    name, kv, eagle = kv_and_eagle(studies)
    if eagle is None:
        return Verdict("P1", CLAIMS["P1"], MISSING, "needs KV-only and EAGLE-3 trials in the depth or injection study")
    deepest = deepest_kv_only(kv)
    ret = contrast(deepest, eagle, "step_retention", level)
    acc6 = contrast(deepest, eagle, "acc_6", level)
    parts = [ret, acc6]
    evidence = f"{name} study: {ret.text}; {acc6.text}"
    ctrl = control(studies, like=deepest)
    if ctrl is None:
        used = [MISSING]
        evidence += "; no no-target control trial (kv_only with no_target) to show the KV path is used"
    else:
        uses = contrast(deepest, ctrl, "acc_0", level)
        used = [uses.verdict]
        parts.append(uses)
        evidence += f"; {uses.text}"
    # the control with context, at the KV-only drafter's own depth: the KV path must beat a language model of
    # the same shape over the same tokens, not only a bigram-like control (where one was trained)
    ctx = control(studies, token_control, _depth(deepest), like=deepest)
    if ctx is not None:
        beats = contrast(deepest, ctx, "acc_0", level)
        used.append(beats.verdict)
        parts.append(beats)
        evidence += f"; {beats.text}"
    return Verdict("P1", CLAIMS["P1"], combine(ret.verdict, acc6.verdict, *used), evidence, on_one_seed(*parts))


def claim_p2(studies: dict, level: float) -> Verdict:
    by_depth: dict[int, Setting] = {}
    for s in _ok(studies.get("depth")):
        if kv_reader(s):
            by_depth.setdefault(_depth(s), s)
    if 1 not in by_depth or 2 not in by_depth:
        return Verdict("P2", CLAIMS["P2"], MISSING, "needs KV-only trials at depths 1 and 2 in the depth study")
    depths = sorted(by_depth)
    # like with like: where a depth ran one seed, every depth is read at that seed
    single = [by_depth[d].seed_labels for d in depths if by_depth[d].n == 1 and by_depth[d].seed_labels]
    if single and all(single[0][0] in (by_depth[d].seed_labels or ()) for d in depths):
        by_depth = {d: s if s.n == 1 else s.only(single[0][0]) for d, s in by_depth.items()}
    improve = contrast(by_depth[depths[-1]], by_depth[1], "step_mat", level)
    curve = ", ".join(f"{d}: {fmt(by_depth[d].value('step_mat'))}" for d in depths)
    verdicts, notes = [improve.verdict], [f"deepest vs 1 layer: {improve.verdict} (difference "
                                          f"{fmt(improve.diff)} {fmt_ci(*improve.ci, signed=True)}, "
                                          f"{improve.seeds})"]

    def jump(a: int, b: int) -> tuple[float, np.ndarray | None]:
        sa, sb = by_depth[a], by_depth[b]
        pa, pb = sa.resampled("step_mat"), sb.resampled("step_mat")
        return sb.value("step_mat") - sa.value("step_mat"), (None if pa is None or pb is None else pb - pa)

    first, first_draws = jump(1, 2)
    for a, b in zip(depths[1:], depths[2:]):
        later, later_draws = jump(a, b)
        if first_draws is None or later_draws is None:
            v, ci = INCONCLUSIVE, (math.nan, math.nan)
        else:
            v, ci = decide(first_draws - later_draws, level)
        verdicts.append(v)
        notes.append(f"jump 1→2 ({fmt(first, 3)}) minus {a}→{b} ({fmt(later, 3)}): {fmt(first - later)} "
                     f"{fmt_ci(*ci, signed=True)}")
    return Verdict("P2", CLAIMS["P2"], combine(*verdicts), f"step MAT by depth {curve}; " + "; ".join(notes),
                   on_one_seed(improve))     # the jumps read the same drafters


def claim_p3(studies: dict, level: float) -> Verdict:
    name, kv, eagle = kv_and_eagle(studies)
    if eagle is None:
        return Verdict("P3", CLAIMS["P3"], MISSING, "needs KV-only and EAGLE-3 trials in the depth or injection study")
    deepest = deepest_kv_only(kv)
    c = contrast(eagle, deepest, "acc_0", level)
    others = "".join(f"; not decisive: {o.text}, {o.verdict}"
                     for o in (contrast(eagle, s, "acc_0", level) for s in kv if s is not deepest))
    return Verdict("P3", CLAIMS["P3"], c.verdict, f"{name} study: {c.text}{others}", on_one_seed(c))


def claim_h(studies: dict, level: float) -> Verdict:
    ok = _ok(studies.get("hybrid"))
    ckpt = [s for s in ok if s.fields.get("variant") == "hybrid" and s.fields.get("init") == "ckpt"]
    base = [s for s in ok if continued_eagle3(s)]
    extra = ""
    rand, fresh = [s for s in ok if s.fields.get("variant") == "hybrid" and s.fields.get("init") == "random"], \
        [s for s in ok if plain_eagle3(s)]
    if rand and fresh:      # the other compute-matched pair: both trained from scratch for one schedule
        r = contrast(rand[0], fresh[0], "step_mat", level)
        extra = f"; from scratch, {r.text} ({r.verdict})"
    if not ckpt or not base:
        return Verdict("H", CLAIMS["H"], MISSING,
                       "needs the checkpoint-initialised hybrid and EAGLE-3 continued (its compute-matched baseline) "
                       "in the hybrid study" + extra)
    c = contrast(ckpt[0], base[0], "step_mat", level)
    return Verdict("H", CLAIMS["H"], c.verdict, c.text + extra, on_one_seed(c))


def _e2e_pick(e2e: list[E2EGroup], pred, scale) -> E2EGroup | None:
    found = [g for g in e2e if pred(g) and g.fields.get("scale") == scale and g.kinds]
    return found[0] if found else None


def _rel(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None or b is None:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        return a / b - 1.0


def _e_at_scale(studies: dict, scale: Any, h: E2EGroup, e: E2EGroup, ratio: float,
                level: float) -> tuple[str, str, bool]:
    """E at one data scale: (verdict, evidence, whether there was a step-wise gain to shrink)."""
    kind = "paper" if "paper" in h.kinds and "paper" in e.kinds else "tuned"
    if kind not in h.kinds or kind not in e.kinds:
        return MISSING, f"scale {scale}: no τ on a common tree for the hybrid and EAGLE-3 continued", False
    kh, ke = h.kinds[kind], e.kinds[kind]
    if not same_prompts(kh, ke):
        return MISSING, f"scale {scale}: the hybrid and EAGLE-3 continued were decoded on different prompts", False
    hs = [s for s in _ok(studies.get("scale")) if s.fields.get("variant") == "hybrid"
          and s.fields.get("init") in ("ckpt", None) and s.fields.get("scale") == scale]
    es = [s for s in _ok(studies.get("scale")) if continued_eagle3(s) and s.fields.get("scale") == scale]
    if not hs or not es:
        return MISSING, (f"scale {scale}: no step-wise MAT of the hybrid and EAGLE-3 continued in the scale "
                         f"study"), False
    sh, se = hs[0], es[0]
    step = contrast(sh, se, "step_mat", level)
    rel_step = sh.value("step_mat") / se.value("step_mat") - 1
    rel_e2e = kh.point["tau"] / ke.point["tau"] - 1
    rs, re_ = _rel(sh.resampled("step_mat"), se.resampled("step_mat")), _rel(kh.tau, ke.tau)
    seeds = f", {h.n_seeds} seeds decoded" if h.n_seeds > 1 else ""
    evidence = (f"scale {scale}{seeds}: step MAT {fmt(sh.value('step_mat'))} vs {fmt(se.value('step_mat'))} = "
                f"{rel_step:+.1%} {pct_ci(rs, level)}; "
                f"τ at the {kind} tree {fmt(kh.point['tau'], 2)} {fmt_ci(*kh.ci('tau', level), 2)} vs "
                f"{fmt(ke.point['tau'], 2)} {fmt_ci(*ke.ci('tau', level), 2)} = {rel_e2e:+.1%} {pct_ci(re_, level)}")
    if "tuned" in h.kinds and "tuned" in e.kinds:
        evidence += (f"; speedup at the tuned tree {fmt(h.kinds['tuned'].point['speedup'], 2)}x vs "
                     f"{fmt(e.kinds['tuned'].point['speedup'], 2)}x")
    if step.verdict == MISSING:
        return MISSING, f"scale {scale}: {step.text}", False
    if step.verdict != HOLDS:
        why = "no clear step-wise gain to shrink" if step.verdict == INCONCLUSIVE else "no step-wise gain"
        return step.verdict, f"{evidence} ({why})", False
    if rs is None or re_ is None:
        return INCONCLUSIVE, f"{evidence} (no interval for τ: rows without per-prompt data)", True
    # step and τ draws share the seed draws where both have several seeds (the same drafters); conversations
    # and prompts are drawn independently
    verdict, ci = decide(ratio * rs - re_, level)
    evidence += f"; {ratio:g}× the step gain minus the τ gain {pct_ci(ratio * rs - re_, level)}"
    power = e_power(kh, ke, ratio * rel_step - rel_e2e, level)
    return verdict, evidence + (f" ({power})" if power else ""), True


TAU_TARGET = 0.015      # the τ gain's interval the study aims for: ±1.5%


def prompts_for(half: float, prompts: int, target: float) -> int:
    """Prompts that shrink a prompt-sampling half-width `half` (measured on `prompts`) to `target` (∝ 1/√n)."""
    return int(math.ceil(prompts * (half / target) ** 2))


def e_power(kh: E2EKind, ke: E2EKind, gap: float, level: float) -> str:
    """How many prompts would resolve E at the measured gains, and give the τ gain a ±1.5% interval: the prompt
    part of the τ gain's interval shrinks as 1/√prompts, its seed part does not (more seeds shrink that)."""
    if kh.tau_prompts is None or ke.tau_prompts is None or not kh.prompts:
        return ""
    lo, hi = interval(_rel(kh.tau, ke.tau), level)
    plo, phi = interval(_rel(kh.tau_prompts, ke.tau_prompts), level)
    if not all(math.isfinite(x) for x in (lo, hi, plo, phi)):
        return ""
    total, prompt = (hi - lo) / 2, (phi - plo) / 2
    seed = math.sqrt(max(total ** 2 - prompt ** 2, 0.0))
    parts = [f"power: the τ gain's interval is ±{total:.1%} on {kh.prompts} prompts (prompt part ±{prompt:.1%}, "
             f"seed part ±{seed:.1%})"]
    for what, target in ((f"resolving E at the measured gains ({gap:+.1%})", abs(gap)),
                         (f"a ±{TAU_TARGET:.1%} τ interval", TAU_TARGET)):
        if target <= seed or target == 0:
            parts.append(f"{what} takes more seeds: the seed part alone is wider")
        else:
            need = prompts_for(prompt, kh.prompts, math.sqrt(target ** 2 - seed ** 2))
            parts.append(f"{what} needs about {need:,} prompts")
    return "; ".join(parts)


def claim_e(studies: dict, e2e: list[E2EGroup] | None, scales: list[str], ratio: float, level: float) -> Verdict:
    """Decided at every data scale where both drafters were decoded and the hybrid has a step-wise gain to shrink;
    scales that disagree leave it inconclusive. With no such scale, the largest decoded one says why."""
    is_hyb = lambda g: g.fields.get("variant") == "hybrid" and g.fields.get("init") in ("ckpt", None)  # noqa: E731
    is_base = lambda g: continued_eagle3(g)  # noqa: E731
    found = []
    for scale in sorted({g.fields.get("scale") for g in e2e or []},
                        key=lambda s: scales.index(s) if s in scales else -1, reverse=True):
        h, e = _e2e_pick(e2e, is_hyb, scale), _e2e_pick(e2e, is_base, scale)
        if h and e:
            found.append((*_e_at_scale(studies, scale, h, e, ratio, level), h.n_seeds <= 1))
    if not found:
        return Verdict("E", CLAIMS["E"], MISSING, "needs end-to-end rows of the hybrid and EAGLE-3 continued at one "
                                                  "data scale")
    evidence = " — ".join(text for _, text, _, _ in found)
    tested = {v for v, _, gain, _ in found if gain}
    if not tested:
        return Verdict("E", CLAIMS["E"], found[0][0], evidence)
    if len(tested) > 1:
        return Verdict("E", CLAIMS["E"], INCONCLUSIVE, evidence + " (the scales disagree)")
    return Verdict("E", CLAIMS["E"], tested.pop(), evidence, all(one for _, _, gain, one in found if gain))


def claim_b(studies: dict, e2e: list[E2EGroup] | None, level: float) -> Verdict:
    ok = [s for s in _ok(studies.get("block")) if s.fields.get("variant") == "block"]
    hidden = [s for s in ok if (s.fields.get("context") or "hidden") == "hidden"]
    kv = [s for s in ok if s.fields.get("context") in ("kv", "both")]
    if not hidden or not kv:
        return Verdict("B", CLAIMS["B"], MISSING, "needs block drafters with hidden and kv/both context in the block "
                                                  "study")
    kv_arm = decisive_kv_arm(kv)
    hidden_arm = hidden_arm_of(kv_arm, hidden)
    step = contrast(kv_arm, hidden_arm, "step_mat", level)
    evidence = step.text
    if kv_arm.lrs and hidden_arm.lrs:       # each arm at the learning rate its validation chose (`choose`)
        kv_lr, hidden_lr = ("/".join(f"{v:g}" for v in s.lrs) for s in (kv_arm, hidden_arm))
        evidence += f" (trained at lr {kv_lr} vs {hidden_lr})" if kv_lr != hidden_lr else f" (both at lr {kv_lr})"
    verdicts = [step.verdict]
    groups = {tuple(g.trials): g for g in e2e or []}
    gk = next((g for g in groups.values() if set(g.trials) & set(kv_arm.trials)), None)
    gh = next((g for g in groups.values() if set(g.trials) & set(hidden_arm.trials)), None)
    if gk is None or gh is None:
        verdicts.append(MISSING)
        evidence += "; not decoded end to end"
    else:
        # one tree shared by both (the paper's): trees tuned per drafter would compare two settings
        kind = "paper" if "paper" in gk.kinds and "paper" in gh.kinds else None
        if kind is None or not same_prompts(gk.kinds[kind], gh.kinds[kind]):
            verdicts.append(MISSING)
            evidence += ("; no τ at the paper's tree for both" if kind is None else
                         "; τ not compared: the arms were decoded on different prompts")
        else:
            a, b = gk.kinds[kind], gh.kinds[kind]
            if a.tau is None or b.tau is None:
                v, ci = INCONCLUSIVE, (math.nan, math.nan)
            else:
                v, ci = decide(a.tau - b.tau, level)
            verdicts.append(v)
            seeds = f"{gk.n_seeds} seeds decoded" if gk.n_seeds > 1 else "one seed decoded"
            evidence += (f"; τ at the paper's tree {fmt(a.point['tau'], 2)} vs {fmt(b.point['tau'], 2)}: difference "
                         f"{fmt(a.point['tau'] - b.point['tau'], 2)} {fmt_ci(*ci, 2, signed=True)} ({seeds}); "
                         f"speedup at that tree {fmt(a.point['speedup'], 2)}x vs {fmt(b.point['speedup'], 2)}x")
    for other in (s for s in kv if s is not kv_arm):     # shown, never decisive (see decisive_kv_arm)
        c = contrast(other, hidden_arm_of(other, hidden), "step_mat", level)
        evidence += f"; not decisive: {c.text}, {c.verdict}"
    evidence += hidden_step0(hidden_arm, studies, level)
    return Verdict("B", CLAIMS["B"], combine(*verdicts), evidence, on_one_seed(step))   # τ: seed 0 decoded by design


def decisive_kv_arm(kv: list[Setting]) -> Setting:
    """The KV-reading block arm B is decided on, fixed by the design, not by the results: the one run at the most
    seeds (the study profile runs B's two arms at 5), at equal seeds the KV context before KV-plus-hidden, then the
    first listed. Deciding on the arm with the best result would favour "holds" by chance (the larger of two noisy
    values) and could decide B at one seed while another arm ran at five."""
    return min(kv, key=lambda s: (-s.n, s.fields.get("context") != "kv"))


def hidden_arm_of(kv: Setting, hidden: list[Setting]) -> Setting:
    """The hidden-context block arm a KV-reading one is compared with: its baseline, as the report's tables name it
    (`baselines.baseline_for`), else the hidden arm run at the most seeds."""
    return baseline_for(kv, hidden) or min(hidden, key=lambda h: -h.n)


def hidden_step0(hidden: Setting, studies: dict, level: float) -> str:
    """How the hidden-context block arm's acc_0 stands against the no-target control (which it must reach: it
    has all of the control's information and the target's) and EAGLE-3 (the same information, read autoregressively;
    at step 0 neither drafts from its own tokens, so the two step accuracies are one quantity)."""
    out = []
    ctrl = control(studies, no_target, like=hidden)
    eagle = next((s for s in _ok(studies.get("block")) if plain_eagle3(s)), None) or kv_and_eagle(studies)[2]
    for other, what in ((ctrl, "the no-target control"), (eagle, "EAGLE-3")):
        if other is not None:
            c = contrast(hidden, other, "acc_0", level)
            diff = f"{c.diff:+.3f}" if math.isfinite(c.diff) else "–"
            out.append(f"{what}: not compared (other conversations)" if c.verdict == MISSING else
                       f"{what} {fmt(other.value('acc_0'))}: {diff} {fmt_ci(*c.ci, signed=True)}")
    return f"; step 0 of the hidden block arm {fmt(hidden.value('acc_0'))} against " + ", ".join(out) if out else ""


def findings(studies: dict, e2e: list[E2EGroup] | None, scales: list[str], much_smaller_ratio: float = 0.5,
             level: float = 0.95, block: bool = False) -> list[Verdict]:
    """One verdict per claim of the paper (and the block question when a block study exists)."""
    out = [claim_p1(studies, level), claim_p2(studies, level), claim_p3(studies, level), claim_h(studies, level),
           claim_e(studies, e2e, scales, much_smaller_ratio, level)]
    if block or studies.get("block"):
        out.append(claim_b(studies, e2e, level))
    return out


def family_wise(verdicts_at: Callable[[float], list[Verdict]], level: float = 0.95) -> dict[str, str]:
    """Each measured claim's verdict when all of them are decided together at family-wise `level`, by Holm's
    step-down: with m claims still open, those whose verdict is decided (holds, or does not hold) at level
    1 - (1 - level) / m are decided and leave the family; repeat with the smaller m until none more is decided.
    The rest are inconclusive. `verdicts_at(level)` gives every claim's verdict at a level (the same draws, so
    only the interval's width changes). A claim that is inconclusive alone stays so; one decided alone may not
    survive. Holm holds the family-wise level whatever the claims' dependence (they share EAGLE-3's runs)."""
    alpha, alone = 1 - level, verdicts_at(level)
    open_ = {v.claim for v in alone if v.verdict in (HOLDS, FAILS)}
    together = {v.claim: INCONCLUSIVE for v in alone if v.verdict != MISSING}
    m = len(together)
    while open_:
        decided = {v.claim: v.verdict for v in verdicts_at(1 - alpha / m)
                   if v.claim in open_ and v.verdict in (HOLDS, FAILS)}
        if not decided:
            break
        together.update(decided)
        open_ -= decided.keys()
        m -= len(decided)
    return together


__all__ = ["CLAIMS", "Contrast", "E2EKind", "FAILS", "HOLDS", "INCONCLUSIVE", "MISSING", "ONE_SEED", "Verdict",
           "combine", "contrast", "family_wise", "findings", "fmt", "fmt_ci"]
