"""The report stage on synthetic metrics (tests/fixtures/report/make_fixtures.py): tables with intervals, the
paper's numbers, verdicts decided by intervals (holds, fails, inconclusive), old metrics without counts,
determinism."""
import copy
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from stages.common import Paths, StageError
from stages.findings import FAILS, HOLDS, INCONCLUSIVE, MISSING, findings
from stages.report import ReportParams, e2e_baselines, e2e_check_note, run
from stages.results import collect, scale_order

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "report"))
import make_fixtures as fx  # noqa: E402

STUDIES = ["injection", "depth", "hybrid", "scale"]
CONTEXT = {"profile": "default", "target": "embedded", "data_sizes": {"small": 300, "large": 1200},
           "git_commit": "0123abc", "date": "2026-05-01T10:00:00", "hardware": "2 CPU cores",
           "wall_time_s": 754.0, "stage_times_s": {"sweep:depth": 600.0, "prepare": 54.0, "e2e:scale": 100.0},
           "studies": STUDIES,
           "stage_machines": {"sweep:depth": "2 CPU cores, native bf16"}}
PNG = b"\x89PNG\r\n\x1a\n"
FAST = ReportParams(bootstrap_draws=400)


def project(tmp_path: Path, curves: dict | None = None, e2e: list | None = None, drop: tuple[str, ...] = (),
            edit=None) -> Paths:
    """A project root with synthetic metrics; `edit(study, rows)` may rewrite a study's rows ('e2e' too)."""
    rows = fx.studies(curves)
    e2e_rows = fx.e2e_rows(e2e)
    if edit:
        for name in list(rows):
            rows[name] = edit(name, rows[name]) or rows[name]
        e2e_rows = edit("e2e", e2e_rows) or e2e_rows
    rows = {k: v for k, v in rows.items() if k not in drop}
    fx.write(tmp_path / "metrics", rows, None if "e2e" in drop else e2e_rows)
    return Paths(tmp_path)


def bent(**changes) -> dict:
    """CURVES with some settings' (acc_0, acc_6) replaced: changes[study] = {trial stem: (a0, a6)}."""
    curves = copy.deepcopy(fx.CURVES)
    for study, by_stem in changes.items():
        curves[study] = [(stem, f, *by_stem.get(stem, (a0, a6)), seeds) for stem, f, a0, a6, seeds in curves[study]]
    return curves


