"""The README and docs/ for a newcomer: README's claims table says what the committed study report says, every
relative link points to a file (and heading) that exists, and every `kvshot ...` / `make ...` command quoted in
README.md and docs/*.md names a real subcommand or target with real flags and override keys.

README's claims table is generated from results/study/report.md; after the report is regenerated, refresh it with

    .venv/bin/python tests/test_docs.py --write     # rewrites the block between the claims markers in README.md
    .venv/bin/python tests/test_docs.py             # prints the table only
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from stages.report_findings import TOGETHER

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REPORT = ROOT / "results" / "study" / "report.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PAGES = [*DOCS, *sorted((ROOT / "results").glob("*/README.md"))]
BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"

# The claim in a few words; the report's statement column holds the full claim.
CLAIM_WORDS = {
    "P1": "KV-only drafters decay more gracefully over draft steps than EAGLE-3",
    "P2": "KV-only improves with depth, most from 1 to 2 layers",
    "P3": "EAGLE-3 is more accurate at the first draft step",
    "H": "the hybrid from the EAGLE-3 checkpoint beats EAGLE-3 continued (compute-matched)",
    "E": "the hybrid's end-to-end τ gain is much smaller than its step-wise gain",
    "B": "block drafters: reading the target KV beats reading hidden states",
}


# -- reading the report ----------------------------------------------------------------------------------------

def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def md_tables(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """Every pipe table of a markdown page with the `## ` section it sits in: (section, rows as header -> cell)."""
    out, section, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip()):
            header, rows, i = _cells(line), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, _cells(lines[i]))))
                i += 1
            out.append((section, rows))
            continue
        i += 1
    return out


def report_claims(text: str) -> dict[str, dict[str, str]]:
    """claim id -> {verdict, evidence} from the report's Findings table."""
    for section, rows in md_tables(text):
        if section == "Findings" and rows and "claim" in rows[0]:
            # "**holds**", or "**holds** (provisional)" while the study's plan has trials without rows yet
            return {r["claim"]: {"verdict": r["verdict"].replace("*", ""), "evidence": r["evidence"],
                                 "together": r.get(TOGETHER, "–").replace("*", "")} for r in rows}
    raise ValueError("the report has no claims table under '## Findings'")


def seeds_by_label(text: str) -> dict[str, dict[str, dict[str, str]]]:
    """study -> {"step": label -> seeds (chain-acceptance tables, whose settings carry the evidence's labels),
    "e2e": label -> decoded seeds (end-to-end tables, where 'seeds' may read '3, 1 decoded')}."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for section, rows in md_tables(text):
        study = section.split(" ")[0].lower()
        for r in rows:
            if "seeds" not in r:
                continue
            if "setting" in r:
                out.setdefault(study, {}).setdefault("step", {})[r["setting"]] = r["seeds"]
            elif "τ (tuned)" in r and "drafter" in r:
                m = re.search(r"(\d+) decoded", r["seeds"])
                out.setdefault(study, {}).setdefault("e2e", {})[r["drafter"]] = m.group(1) if m else r["seeds"]
    return out


CONTRAST = re.compile(r"(?P<metric>step retention|acc_\d|step MAT|chain MAT|τ) (?P<a>.+?) (?P<va>-?[\d.]+) "
                      r"\[[^\]]*\] vs (?P<b>.+?) (?P<vb>-?[\d.]+) \[[^\]]*\]: difference (?P<d>-?[\d.]+) "
                      r"(?P<ci>\[[^\]]*\])(?: \((?P<seeds>one seed(?: \(\w+\))?|\d+ paired seeds, per seed [^)]*|"
                      r"seeds not paired \(\d+ vs \d+\))\))?")


def seed_text(note: str | None) -> str | None:
    """The report's seed note of a difference, short: '1 (seed 0)', '3 paired: +0.19 / +0.16 / +0.19', ..."""
    if not note:
        return None
    if note.startswith("one seed"):
        m = re.search(r"\((\w+)\)", note)
        return f"1 (seed {m.group(1)})" if m else "1"
    m = re.match(r"(\d+) paired seeds, per seed (.*)", note)
    if m:
        return f"{m.group(1)} paired: {m.group(2)}"
    m = re.match(r"seeds not paired \((\d+) vs (\d+)\)", note)
    return f"{m.group(1)} vs {m.group(2)}, unpaired" if m else note


def _signed(x: str) -> str:
    return x if x.startswith(("-", "+")) else "+" + x


def _both(a: str, b: str) -> str:
    return a if a == b else f"{a} vs {b}"


