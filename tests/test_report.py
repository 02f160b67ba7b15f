"""The report stage on synthetic metrics (tests/fixtures/report): tables, figures, verdicts both ways, determinism."""
import json
import re
import shutil
from pathlib import Path

import pytest

from stages.common import Paths, StageError
from stages.report import (FAILS, HOLDS, MISSING, NOISE, ReportParams, Stat, collect, compare, e2e_baselines,
                           findings, mat_of, run)

FIXTURES = Path(__file__).parent / "fixtures" / "report" / "metrics"
STUDIES = ["injection", "depth", "hybrid", "scale"]
CONTEXT = {"profile": "default", "target": "embedded", "data_sizes": {"small": 300, "large": 1200},
           "git_commit": "0123abc", "date": "2026-05-01T10:00:00", "hardware": "2 CPU cores",
           "wall_time_s": 754.0, "stage_times_s": {"train": 700.0, "prepare": 54.0}, "studies": STUDIES}
PNG = b"\x89PNG\r\n\x1a\n"


def project(tmp_path: Path, drop: tuple[str, ...] = (), edit=None) -> Paths:
    """A project root with the fixture metrics; `edit(study, rows)` may rewrite a study's rows ('e2e' too)."""
    shutil.copytree(FIXTURES, tmp_path / "metrics")
    for name in drop:
        p = tmp_path / "metrics" / ("e2e.json" if name == "e2e" else f"stepwise/{name}.json")
        p.unlink()
    if edit:
        for p in [*(tmp_path / "metrics" / "stepwise").glob("*.json"), tmp_path / "metrics" / "e2e.json"]:
            if p.is_file():
                name = "e2e" if p.name == "e2e.json" else p.stem
                rows = json.loads(p.read_text())
                p.write_text(json.dumps(edit(name, rows) or rows))
    return Paths(tmp_path)


def verdicts(paths: Paths, **params) -> dict[str, str]:
    res = collect(CONTEXT, paths)
    return {v.claim: v.verdict for v in findings(res.studies, res.e2e, res.scale_order, ReportParams(**params))}


def reshape(row: dict, fn) -> dict:
    """Rewrite a row's alpha with fn(k, a) and keep its MAT and retention consistent."""
    row["alpha"] = [round(min(1.0, max(0.0, fn(k, a))), 4) for k, a in enumerate(row["alpha"])]
    row["mat"] = mat_of(row["alpha"])
    row["retention"] = row["alpha"][6] / row["alpha"][0]
    return row