def verdicts(paths: Paths) -> dict[str, str]:
    res = collect(CONTEXT, paths, draws=400)
    order = scale_order(CONTEXT, [r for rows in res.raw.values() for r in rows or []])
    return {v.claim: v.verdict for v in findings(res.studies, res.e2e, order)}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The full report once: all four studies, a configured study with no metrics, a stale figure."""
    paths = project(tmp_path_factory.mktemp("full"))
    stale = paths.reports / "figures" / "alpha_gone.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(PNG)
    seen = []
    run(FAST, {**CONTEXT, "studies": STUDIES + ["control"]}, paths, lambda m, step=None: seen.append(m))
    return paths, (paths.reports / "README.md").read_text(), seen


def section(text: str, title_start: str) -> str:
    m = re.search(rf"^## {re.escape(title_start)}.*?(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no section {title_start!r}"
    return m.group(0)


def table_row(text: str, *cells: str) -> list[str]:
    """The first table row whose leading cells are `cells`."""
    for line in text.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and parts[:len(cells)] == list(cells):
            return parts
    raise AssertionError(f"no row starting {cells}")


def header(text: str, first: str) -> list[str]:
    return table_row(text, first)


CI = r"\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\]"


def test_step_and_chain_tables_with_intervals_and_the_papers_numbers(full):
    _, text, _ = full
    inj = section(text, "Injection study")
    head = header(inj, "method")
    assert head[:7] == ["method", "RoPE fix", "seeds", "acc_0", "acc_6", "step retention", "step MAT"]
    assert "α_0 paper (Qwen3-8B)" in head and "Δ step MAT vs baseline" in head
    row = table_row(inj, "KV-only, linear", "yes")
    assert re.fullmatch(CI, row[3]) and row[-4:] == ["0.494", "0.353", "–", "1.84"]
    assert table_row(inj, "KV-only, head concat", "yes")[2:5] == ["0 (1 failed)", "failed", "failed"]
    ctrl = table_row(inj, "no target information (control)", "–")
    assert ctrl[-2:] == ["99.6%", "1.31"]                 # the paper's control row sits beside ours
    assert "Chain acceptance (what tree decoding sees)" in inj
    chain = table_row(inj.split("Chain acceptance")[1], "EAGLE-3 (hidden-only)")
    assert re.fullmatch(CI, chain[2]) and chain[-1] == "100.0%"

    depth = section(text, "Depth study")
    row = table_row(depth, "KV-only", "2")
    assert row[2] == "5"                                  # five seeds pooled
    assert all(re.fullmatch(CI, c) for c in row[3:6])
    assert row[-5:] == ["0.594", "0.497", "0.463", "77.9%", "2.23"]
    assert row[header(depth, "drafter").index("Δ step MAT vs baseline")].startswith("EAGLE-3 (hidden-only): -")

    hyb = section(text, "Hybrid study")
    ckpt = table_row(hyb, "hybrid", "EAGLE-3 checkpoint")
    assert ckpt[-1] == "2.54"
    vs = header(hyb, "variant").index("Δ step MAT vs baseline")
    assert ckpt[vs].startswith("EAGLE-3 (hidden-only) continued: +")          # compute-matched baseline
    # one seed: against its own seed's EAGLE-3, not the five seeds pooled
    assert table_row(hyb, "hybrid", "random")[vs].startswith("EAGLE-3 (hidden-only) (seed 0): ")
    assert table_row(hyb, "EAGLE-3 (hidden-only) continued", "–")[vs].startswith("EAGLE-3 (hidden-only): ")

    scale = section(text, "Scale study")
    row = table_row(scale, "EAGLE-3 (hidden-only) continued", "large (1200)")
    assert row[header(scale, "drafter").index("τ (8, 10, 60) paper (Qwen3-8B)")] == "5.01"
    assert re.fullmatch(r"2\.\d\d \[2\.\d\d, 2\.\d\d\]", row[5])
    assert table_row(scale, "hybrid, ckpt init", "large (1200)")[-1] == "yes"
    assert table_row(scale, "prompt lookup")[8].startswith("1.42")


def test_figures_referenced_exist_and_stale_ones_go(full):
    paths, text, _ = full
    refs = re.findall(r"!\[[^]]*\]\((figures/[^)]+)\)", text)
    assert {Path(r).name for r in refs} == {"alpha_injection.png", "alpha_depth.png", "alpha_hybrid.png",
                                            "alpha_scale.png", "retention.png", "e2e.png"}
    for ref in refs:
        assert (paths.reports / ref).read_bytes()[:8] == PNG
    assert sorted(p.name for p in (paths.reports / "figures").iterdir()) == sorted(Path(r).name for r in refs)


def test_failed_missing_and_provenance(full):
    _, text, seen = full
    fail = section(text, "Failed and missing trials")
    assert table_row(fail, "control", "–", "–", "missing")
    assert table_row(fail, "injection", "kv_only-head_concat-rope")[3:] == ["failed",
                                                                             "RuntimeError: CUDA out of memory"]
    assert "**missing**: no `metrics/stepwise/control.json`" in section(text, "Study: control")
    prov = section(text, "Provenance")
    for cell in ("0123abc", "2 CPU cores", "754 s (12.6 min)", "e2e:scale 100 s, prepare 54 s, sweep:depth 600 s",
                 "small: 300, large: 1200", "arXiv 2604.26412", "95% percentile bootstrap, 400 draws"):
        assert cell in prov
    assert re.search(r"input `metrics/e2e.json`\s*\| sha256 [0-9a-f]{12}", prov)
    assert table_row(prov, "depth")[1:] == ["26", "0123abc", "not recorded", "10.0 min (sweep)", "–",
                                            "2 CPU cores, native bf16"]
    assert table_row(prov, "hybrid")[4:] == ["19.0 min (sum of trials)", "–", "not recorded"]
    assert table_row(prov, "scale")[5] == "1.7 min"   # its end-to-end decoding, timed apart
    assert seen == [{"report/settings": 24.0, "report/failed_trials": 1.0, "report/claims_holding": 5.0}]


def test_every_claim_holds_on_the_paper_like_fixture(full):
    _, text, _ = full
    findings_md = section(text, "Findings")
    # E's decoding ran one seed: its verdict says so (it speaks of the seed-0 drafters)
    want = {"P1": f"**{HOLDS}**", "P2": f"**{HOLDS}**", "P3": f"**{HOLDS}**", "H": f"**{HOLDS}**",
            "E": f"**{HOLDS}** (one seed)"}
    assert {c: table_row(findings_md, c)[2] for c in want} == want
    assert "[+" in table_row(findings_md, "H")[4]        # the difference's interval is in the evidence
    # decided together with the other four (Holm): the fixture's differences are wide of 0
    assert "| with the other claims (Holm)" in findings_md and "decides the 5 measured claims together" in findings_md
    assert {c: table_row(findings_md, c)[3] for c in want} == want


@pytest.mark.parametrize("claim,curves,expected", [
    # KV-only decays fast: its retention below EAGLE-3's
    ("P1", bent(depth={f"kv_only-d{d}": (0.6, 0.3) for d in (1, 2, 3, 4)}), FAILS),
    # the deepest KV-only no better than the no-target control at step 0 (it does not use the target)
    ("P1", bent(injection={"kv_only-no_target": (0.70, 0.69)}), FAILS),
    # ... or than the control with context of its own depth (a language model over the same tokens)
    ("P1", bent(depth={"kv_only-d4-token_context": (0.70, 0.69)}), FAILS),
    # deepest KV-only and EAGLE-3 alike: inconclusive, not a win
    ("P1", bent(depth={"kv_only-d4": (0.638, 0.470)}), INCONCLUSIVE),
    # the 3 -> 4 jump dwarfs 1 -> 2
    ("P2", bent(depth={"kv_only-d4": (0.75, 0.70)}), FAILS),
    # depth changes nothing
    ("P2", bent(depth={f"kv_only-d{d}": (0.494, 0.353) for d in (2, 3, 4)}), INCONCLUSIVE),
    ("P3", bent(depth={"eagle3": (0.55, 0.40)}), FAILS),
    ("P3", bent(depth={"eagle3": (0.615, 0.469)}), INCONCLUSIVE),
    # the hybrid's gain was the extra training: EAGLE-3 continued is as good
    ("H", bent(hybrid={"eagle3-continued": (0.665, 0.514)}), INCONCLUSIVE),
    ("H", bent(hybrid={"hybrid-ckpt": (0.60, 0.44)}), FAILS),
    # no step-wise gain at either decoded scale: nothing to shrink
    ("E", bent(scale={"hybrid-large": (0.642 + 0.03, 0.474 + 0.03), "hybrid-small": (0.642, 0.474)}), INCONCLUSIVE),
    # none at the large scale, but the small one has a gain to test: decided there
    ("E", bent(scale={"hybrid-large": (0.642 + 0.03, 0.474 + 0.03)}), HOLDS),
])
def test_verdicts_follow_the_intervals(tmp_path, claim, curves, expected):
    got = verdicts(project(tmp_path, curves=curves))
    assert got[claim] == expected


def test_e_fails_when_the_end_to_end_gain_is_as_large(tmp_path):
    e2e = [(t, tree, kind, tau + (0.6 if t.startswith("hybrid") and kind == "paper" else 0.0), s, sh)
           for t, tree, kind, tau, s, sh in fx.E2E]
    assert verdicts(project(tmp_path, e2e=e2e))["E"] == FAILS


def _seeded_e2e(shift: float) -> list[dict]:
    """Tuned-tree rows of EAGLE-3 continued and the hybrid at scale small, seeds 0-2: the seeds far apart in τ,
    the hybrid `shift` above its own seed's continued on every prompt, and each seed at its own tree."""
    rows = []
    for seed, tau in ((0, 1.5), (1, 2.5), (2, 2.0)):
        base = fx.e2e_rows([("eagle3-continued-small", [4, 2, 8], "tuned", tau, 1.2, 0.3)])[0]
        for trial, variant, init, add in (("eagle3-small-continued", "eagle3", "continued", 0.0),
                                          ("hybrid-small", "hybrid", "ckpt", shift)):
            row = copy.deepcopy(base)
            pp = row["per_prompt"]
            pp["accepted"] = [a + add * r for a, r in zip(pp["accepted"], pp["rounds"])]
            row.update(trial=f"{trial}-s{seed}", variant=variant, init=init, seed=seed, tree=[2 + seed, 2, 8],
                       tau=sum(pp["accepted"]) / sum(pp["rounds"]), study="scale")
            rows.append(row)
    return rows