class _Seeds:
    def __init__(self, table: dict, study: str):
        self.table, self.study = table, study

    def __call__(self, label: str, kind: str = "step") -> str:
        """A label's seeds, from its own study first, else from any study that shows it."""
        studies = [self.study, *[s for s in self.table if s != self.study]]
        for s in studies:
            found = self.table.get(s, {}).get(kind, {}).get(label)
            if found:
                return found
        raise ValueError(f"no seeds for {label!r} ({kind}) in the report's tables")


def _contrasts(evidence: str, claim: str, n: int) -> list[re.Match]:
    found = list(CONTRAST.finditer(evidence))
    if len(found) < n:
        raise ValueError(f"claim {claim}: expected {n} differences in its evidence, found {len(found)}: {evidence}")
    return found


def decisive(claim: str, verdict: str, evidence: str, seeds: dict) -> list[tuple[str, str]]:
    """The differences that decide a claim, each as (metric, signed difference and interval) with its seeds."""
    if verdict == "not measured":
        return [("not measured", "–")]
    study = {"P2": "depth", "H": "hybrid", "E": "scale", "B": "block"}.get(claim, "depth")
    m = re.match(r"(\w+) study: ", evidence)
    seed = _Seeds(seeds, m.group(1) if m else study)
    if claim in ("P1", "P3", "H", "B"):
        main = evidence.split("; from scratch")[0]      # H: the from-scratch pair is shown, not decisive
        n = {"P1": 3, "P3": 1, "H": 1, "B": 1}[claim]
        found, out = _contrasts(main, claim, n), []
        found = found if claim == "P1" else found[:n]       # P1: the control with context too, where trained
        for c in found:
            what = c["metric"] + (" vs the control with context" if "token-context control" in c["b"] else
                                  " vs the no-target control" if "control" in c["b"] else "")
            out.append((f"{what} {_signed(c['d'])} {c['ci']}",
                        seed_text(c["seeds"]) or _both(seed(c["a"]), seed(c["b"]))))
        t = re.search(r"τ at the (\w+) tree [\d.]+ vs [\d.]+: difference (-?[\d.]+) (\[[^\]]*\])", main)
        if claim == "B" and t:      # decoded end to end: the same two drafters, at the seeds that were decoded
            a, b = found[0]["a"], found[0]["b"]
            out.append((f"τ ({t[1]} tree) {_signed(t[2])} {t[3]}", _both(seed(a, "e2e"), seed(b, "e2e"))))
        return out
    if claim == "P2":
        depths = [int(d) for d in re.findall(r"(\d+): [\d.]+", evidence.split(";")[0])]
        by_depth = {}
        for label, s in seeds.get("depth", {}).get("step", {}).items():
            m = re.match(r"KV-only, (\d+) layers?\b", label)
            if m:
                by_depth.setdefault(int(m.group(1)), s)
        deep = re.search(r"deepest vs 1 layer: [\w ]+ \(difference (-?[\d.]+) (\[[^\]]*\])", evidence)
        jumps = re.findall(r"jump 1→2 \([^)]*\) minus (\d)→(\d) \([^)]*\): (-?[\d.]+) (\[[^\]]*\])", evidence)
        if not deep or not depths:
            raise ValueError(f"claim P2: no 'deepest vs 1 layer' difference in its evidence: {evidence}")
        one = re.search(r"deepest vs 1 layer: [\w ]+ \(difference -?[\d.]+ \[[^\]]*\], (one seed(?: \(\w+\))?|[^)]*)\)",
                        evidence)
        note = seed_text(one[1]) if one else None
        out = [(f"step MAT, {depths[-1]} layers − 1 {_signed(deep[1])} {deep[2]}",
                note or _both(by_depth[depths[-1]], by_depth[1]))]
        for a, b, d, ci in jumps:
            used = sorted({1, 2, int(a), int(b)})
            out.append((f"jump 1→2 minus {a}→{b} {_signed(d)} {ci}",
                        note if note and note.startswith("1 ") else ", ".join(by_depth[x] for x in used)))
        return out
    if claim == "E":
        out = []
        for part in evidence.split(" — "):
            head = re.match(r"scale (\w+)(?:, (\d+) seeds decoded)?: ", part)
            if not head:
                raise ValueError(f"claim E: no 'scale NAME:' at the start of {part!r}")
            n, at = head[2] or "1", (f"scale {head[1]}: " if " — " in evidence else "")
            step = re.search(r"step MAT [\d.]+ vs [\d.]+ = (\S+%) (\[[^\]]*\])", part)
            tau = re.search(r"τ at the (\w+) tree .*? = (\S+%) (\[[^\]]*\])", part)
            test = re.search(r"([\d.]+)× the step gain minus the τ gain (\[[^\]]*\])", part)
            if not step or not tau:     # not decoded on a common tree, or no step MAT: the report's words
                out.append((f"{at}{part[head.end():]}", n))
                continue
            out += [(f"{at}step MAT gain {step[1]} {step[2]}", n), (f"{at}τ gain ({tau[1]} tree) {tau[2]} {tau[3]}", n)]
            if test:
                out.append((f"{at}{test[1]}× step gain − τ gain {test[2]}", n))
        return out
    raise ValueError(f"claim {claim}: no rule for its decisive difference (add one to tests/test_docs.py)")