def where(rows, fn, **match):
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            reshape(r, fn)
    return rows


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The full report once: all four studies, a configured study with no metrics, a stale figure."""
    paths = project(tmp_path_factory.mktemp("full"))
    stale = paths.reports / "figures" / "alpha_gone.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(PNG)
    seen = []
    run(ReportParams(), {**CONTEXT, "studies": STUDIES + ["control"]}, paths, lambda m, step=None: seen.append(m))
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


def test_tables_in_the_papers_shape_with_paper_numbers(full):
    _, text, _ = full
    inj = section(text, "Injection study")
    assert "| method | RoPE fix | seeds | α_0 | α_6 | MAT | α_0 paper (Qwen3-8B) |" in inj
    assert table_row(inj, "KV-only, linear", "yes")[-3:] == ["0.494", "0.353", "1.84"]
    assert table_row(inj, "KV-only, head concat", "yes")[2:6] == ["0 (1 failed)", "failed", "failed", "failed"]
    assert "no target information (control): retention 99.6%, MAT 1.31" in inj

    depth = section(text, "Depth study")
    row = table_row(depth, "KV-only", "2")
    assert row[2] == "3"                                            # three seeds aggregated
    rows = [r for r in json.loads((FIXTURES / "stepwise/depth.json").read_text()) if r["depth"] == 2
            and r["variant"] == "kv_only"]
    expected = Stat.of(r["mat"] for r in rows)
    assert row[7] == f"{expected.mean:.3f} ± {expected.std:.3f}"
    assert row[-5:] == ["0.594", "0.497", "0.463", "77.9%", "2.23"]
    assert table_row(depth, "EAGLE-3 (hidden-only)", "1")[-1] == "2.37"

    hyb = section(text, "Hybrid study")
    assert table_row(hyb, "hybrid", "EAGLE-3 checkpoint")[-1] == "2.54"
    assert table_row(hyb, "cross-only", "random")[-4] == "–"          # the paper gives no α_3 there

    scale = section(text, "Scale study")
    row = table_row(scale, "EAGLE-3 (hidden-only)", "large (1200)")
    assert row[4:9] == ["2.600", "4.76", "(4, 2, 8)", "2.300", "1.310"]
    assert row[-1] == "yes"
    assert table_row(scale, "prompt lookup")[7:9] == ["1.420", "1.230"]
    assert "EAGLE-3 trained from checkpoint: τ (8, 10, 60) 5.01" in scale


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
    for cell in ("0123abc", "2 CPU cores", "754 s (12.6 min)", "prepare 54 s, train 700 s", "small: 300, large: 1200",
                 "arXiv 2604.26412"):
        assert cell in prov
    assert re.search(r"input `metrics/e2e.json` \| sha256 [0-9a-f]{12}", prov)
    assert seen == [{"report/settings": 19.0, "report/failed_trials": 1.0, "report/claims_holding": 5.0}]


def test_every_claim_holds_on_the_paper_like_fixture(full):
    _, text, _ = full
    findings_md = section(text, "Findings")
    for claim in ("P1", "P2", "P3", "H", "E"):
        assert table_row(findings_md, claim)[2] == f"**{HOLDS}**"


# Each claim bent the other way: (claim, edit of the fixture rows, expected verdict).
def _p1_fails(name, rows):
    if name == "depth":      # KV-only alphas decay fast: retention below EAGLE-3's
        where(rows, lambda k, a: a * 0.9 ** k, variant="kv_only")


def _p2_fails(name, rows):
    if name == "depth":      # the 3 -> 4 jump dwarfs 1 -> 2 (alpha_0 kept below EAGLE-3's)
        where(rows, lambda k, a: a + 0.2 if k else a, variant="kv_only", depth=4)


def _p2_depth(step):
    def edit(name, rows):
        if name == "depth":  # every depth is depth 1 of the same seed, plus `step` per extra layer
            base = {r["seed"]: r["alpha"] for r in rows if r["variant"] == "kv_only" and r["depth"] == 1}
            for r in rows:
                if r["variant"] == "kv_only":
                    reshape(r, lambda k, a, r=r: base[r["seed"]][k] + step * (r["depth"] - 1))
    return edit


def _p3_fails(name, rows):
    if name == "depth":
        where(rows, lambda k, a: a * 0.9, variant="eagle3")   # same retention, lower alpha_0


def _p3_noise(name, rows):
    if name == "depth":      # EAGLE-3 alpha_0 a hair above KV-only's best, far inside its seed spread
        where(rows, lambda k, a: 0.616 if k == 0 else a, variant="eagle3")


def _h_fails(name, rows):
    if name == "hybrid":
        where(rows, lambda k, a: a - 0.1, variant="hybrid")


def _h_noise(name, rows):
    if name == "hybrid":     # hybrid = EAGLE-3 of the same seed + 0.001: a gain well inside the seed spread
        eagle = {r["seed"]: r["alpha"] for r in rows if r["variant"] == "eagle3"}
        for r in rows:
            if r["variant"] == "hybrid":
                reshape(r, lambda k, a, r=r: eagle[1 - r["seed"]][k] + 0.001)


def _e_fails(name, rows):
    if name == "e2e":        # the end-to-end tau gain as large as the step-wise one
        for r in rows:
            if r["variant"] == "hybrid" and r.get("tree_kind") == "paper":
                r["tau"] += 0.5


def _e_no_stepwise_gain(name, rows):
    if name == "scale":
        where(rows, lambda k, a: a - 0.05, variant="hybrid")


@pytest.mark.parametrize("claim,edit,expected", [
    ("P1", _p1_fails, FAILS), ("P2", _p2_fails, FAILS), ("P2", _p2_depth(-0.02), FAILS),
    ("P2", _p2_depth(0.0005), NOISE), ("P3", _p3_fails, FAILS), ("P3", _p3_noise, NOISE), ("H", _h_fails, FAILS),
    ("H", _h_noise, NOISE), ("E", _e_fails, FAILS), ("E", _e_no_stepwise_gain, FAILS)])
def test_verdict_flips_when_the_numbers_do(tmp_path, claim, edit, expected):
    got = verdicts(project(tmp_path, edit=edit))
    assert got[claim] == expected
    # The edit touches only its own claim (P1 and P2 read the same KV-only depth curves).
    coupled = {"P1": {"P1", "P2"}, "P2": {"P1", "P2"}}.get(claim, {claim})
    others = {c: v for c, v in got.items() if c not in coupled}
    assert set(others.values()) == {HOLDS}, others


def test_missing_studies_are_not_measured(tmp_path):
    got = verdicts(project(tmp_path, drop=("depth", "injection", "hybrid", "e2e")))
    assert got == {c: MISSING for c in ("P1", "P2", "P3", "H", "E")}


def test_one_seed_falls_back_to_injection_and_says_spread_unknown(tmp_path):
    res = collect(CONTEXT, project(tmp_path, drop=("depth",)))
    v = {x.claim: x for x in findings(res.studies, res.e2e, res.scale_order, ReportParams())}
    assert v["P1"].verdict == FAILS          # 1-layer KV-only keeps less than EAGLE-3 (as in the paper)
    assert v["P3"].verdict == HOLDS
    assert "injection study" in v["P1"].evidence and "spread unknown" in v["P1"].evidence
    assert v["P2"].verdict == MISSING


def test_deterministic_apart_from_the_date(tmp_path):
    texts, figs = [], []
    for i, date in enumerate(("2026-05-01", "2026-06-02")):
        paths = project(tmp_path / str(i))
        run(ReportParams(), {**CONTEXT, "date": date}, paths, lambda m, step=None: None)
        texts.append((paths.reports / "README.md").read_text().splitlines())
        figs.append({p.name: p.read_bytes() for p in sorted((paths.reports / "figures").iterdir())})
    assert figs[0] == figs[1]
    assert len(texts[0]) == len(texts[1])
    assert [(a, b) for a, b in zip(*texts) if a != b] == [("| date | 2026-05-01 |", "| date | 2026-06-02 |")]


def test_rows_with_only_the_required_keys(tmp_path):
    (tmp_path / "metrics" / "stepwise").mkdir(parents=True)
    rows = [{"trial": "a", "variant": "kv_only", "depth": d, "alpha": [0.5 + 0.1 * d] * 7} for d in (1, 2)]
    (tmp_path / "metrics" / "stepwise" / "depth.json").write_text(json.dumps(rows))
    paths = Paths(tmp_path)
    run(ReportParams(), {"studies": ["depth"]}, paths, lambda m, step=None: None)
    text = (paths.reports / "README.md").read_text()
    assert table_row(section(text, "Depth study"), "KV-only", "2")[7] == f"{mat_of([0.7] * 7):.3f}"
    assert "| profile | unknown |" in text and "| git commit | unknown |" in text
    assert "no metrics/e2e.json" in text


def test_malformed_metrics_name_the_file(tmp_path):
    (tmp_path / "metrics" / "stepwise").mkdir(parents=True)
    (tmp_path / "metrics" / "stepwise" / "depth.json").write_text('[{"trial": "a", ')
    with pytest.raises(StageError, match=r"depth\.json: not valid JSON"):
        run(ReportParams(), {"studies": ["depth"]}, Paths(tmp_path), lambda m, step=None: None)
    (tmp_path / "metrics" / "stepwise" / "depth.json").write_text('{"trial": "a"}')
    with pytest.raises(StageError, match=r"depth\.json: expected a JSON list"):
        run(ReportParams(), {"studies": ["depth"]}, Paths(tmp_path), lambda m, step=None: None)


def test_e2e_baselines_say_when_drafters_ran_in_int8():
    row = {"baseline_tokens_per_s": 40.0, "spec_off_tokens_per_s": 44.0, "prompt_lookup_speedup": 1.2,
           "prompt_lookup_tau": 1.4}
    native = e2e_baselines([row | {"drafter_weights": "native"}])
    assert native.startswith("Baselines in the same run: plain greedy `generate` 40.0 tokens/s")
    assert "speculation off 1.10x" in native and "int8" not in native
    assert e2e_baselines([row | {"drafter_weights": "int8"}]).endswith("(e2e.drafter_weights=int8).")


def test_compare_and_stats():
    one, two = Stat(0.6, None, 1), Stat(0.5, None, 1)
    assert compare(one, two, 2.0) == (HOLDS, "one seed: spread unknown")
    assert compare(two, one, 2.0)[0] == FAILS
    assert compare(Stat(0.60, 0.05, 3), Stat(0.55, 0.01, 3), 2.0)[0] == NOISE
    assert compare(Stat(0.60, 0.01, 3), Stat(0.55, 0.01, 3), 2.0)[0] == HOLDS
    assert compare(None, two, 2.0)[0] == MISSING
    s = Stat.of([1.0, 2.0, 3.0])
    assert (s.mean, s.std, s.n) == (2.0, 1.0, 3)
    assert Stat.of([None]) is None
    assert mat_of([0.5, 0.5]) == pytest.approx(1.75)


def test_extra_swept_values_split_settings_and_null_alphas_count_as_zero(tmp_path):
    (tmp_path / "metrics" / "stepwise").mkdir(parents=True)
    rows = [{"trial": f"lr{lr}-s{seed}", "variant": "kv_only", "depth": 1, "seed": seed, "status": "ok",
             "values": {"drafter.variant": "kv_only", "train.lr": lr, "train.seed": seed},
             "alpha": [0.5 + lr * 100, 0.4, 0.3, None, 0.2, 0.2, 0.2], "mat": None, "retention": None}
            for lr in (0.001, 0.002) for seed in (0, 1)]
    (tmp_path / "metrics" / "stepwise" / "lr.json").write_text(json.dumps(rows))
    res = collect({"studies": ["lr"]}, Paths(tmp_path))
    settings = res.studies["lr"]
    assert [(s.extra, s.n) for s in settings] == [({"train.lr": 0.001}, 2), ({"train.lr": 0.002}, 2)]
    assert settings[0].mat.mean == pytest.approx(mat_of([0.6, 0.4, 0.3, 0.0, 0.2, 0.2, 0.2]))
    assert settings[0].a(3) is None and settings[0].retention.mean == pytest.approx(0.2 / 0.6)
    run(ReportParams(), {"studies": ["lr"]}, Paths(tmp_path), lambda m, step=None: None)
    text = (tmp_path / "reports" / "README.md").read_text()
    assert table_row(section(text, "Study: lr"), "KV-only, 1 layer, train.lr=0.002")[1] == "2"


def test_alpha_on_few_chains_shows_its_count(tmp_path):
    (tmp_path / "metrics" / "stepwise").mkdir(parents=True)
    counts = {"valid": [900] * 7, "chain": [900, 400, 120, 20, 6, 1, 0]}
    rows = [{"trial": f"s{seed}", "variant": "kv_only", "depth": 1, "seed": seed, "alpha": [0.4, 0.3, 0.25, 0.2, 0.17, 1.0, None],
             "counts": counts} for seed in (0, 1)]
    (tmp_path / "metrics" / "stepwise" / "depth.json").write_text(json.dumps(rows))
    paths = Paths(tmp_path)
    run(ReportParams(), {"studies": ["depth"]}, paths, lambda m, step=None: None)
    text = section((paths.reports / "README.md").read_text(), "Depth study")
    row = table_row(text, "KV-only", "1")
    assert "(n=…): α_k is measured on the chains still alive" in text
    assert row[3] == "0.400 ± 0.000"                 # α_0 on 1,800 chains: no count
    assert row[4] == "0.200 ± 0.000 (n=40)"          # α_3 on 2 x 20 chains
    assert row[5] == "–"                             # α_6: no chain reached step 6