def test_e2e_seeds_are_pooled_and_paired_by_seed():
    """Several decoded seeds of one setting: τ pooled over seeds and prompts, each seed at its own tuned tree, and
    the draws of two settings on the same seeds paired (a constant per-prompt gain reads as exactly that gain,
    although the seeds alone differ by 1.0 in τ)."""
    from stages.results import Resampler, e2e_groups
    rows = _seeded_e2e(0.1)
    groups = {g.fields["variant"]: g for g in e2e_groups(rows, {}, Resampler(400))}
    h, c = groups["hybrid"].kinds["tuned"], groups["eagle3"].kinds["tuned"]
    assert groups["hybrid"].n_seeds == 3 and h.tree == [[2, 2, 8], [3, 2, 8], [4, 2, 8]]
    cont = [r for r in rows if r["variant"] == "eagle3"]
    pooled = sum(sum(r["per_prompt"]["accepted"]) for r in cont) / sum(sum(r["per_prompt"]["rounds"]) for r in cont)
    assert c.point["tau"] == pytest.approx(pooled)
    assert h.tau is not None and c.speedup is not None
    assert h.tau - c.tau == pytest.approx(0.1)             # paired: the seeds' spread cancels
    assert (c.tau.max() - c.tau.min()) > 0.3                 # while each side alone spans the seeds
    # the same rows in another order give the same draws
    again = {g.fields["variant"]: g for g in e2e_groups(rows[::-1], {}, Resampler(400))}
    assert (again["hybrid"].kinds["tuned"].tau == h.tau).all()


def test_e_is_decided_over_decoded_seeds(tmp_path):
    """With three decoded seeds per drafter (as the study decodes its small scale), E still gets an interval."""
    def seeded(name, rows):
        if name == "e2e":
            return [r for r in rows if r.get("scale") != "small"] + _seeded_e2e(0.5)
    res = collect(CONTEXT, project(tmp_path, edit=seeded), draws=400)
    order = scale_order(CONTEXT, [r for rows in res.raw.values() for r in rows or []])
    e = next(v for v in findings(res.studies, res.e2e, order) if v.claim == "E")
    small = e.evidence.split(" — ")[1]
    assert small.startswith("scale small, 3 seeds decoded") and "no interval" not in small, e.evidence
    # the large scale has a step-wise gain and a τ gain half as large (holds); the small one a τ gain as large as
    # its step gain (fails): the scales disagree
    assert e.verdict == INCONCLUSIVE and e.evidence.endswith("(the scales disagree)")
    assert verdicts(project(tmp_path / "small", edit=lambda name, rows: _seeded_e2e(0.5) if name == "e2e"
                            else None))["E"] == FAILS


def test_h_is_not_measured_without_the_compute_matched_baseline(tmp_path):
    def drop_continued(name, rows):
        return [r for r in rows if r.get("init") != "continued"] if name == "hybrid" else rows
    got = verdicts(project(tmp_path, edit=drop_continued))
    assert got["H"] == MISSING


def test_missing_studies_are_not_measured(tmp_path):
    got = verdicts(project(tmp_path, drop=("depth", "injection", "hybrid", "e2e")))
    assert got == {c: MISSING for c in ("P1", "P2", "P3", "H", "E")}


def test_deterministic_apart_from_the_date(tmp_path):
    texts, figs = [], []
    for i, date in enumerate(("2026-05-01", "2026-06-02")):
        paths = project(tmp_path / str(i))
        run(FAST, {**CONTEXT, "date": date}, paths, lambda m, step=None: None)
        texts.append((paths.reports / "README.md").read_text().splitlines())
        figs.append({p.name: p.read_bytes() for p in sorted((paths.reports / "figures").iterdir())})
    assert figs[0] == figs[1]
    assert len(texts[0]) == len(texts[1])
    assert [(a, b) for a, b in zip(*texts) if a != b] == [("| date                | 2026-05-01 |",
                                                           "| date                | 2026-06-02 |")] or \
        all("2026-05-01" in a and "2026-06-02" in b for a, b in zip(*texts) if a != b)


def test_old_metrics_without_counts_render_with_intervals_missing(tmp_path):
    """A metrics file from before per-conversation counts: point values, `[–]` intervals, nothing decided."""
    (tmp_path / "metrics" / "stepwise").mkdir(parents=True)
    rows = [{"trial": f"kv_only-d{d}", "variant": "kv_only", "depth": d, "alpha": [0.5 + 0.1 * d] * 7,
             "acc": [0.5 + 0.1 * d] * 7, "mat": 3.0, "retention": 1.0} for d in (1, 2)]
    rows.append({"trial": "eagle3", "variant": "eagle3", "depth": 1, "alpha": [0.6, 0.5, 0.4, 0.3, 0.2, 0.2, 0.1]})
    (tmp_path / "metrics" / "stepwise" / "depth.json").write_text(json.dumps(rows))
    paths = Paths(tmp_path)
    run(FAST, {"studies": ["depth"]}, paths, lambda m, step=None: None)
    text = (paths.reports / "README.md").read_text()
    row = table_row(section(text, "Depth study"), "KV-only", "2")
    assert row[3] == "0.700 [–]"
    assert table_row(section(text, "Findings"), "P2")[2] == f"**{INCONCLUSIVE}**"
    assert "| profile" in text and "unknown" in text and "no metrics/e2e.json" in text