def claims_table(report_text: str) -> str:
    """README's claims table, generated from the study report."""
    claims, seeds = report_claims(report_text), seeds_by_label(report_text)
    unknown = set(claims) - set(CLAIM_WORDS)
    if unknown:
        raise ValueError(f"claims {sorted(unknown)} have no short wording in tests/test_docs.py CLAIM_WORDS")
    rows = [f"| claim | in a few words | verdict | {TOGETHER} | decisive difference [95% interval] | seeds |",
            "| --- | --- | --- | --- | --- | --- |"]
    for cid, c in claims.items():
        items = decisive(cid, c["verdict"], c["evidence"], seeds)
        if len({s for _, s in items}) == 1:     # one seed count for every line: say it once
            items = [(d, items[0][1] if i == 0 else "") for i, (d, _) in enumerate(items)]
        items_seeds = [s for _, s in items if s]
        rows.append(f"| {cid} | {CLAIM_WORDS[cid]} | **{c['verdict']}** | {c['together']} | "
                    f"{'<br>'.join(d for d, _ in items)} | "
                    f"{'<br>'.join(items_seeds)} |")
    return "\n".join(rows)


def readme_block(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md lacks the markers {BEGIN} ... {END} around its claims table")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


CLAIM_PAGES = [README, ROOT / "results" / "study" / "README.md"]     # the pages that carry the claims table


def write_readme(readme: Path = README, report: Path = REPORT) -> None:
    text = readme.read_text()
    readme_block(text)      # fails clearly without the markers
    head, rest = text.split(BEGIN, 1)
    readme.write_text(f"{head}{BEGIN}\n{claims_table(report.read_text())}\n{END}{rest.split(END, 1)[1]}")


# -- the claims table ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", CLAIM_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_claims_table_is_the_reports(page):
    """README's and the study page's tables are exactly what the committed report gives (refresh:
    `python tests/test_docs.py --write`)."""
    want = claims_table(REPORT.read_text())
    assert readme_block(page.read_text()) == want, \
        (f"{page.relative_to(ROOT)}'s claims table differs from results/study/report.md: run "
         "`.venv/bin/python tests/test_docs.py --write`")


def test_readme_claims_verdicts_and_numbers_read_from_the_report():
    """Independent of the generator: each README row's verdict is the report's and every number it shows for a
    difference stands in that claim's evidence."""
    claims = report_claims(REPORT.read_text())
    rows = [r for _, rows in md_tables(readme_block(README.read_text())) for r in rows]
    assert [r["claim"] for r in rows] == list(claims), "README's claims are not the report's, in its order"
    for r in rows:
        ev = claims[r["claim"]]
        assert r["verdict"].strip("*") == ev["verdict"], r["claim"]
        assert r[TOGETHER] == ev["together"], r["claim"]
        numbers = re.findall(r"[-+]?\d+\.\d+%?", r["decisive difference [95% interval]"])
        assert numbers or ev["verdict"] == "not measured", r["claim"]
        for x in numbers:
            bare = x.lstrip("+")
            assert x in ev["evidence"] or bare in ev["evidence"], f"{r['claim']}: {x} is not in the report's evidence"


def test_claims_table_follows_a_changed_verdict():
    """The generator reads the verdicts and intervals, it does not copy them: change one in a report, see it."""
    text = REPORT.read_text()
    claims = report_claims(text)
    cid = next(c for c in ("B", "H", "P3", "P1") if c in claims and CONTRAST.search(claims[c]["evidence"]))
    first = CONTRAST.search(claims[cid]["evidence"])
    was = f"difference {first['d']} {first['ci']}"
    line = next(ln for ln in text.splitlines() if re.match(rf"^\| {cid} +\|", ln))
    verdict, provisional = claims[cid]["verdict"].partition(" (provisional)")[:2]
    verdict, one_seed = verdict.partition(" (one seed)")[:2]     # the report bolds the verdict alone
    new_verdict = "does not hold" if verdict != "does not hold" else "holds"
    edited = line.replace(was, "difference -0.045 [-0.085, -0.007]").replace(f"**{verdict}**", f"**{new_verdict}**")
    assert f"**{new_verdict}**" in edited and "-0.045 [-0.085, -0.007]" in edited
    row = next(ln for ln in claims_table(text.replace(line, edited)).splitlines() if ln.startswith(f"| {cid} |"))
    assert f"**{new_verdict}{one_seed}{provisional}**" in row and "-0.045 [-0.085, -0.007]" in row, row


# -- links -----------------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slugs(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        slug, n = base, 0
        while slug in out:
            n += 1
            slug = f"{base}-{n}"
        out.add(slug)
    return out


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+://|^mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                bad.append(f"{page.relative_to(ROOT)} -> {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in slugs(path.read_text()):
                bad.append(f"{page.relative_to(ROOT)} -> {target}: no such heading")
    assert not bad, "\n".join(bad)


# -- commands --------------------------------------------------------------------------------------------------

def quoted_code(text: str) -> list[str]:
    """The code a page quotes: each line of a fenced block (comments cut) and each inline `...` span."""
    out = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        out += [line.split(" #")[0] for line in block.splitlines()]
    out += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    return out


def commands(code: str, tool: str, names: set[str]) -> list[tuple[str, list[str]]]:
    """(name, arguments) of every `tool NAME ...` in a piece of code; `a | b | c` and `a/b/c` list alternatives."""
    out = []
    for m in re.finditer(rf"(?:^|[\s(;&]){tool} ([a-z][a-z0-9-]*(?:/[a-z][a-z0-9-]*)*)([^;&)]*)", code):
        first, rest = m.group(1), m.group(2)
        alternatives = [(first, rest)]
        if "|" in rest:
            head, *more = rest.split("|")
            alternatives = [(first, head)]
            for alt in more:
                word = alt.split()[0] if alt.split() else ""
                if word in names:       # `kvshot a | b` lists subcommands; a pipe into another program ends it
                    alternatives.append((word, alt.split(None, 1)[1] if len(alt.split()) > 1 else ""))
                else:
                    break
        for name, args in alternatives:
            for one in name.split("/"):
                out.append((one, re.sub(r"[\[\]]", " ", args).split()))
    return out


def _cli():
    from typer.main import get_command

    from pipeline.cli import app

    group = get_command(app)
    return {name: {o for p in cmd.params for o in p.opts} | {"--help"} for name, cmd in group.commands.items()}


def _make():
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-zA-Z][\w-]*):(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z_][A-Z0-9_]*) *[?:+]?=", text, re.M))
    return targets, variables