def test_malformed_metrics_name_the_file(tmp_path):
    (tmp_path / "metrics" / "stepwise").mkdir(parents=True)
    (tmp_path / "metrics" / "stepwise" / "depth.json").write_text('[{"trial": "a", ')
    with pytest.raises(StageError, match=r"depth\.json: not valid JSON"):
        run(FAST, {"studies": ["depth"]}, Paths(tmp_path), lambda m, step=None: None)
    (tmp_path / "metrics" / "stepwise" / "depth.json").write_text('{"trial": "a"}')
    with pytest.raises(StageError, match=r"depth\.json: expected a JSON list"):
        run(FAST, {"studies": ["depth"]}, Paths(tmp_path), lambda m, step=None: None)


def test_e2e_baselines_say_when_drafters_ran_in_int8():
    row = {"baseline_tokens_per_s": 40.0, "spec_off_tokens_per_s": 44.0, "prompt_lookup_speedup": 1.2,
           "prompt_lookup_tau": 1.4}
    native = e2e_baselines([row | {"drafter_weights": "native"}])
    assert native.startswith("Baselines in the same run: plain greedy `generate` 40.0 tokens/s")
    assert "speculation off 1.10x" in native and "int8" not in native
    assert e2e_baselines([row | {"drafter_weights": "int8"}]).endswith("(e2e.drafter_weights=int8).")


def test_e2e_baselines_of_a_study_decoded_in_two_runs_are_stated_per_run():
    first = {"baseline_tokens_per_s": 20.0, "spec_off_tokens_per_s": 22.0}
    second = {"baseline_tokens_per_s": 30.0, "spec_off_tokens_per_s": 30.0}
    text = e2e_baselines([first | {"trial": "block-kv"}, first | {"trial": "block-hidden"},
                          second | {"trial": "block-both"}])
    assert text == ("Baselines in the run of block-hidden, block-kv: plain greedy `generate` 20.0 tokens/s (the "
                    "speedup reference); our loop with speculation off 1.10x. Baselines in the run of block-both: "
                    "plain greedy `generate` 30.0 tokens/s (the speedup reference); our loop with speculation off "
                    "1.00x.")


def test_e2e_check_note_says_what_lossless_means_in_bf16():
    bf16 = {"dtype": "bfloat16", "tie_tolerance": 0.25, "max_tie_gap": 0.125, "exact_match": 0.5, "lossless": True}
    note = e2e_check_note([bf16, bf16 | {"max_tie_gap": 0.0625}])
    assert note.startswith("Decoded in bfloat16: *exact match*") and "gap ≤ 0.25; the largest here 0.125" in note
    assert e2e_check_note([bf16 | {"dtype": "float32"}]) == ""          # fp32: lossless is exact equality
    assert e2e_check_note([bf16 | {"status": "failed"}]) == ""


def test_continued_from_a_parent_on_other_settings_is_compared_with_that_parent(tmp_path):
    """`train.parent`: the large children start from the small scale's EAGLE-3. The hybrid is compared with
    EAGLE-3 continued of its own schedule, and continued with the small EAGLE-3 it started from."""
    from stages.baselines import baseline_for

    parent = {"scale": "small", "epochs": 1.5}
    specs = [("eagle3-small", dict(variant="eagle3"), 0.40, 0.30, {}),
             ("eagle3-large-continued", dict(variant="eagle3", init="continued", scale="large"), 0.45, 0.35,
              {"train.epochs": 1, "train.parent": parent}),
             ("hybrid-large", dict(variant="hybrid", scale="large"), 0.46, 0.36,
              {"train.epochs": 1, "train.parent": parent})]
    rows = []
    for stem, fields, a0, a6, extra in specs:
        for seed in (0, 1):
            r = fx.row("scale", stem, fields, a0, a6, seed, 2)
            r["values"] = {"drafter.variant": fields["variant"], "train.scale": fields.get("scale", "small"),
                           "train.seed": seed, **extra}
            rows.append(r)
    fx.write(tmp_path / "metrics", {"scale": rows}, None)
    settings = collect({"studies": ["scale"]}, Paths(tmp_path), draws=200).studies["scale"]
    by = {s.trials[0].rsplit("-s", 1)[0]: s for s in settings}
    assert baseline_for(by["hybrid-large"], settings) is by["eagle3-large-continued"]
    assert baseline_for(by["eagle3-large-continued"], settings) is by["eagle3-small"]
    assert baseline_for(by["eagle3-small"], settings) is None


def test_extra_swept_values_split_settings(tmp_path):
    rows = []
    for lr in (0.001, 0.002):
        for seed in (0, 1):
            r = fx.row("lr", f"lr{lr}", dict(variant="kv_only"), 0.5 + lr * 50, 0.3, seed, 2)
            r["values"] = {"drafter.variant": "kv_only", "train.lr": lr, "train.seed": seed}
            rows.append(r)
    fx.write(tmp_path / "metrics", {"lr": rows}, None)
    res = collect({"studies": ["lr"]}, Paths(tmp_path), draws=200)
    assert [(s.extra, s.n) for s in res.studies["lr"]] == [({"train.lr": 0.001}, 2), ({"train.lr": 0.002}, 2)]
    run(FAST, {"studies": ["lr"]}, Paths(tmp_path), lambda m, step=None: None)
    text = (tmp_path / "reports" / "README.md").read_text()
    assert table_row(section(text, "Study: lr"), "KV-only, 1 layer, linear, train.lr=0.002")[1] == "2"


def test_alpha_on_few_chains_shows_its_count(tmp_path):
    rows = fx.studies()["injection"]
    r = next(x for x in rows if x["trial"] == "eagle3")
    r["per_conversation"] = {k: v[:3] for k, v in r["per_conversation"].items()}   # a tiny eval set
    fx.write(tmp_path / "metrics", {"injection": [r]}, None)
    run(FAST, {"studies": ["injection"]}, Paths(tmp_path), lambda m, step=None: None)
    text = section((tmp_path / "reports" / "README.md").read_text(), "Injection study")
    assert "few chains (n=…): α_k is measured on the chains still alive" in text
    chain = text.split("Chain acceptance")[1]
    row = table_row(chain, "EAGLE-3 (hidden-only)")
    assert re.fullmatch(r"few chains \(n=\d+\)", row[4])                 # α_6: a count, no value
    assert row[5].startswith("few chains (n=") and "%" not in row[5]     # nor a retention percentage
    assert "(n=" not in row[2]


def test_settings_on_the_same_seeds_are_paired_by_seed():
    """Hybrid-ckpt-sN and EAGLE-3 continued-sN share seed N's parent: a seed effect common to both (±8 correct
    tokens per conversation) must not blur a constant +1; a setting on other seeds is resampled on its own."""
    from stages.findings import contrast
    from stages.results import Resampler, settings_of

    base = fx.row("hybrid", "base", {}, 0.5, 0.3, 0, 1)["per_conversation"]

    def trial(stem: str, fields: dict, seed: int, shift: int, plus: int) -> dict:
        per = copy.deepcopy(base)
        per["correct"] = [[min(v, max(0, c + shift + plus)) for c, v in zip(cs, vs)]
                          for cs, vs in zip(per["correct"], per["valid"])]
        r = fx.row("hybrid", stem, fields, 0.5, 0.3, seed, 3)
        return {**r, "per_conversation": per}

    shifts = {0: -8, 1: 0, 2: 8}
    rows = [trial("hybrid-ckpt", dict(variant="hybrid"), s, d, 1) for s, d in shifts.items()]
    rows += [trial("eagle3-continued", dict(variant="eagle3", init="continued"), s, d, 0) for s, d in shifts.items()]
    rows += [trial("eagle3", dict(variant="eagle3"), s, d, 0) for s, d in ((3, -8), (4, 0), (5, 8))]
    hyb, cont, other = settings_of("hybrid", rows, Resampler(draws=400))
    assert hyb.counts.pairable_seeds == cont.counts.pairable_seeds == ("0", "1", "2")
    assert contrast(hyb, cont, "acc_0").verdict == HOLDS
    assert contrast(hyb, other, "acc_0").verdict == INCONCLUSIVE     # seeds 3-5: not the same runs' seeds


def test_a_study_run_in_parts_sums_its_parts_times_and_machines():
    from stages.report_provenance import study_entries, study_time

    times = {"sweep:scale --only train.scale=small": 600.0, "sweep:scale --only train.scale=large": 900.0,
             "sweep:scalex": 5.0, "sweep:block": 100.0, "e2e:scale": 60.0}
    assert study_time(times, "sweep", "scale") == 1500.0      # not sweep:scalex, another study
    assert study_time(times, "sweep", "block") == 100.0 and study_time(times, "e2e", "scale") == 60.0
    assert study_time(times, "sweep", "depth") is None
    assert study_entries({"sweep:scale": "A", "sweep:scale --only train.seed=1": "B"}, "sweep", "scale") == ["A", "B"]