def test_quoted_commands_exist_with_their_flags_and_keys():
    from pipeline.config import ConfigError, resolve_key

    cli, (targets, variables) = _cli(), _make()
    bad, seen = [], 0
    for page in DOCS:
        where = page.relative_to(ROOT)
        for code in quoted_code(page.read_text()):
            for name, args in commands(code, "kvshot", set(cli)):
                seen += 1
                if name not in cli:
                    bad.append(f"{where}: `kvshot {name}`: no such subcommand")
                    continue
                for arg in args:
                    if arg.startswith("-") and arg.split("=")[0] not in cli[name]:
                        bad.append(f"{where}: `kvshot {name}` has no flag {arg}")
                    key = re.match(r"^([a-z_][a-z0-9_.]*)=", arg)
                    if key:
                        try:
                            resolve_key(key.group(1))
                        except ConfigError as e:
                            bad.append(f"{where}: `kvshot {name} ... {arg}`: {e}")
            for name, args in commands(code, "make", targets):
                seen += 1
                if name not in targets:
                    bad.append(f"{where}: `make {name}`: no such target in the Makefile")
                for arg in args:
                    var = re.match(r"^([A-Z_][A-Z0-9_]*)=", arg)
                    if var and var.group(1) not in variables:
                        bad.append(f"{where}: `make {name} {arg}`: the Makefile has no variable {var.group(1)}")
    assert seen > 20, f"only {seen} commands found in README.md and docs/: the parser misses them"
    assert not bad, "\n".join(bad)


def test_command_parser_catches_a_wrong_flag():
    cli = _cli()
    found = commands("kvshot sweep --study hybrid --dry-runn | grep x", "kvshot", set(cli))
    assert found == [("sweep", ["--study", "hybrid", "--dry-runn"])]
    assert "--dry-runn" not in cli["sweep"] and "--dry-run" in cli["sweep"]
    assert [n for n, _ in commands("kvshot prepare | regenerate | evaluate --study S", "kvshot", set(cli))] == \
        ["prepare", "regenerate", "evaluate"]


def test_readme_is_short_and_leads_with_its_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert "make repro" in text and "make test" in text
    assert text.index("make repro") < text.index(BEGIN), "the claims table follows the two commands"


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        for page in CLAIM_PAGES:
            write_readme(page)
            print(f"rewrote the claims table in {page.relative_to(ROOT)}")
    else:
        print(claims_table(REPORT.read_text()))