def test_a_verdict_on_a_study_with_planned_trials_not_run_is_provisional(tmp_path):
    """While a study's plan holds trials without rows (a rerun halfway), the verdicts that read it say so, and
    the findings name the study, how many trials are waiting and which claims read it; the others do not."""
    paths = project(tmp_path)
    replayed = {"hybrid/seeds34": {"trials": 4, "missing": ["hybrid-ckpt-s3", "eagle3-continued-s3"]},
                "hybrid/seed0": {"trials": 4, "replayed_s": 60.0}}
    run(FAST, {**CONTEXT, "parts_replayed": replayed}, paths, lambda m: None)
    findings_md = section((paths.reports / "README.md").read_text(), "Findings")
    verdicts = {row[0]: row[2] for row in (_cells(ln) for ln in findings_md.splitlines() if ln.startswith("| "))
                if row[0] in ("P1", "P2", "P3", "H", "E", "B")}
    assert verdicts["H"].endswith("** (provisional)"), verdicts
    assert not any("provisional" in v for c, v in verdicts.items() if c != "H"), verdicts
    assert "hybrid: 2 planned trials not run yet, read by H" in findings_md
    run(FAST, {**CONTEXT, "parts_replayed": {"hybrid/seed0": {"trials": 4, "replayed_s": 60.0}}}, paths,
        lambda m: None)
    assert "provisional" not in section((paths.reports / "README.md").read_text(), "Findings")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_each_part_states_its_one_go_wall_time_and_the_budget(tmp_path):
    """The parts table: a part run from a fresh workspace is held to the budget, one run where the data stages
    were already there is not (its time leaves them out), nor one resumed after an interruption (its time is the
    rest of a run), one never run in one go says so."""
    paths = project(tmp_path)
    parts = {"depth": {"seed0": {"train.seed": [0]}, "seeds12": {"train.seed": [1, 2]},
                       "seeds34": {"train.seed": [3, 4]}},
             "scale": {"large": {"train.scale": ["large"]}}}
    runs = {"depth/seed0": {"wall_s": 7200.0, "data_stages_s": 1800.0, "fresh": True, "commit": "abc1234",
                            "machine": "2 CPU cores"},
            "depth/seeds12": {"wall_s": 9600.0, "data_stages_s": 2000.0, "fresh": True, "commit": "abc1234",
                              "machine": "2 CPU cores"},
            "depth/seeds34": {"wall_s": 1200.0, "data_stages_s": 300.0, "fresh": True, "commit": "abc1234",
                              "machine": "2 CPU cores", "begun_before": 2},
            "scale/large": {"wall_s": 600.0, "data_stages_s": 3.0, "fresh": False, "commit": "def5678",
                            "machine": "another"}}
    replayed = {"depth/seed0": {"trials": 4, "replayed_s": 5400.0}, "depth/seeds12": {"trials": 4, "missing": ["x"]}}
    run(ReportParams(bootstrap_draws=400, budget_min=150), {**CONTEXT, "study_parts": parts, "parts_run": runs,
                                                            "parts_replayed": replayed}, paths, lambda m: None)
    prov = section((paths.reports / "README.md").read_text(), "Provenance")
    assert "the budget: 150 min each, from a fresh workspace" in prov
    assert table_row(prov, "depth", "seed0")[2:] == ["train.seed=0", "4", "90.0 min", "120.0 min",
                                                     "30.0 min, fresh workspace", "abc1234", "2 CPU cores", "yes"]
    assert table_row(prov, "depth", "seeds12")[3:5] == ["4", "–"] and table_row(prov, "depth", "seeds12")[-1] == "no"
    assert table_row(prov, "scale", "large")[5:] == ["10.0 min", "0.1 min, already there", "def5678", "another",
                                                     "– (not from a fresh workspace)"]
    assert table_row(prov, "depth", "seeds34")[5] == "20.0 min (2 of its trials begun before)"
    assert table_row(prov, "depth", "seeds34")[-1] == "– (resumed)"
    # a part run where the data stages were already there, with their recorded time in place of its own
    times = {**CONTEXT["stage_times_s"], "regenerate": 1500.0, "features": 246.0}      # 1,800 s with prepare's
    run(ReportParams(bootstrap_draws=400, budget_min=150), {**CONTEXT, "stage_times_s": times, "study_parts": parts,
                                                            "parts_run": runs, "parts_replayed": replayed},
        paths, lambda m: None)
    prov = section((paths.reports / "README.md").read_text(), "Provenance")
    assert table_row(prov, "scale", "large")[-1] == "yes (40 min with the data stages as recorded)"
    assert table_row(prov, "injection", "(whole)")[2:6] == ["–", "–", "–", "not run in one go"]   # no parts: one
    paths = project(tmp_path / "never")
    run(FAST, {**CONTEXT, "study_parts": {"scale": {"large": {"train.scale": ["large"]}}}}, paths, lambda m: None)
    prov = section((paths.reports / "README.md").read_text(), "Provenance")
    assert table_row(prov, "scale", "large")[2:] == ["train.scale=large", "–", "–", "not run in one go", "–", "–", "–"]
    # trials with no row yet, estimated from the paces of their settings' rows: an estimate, and said to be one
    estimate = {"scale/large": {"trials": 3, "missing": ["a", "b"], "estimated": ["a", "b"], "estimated_s": 4090.0}}
    run(FAST, {**CONTEXT, "study_parts": {"scale": {"large": {"train.scale": ["large"]}}},
               "parts_replayed": estimate}, paths, lambda m: None)
    prov = section((paths.reports / "README.md").read_text(), "Provenance")
    assert table_row(prov, "scale", "large")[3:5] == ["3", "about 68 min (2 of 3 trials not run yet, estimated from "
                                                           "paces)"]
    # and the trials not run yet are listed as such, with the part that runs them
    missing = section((paths.reports / "README.md").read_text(), "Failed and missing trials")
    assert table_row(missing, "scale", "a", "–", "not run yet")[-1] == \
        "planned by the profile; `kvshot repro --part scale/large` runs it"
    paths = project(tmp_path / "none")
    run(FAST, CONTEXT, paths, lambda m: None)   # a profile without parts: no such table
    assert "Per part" not in (paths.reports / "README.md").read_text()


def test_the_scale_sections_tie_note_reads_the_scale_decodings_only(tmp_path):
    def edit(name, rows):
        if name != "e2e":
            return rows
        bf16 = {"dtype": "bfloat16", "tie_tolerance": 0.25, "max_tie_gap": 0.125}
        rows = [r | bf16 | {"study": "scale"} for r in rows]
        return rows + [rows[0] | {"study": "depth", "max_tie_gap": 0.5}]   # another study's decoding, a wider gap

    paths = project(tmp_path, edit=edit)
    run(FAST, CONTEXT, paths, lambda *a, **k: None)
    scale = section((paths.reports / "README.md").read_text(), "Scale study")
    assert "the largest here 0.125" in scale and "0.500" not in scale


def test_a_short_training_run_is_a_demonstration_not_a_decision(tmp_path):
    """Trials trained far below `decisive_steps` (the default profile's tens of steps): every verdict says it is
    not decided at this training length, with what its interval would read, and how far from the study's length."""
    def short(study, rows):
        for r in rows:
            r["train_steps"] = 42
    paths = project(tmp_path, edit=short)
    seen = []
    run(ReportParams(bootstrap_draws=400, decisive_steps=960), CONTEXT, paths, lambda m, step=None: seen.append(m))
    findings_md = section((paths.reports / "README.md").read_text(), "Findings")
    assert "trained 42 optimizer steps (median over trials), 4% of the 960" in findings_md
    for claim in ("P1", "P2", "P3", "H", "E"):
        one = " (one seed)" if claim == "E" else ""
        assert table_row(findings_md, claim)[2] == f"**not decided at this training length** (interval: {HOLDS}){one}"
        assert table_row(findings_md, claim)[3] == f"**not decided at this training length** (interval: {HOLDS}){one}"
    assert seen[-1]["report/claims_holding"] == 0.0
    run(ReportParams(bootstrap_draws=400, decisive_steps=40), CONTEXT, paths, lambda m, step=None: None)
    assert table_row(section((paths.reports / "README.md").read_text(), "Findings"), "P1")[2] == f"**{HOLDS}**"


def test_e_power_says_how_many_prompts_or_that_seeds_are_needed():
    """The τ gain's interval splits into a prompt part (∝ 1/√prompts) and a seed part: the prompts that would
    resolve a gap, or 'more seeds' when the seed part alone is wider than the gap."""
    from stages.findings import e_power, prompts_for
    from stages.results import E2EKind

    assert prompts_for(0.03, 16, 0.015) == 64
    rng = np.random.default_rng(0)
    def kind(spread_prompts, spread_seeds, shift=0.0):
        k = E2EKind([8, 10, 60], {"tau": 2.0 + shift})
        k.tau_prompts = 2.0 + shift + rng.normal(0, spread_prompts, 4000)
        k.tau = k.tau_prompts + rng.normal(0, spread_seeds, 4000)
        k.prompts = 16
        return k
    text = e_power(kind(0.02, 0.0), kind(0.0, 0.0), gap=0.02, level=0.95)
    assert "on 16 prompts" in text and "resolving E at the measured gains (+2.0%) needs about" in text
    need = int(text.split("needs about ")[1].split(" ")[0].replace(",", ""))
    assert 10 <= need <= 40                      # prompt half-width ~2%, target 2%: about the same 16 prompts
    seeds = e_power(kind(0.01, 0.05), kind(0.0, 0.0), gap=0.004, level=0.95)
    assert "(+0.4%) takes more seeds: the seed part alone is wider" in seeds


def test_rows_computed_by_other_code_are_marked(tmp_path):
    """Every row carries the hash of the code that computed it: a setting whose rows differ from the rest is
    marked in its table, and each study's provenance lists its code hashes."""
    def code(study, rows):
        for r in rows:
            r["code"] = "b" * 64 if study == "hybrid" and r["trial"].startswith("cross_only-ckpt") else "a" * 64
    paths = project(tmp_path, edit=code)
    run(FAST, CONTEXT, paths, lambda m, step=None: None)
    text = (paths.reports / "README.md").read_text()
    hyb = section(text, "Hybrid study")
    assert table_row(hyb, "cross-only", "EAGLE-3 checkpoint")[2] == "2 ‡"
    assert table_row(hyb, "hybrid", "EAGLE-3 checkpoint")[2] == "5"
    assert "‡: computed by other code than the rest of this report (code hash bbbbbbbbbbbb against aaaaaaaaaaaa)" in hyb
    assert "‡" not in section(text, "Depth study")
    assert table_row(section(text, "Provenance"), "hybrid")[3] == "aaaaaaaaaaaa, bbbbbbbbbbbb"


def test_a_block_drafter_is_compared_with_the_hidden_block_arm_never_with_eagle3(tmp_path):
    """Free-running block step accuracy and teacher-forced autoregressive step accuracy are never one comparison:
    the KV-reading block arms' baseline is the hidden-context block arm of their shape, which itself has none."""
    from stages.baselines import baseline_for

    block = dict(variant="block", depth=2, block_size=8)
    specs = [("eagle3", dict(variant="eagle3"), 0.40, 0.30), ("block-hidden", dict(block, context="hidden"), 0.3, 0.1),
             ("block-kv", dict(block, context="kv"), 0.35, 0.1), ("block-both", dict(block, context="both"), 0.33, 0.1)]
    fx.write(tmp_path / "metrics", {"block": [fx.row("block", stem, f, a0, a6, 0, 1) for stem, f, a0, a6 in specs]},
             None)
    settings = collect({"studies": ["block"]}, Paths(tmp_path), draws=200).studies["block"]
    by = {s.trials[0]: s for s in settings}
    assert baseline_for(by["block-kv"], settings) is by["block-hidden"]
    assert baseline_for(by["block-both"], settings) is by["block-hidden"]
    assert baseline_for(by["block-hidden"], settings) is None
    run(FAST, {"studies": ["block"]}, Paths(tmp_path), lambda m, step=None: None)
    text = section((tmp_path / "reports" / "README.md").read_text(), "Block study")
    kv = table_row(text.split("End to end")[0], "block, 2 layers, kv context, B=8")
    assert any(c.startswith("block, hidden context (seed 0): +") for c in kv)
    assert not any("EAGLE-3" in c for c in kv)
    assert table_row(text.split("End to end")[0], "block, 2 layers, hidden context, B=8")[-1] == "–"


def test_b_is_decided_on_the_kv_arm_run_at_the_most_seeds_not_on_the_best_result(tmp_path):
    """Which KV-reading block arm decides B is fixed by the design: a one-seed arm with a better result is shown
    beside the five-seed arm, never picked over it (picking the best of two noisy arms would favour "holds")."""
    block = dict(variant="block", depth=2, block_size=8)
    specs = [("block-hidden", dict(block, context="hidden"), 0.30, 0.10, range(5)),
             ("block-kv", dict(block, context="kv"), 0.31, 0.10, range(5)),
             ("block-both", dict(block, context="both"), 0.60, 0.40, [0])]
    rows = [fx.row("block", stem, f, a0, a6, s, len(seeds)) for stem, f, a0, a6, seeds in specs for s in seeds]
    fx.write(tmp_path / "metrics", {"block": rows}, None)
    settings = collect({"studies": ["block"]}, Paths(tmp_path), draws=200).studies["block"]
    b = next(v for v in findings({"block": settings}, None, ["small"]) if v.claim == "B")
    assert b.evidence.startswith("step MAT block, 2 layers, kv context, B=8 ")
    assert "vs block, 2 layers, hidden context, B=8 " in b.evidence.split(";")[0]
    assert "5 paired seeds" in b.evidence.split(";")[0]
    assert "; not decisive: step MAT block, 2 layers, both context, B=8 " in b.evidence
    assert "one seed (0)), holds" in b.evidence           # the better one-seed arm is shown, and does not decide


def _p3(tmp_path, kv_acc0: dict[int, tuple[float, int]]):
    """P3's verdict over EAGLE-3 (acc_0 0.40, 5 seeds) and KV-only drafters {depth: (acc_0, seeds)}."""
    specs = [("eagle3", dict(variant="eagle3"), 0.40, 0.30, 5)]
    specs += [(f"kv_only-d{d}", dict(variant="kv_only", depth=d), a0, 0.30, n) for d, (a0, n) in kv_acc0.items()]
    rows = [fx.row("depth", stem, f, a0, a6, s, n) for stem, f, a0, a6, n in specs for s in range(n)]
    fx.write(tmp_path / "metrics", {"depth": rows}, None)
    settings = collect({"studies": ["depth"]}, Paths(tmp_path), draws=400).studies["depth"]
    return next(v for v in findings({"depth": settings}, None, ["small"]) if v.claim == "P3")


def test_p1_and_p3_are_decided_on_the_deepest_kv_only_drafter_whatever_the_others_score(tmp_path):
    """Which KV-only drafter decides P3 is fixed by the design (the deepest, P1's, here at five seeds): a one-seed
    drafter with a better or worse acc_0 is shown beside it as not decisive and never decides P3 by its result."""
    for sub, a0 in (("a", 0.20), ("b", 0.40), ("c", 0.60)):
        v = _p3(tmp_path / sub, {1: (0.20, 1), 2: (a0, 1), 4: (0.30, 5)})
        assert v.verdict == HOLDS, sub                       # EAGLE-3 0.40 against the deepest's 0.30
        lead, *rest = v.evidence.split("; not decisive: ")
        assert "vs KV-only, 4 layers, linear " in lead and "5 paired seeds" in lead
        assert len(rest) == 2 and "vs KV-only, 2 layers, linear " in rest[1] and "one seed (0)" in rest[1]
    assert rest[1].endswith(", does not hold")              # (c): shown, with its own verdict


def test_a_bounded_metrics_interval_stays_in_its_range_and_a_difference_is_never_cut(tmp_path):
    """Three seeds far apart around a low accuracy: the seed term (a t-interval with 2 degrees of freedom) reaches
    below 0, which no accuracy can be; the shown interval stops at 0 (MAT at 1), a difference's interval is not cut."""
    from stages.results import within_range

    assert within_range("acc_0", (-0.004, 0.119)) == (0.0, 0.119)
    assert within_range("alpha_6", (0.9, 1.2)) == (0.9, 1.0)
    assert within_range("step_mat", (0.97, 1.2)) == (1.0, 1.2) and within_range("tau", (0.8, 1.1)) == (1.0, 1.1)
    assert within_range("step_retention", (-0.5, 2.5)) == (0.0, 2.5)
    lo, hi = within_range("acc_0", (float("nan"), float("nan")))
    assert np.isnan(lo) and np.isnan(hi)
    rows = [fx.row("depth", "eagle3", dict(variant="eagle3"), a0, 0.01, s, 3)
            for s, a0 in enumerate((0.005, 0.06, 0.14))]
    rows += [fx.row("depth", "kv_only", dict(variant="kv_only"), a0, 0.01, s, 3) for s, a0 in enumerate((0.2,) * 3)]
    fx.write(tmp_path / "metrics", {"depth": rows}, None)
    settings = collect({"studies": ["depth"]}, Paths(tmp_path), draws=400).studies["depth"]
    eagle = next(s for s in settings if s.fields["variant"] == "eagle3")
    assert eagle.ci("acc_0")[0] == 0.0 and eagle.ci("step_mat")[0] >= 1.0
    from models.stats import interval
    assert interval(eagle.resampled("acc_0"), 0.95)[0] < 0        # what the seed term alone gives


def test_settings_of_another_data_split_are_never_compared(tmp_path):
    """While the studies are rerun one by one on a new split, a study's rows are never compared with another's of
    the old one: here the injection study (which alone holds P1's no-target control) was evaluated on other
    conversations, so P1 is not measured and says why, and the depth study's table names no baseline from it."""
    def other_split(study, rows):
        if study == "injection":
            for r in rows:
                if r.get("per_conversation"):       # a failed trial has none
                    r["per_conversation"] = {**r["per_conversation"],
                                             "ids": [f"old-{i}" for i in r["per_conversation"]["ids"]]}
        return rows
    paths = project(tmp_path, edit=other_split)
    got = verdicts(paths)
    assert got["P1"] == MISSING and got["P3"] == HOLDS      # P3 reads the depth study alone
    run(FAST, CONTEXT, paths, lambda m: None)
    text = (paths.reports / "README.md").read_text()
    p1 = table_row(section(text, "Findings"), "P1")
    assert "not compared, evaluated on different held-out conversations (120 vs 120: another data split)" in p1[4], p1
    # within a study every setting is compared as before: injection's drafters against injection's EAGLE-3
    assert "EAGLE-3 (hidden-only) (seed 0): -0.603 [" in section(text, "Injection study")


def test_drafters_decoded_on_other_prompts_are_not_compared_end_to_end(tmp_path):
    """τ follows the same rule: the hybrid decoded on other prompts than EAGLE-3 continued leaves E not measured,
    saying why."""
    def other_prompts(study, rows):
        if study == "e2e":
            for r in rows:
                if r["trial"].startswith("hybrid"):
                    others = [f"p{i}" for i in range(len(r["per_prompt"]["rounds"]))]
                    r["per_prompt"] = {**r["per_prompt"], "ids": others}
        return rows
    paths = project(tmp_path, edit=other_prompts)
    assert verdicts(paths)["E"] == MISSING
    run(FAST, CONTEXT, paths, lambda m: None)
    e = table_row(section((paths.reports / "README.md").read_text(), "Findings"), "E")
    assert "the hybrid and EAGLE-3 continued were decoded on different prompts" in e[4], e
