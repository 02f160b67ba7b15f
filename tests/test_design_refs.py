"""Every "DESIGN §N" reference in the repository's code and pages resolves to a section `## N.` of docs/design.md,
and the design speaks of the project only (its links stay inside the repository)."""
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
# Not the project's own text: environments, caches, generated data and the run workspaces.
SKIP = {".venv", ".git", ".dvc", "scratch", "data", "runs", "metrics", "mlruns", "node_modules", "__pycache__",
        "kvshot.egg-info"}
# "DESIGN §4", "DESIGN §4, §8, §10", "DESIGN §5 and §6"
REF = re.compile(r"DESIGN\s*§\s*\d+(?:\s*(?:,|and|&)\s*§\s*\d+)*")


def references(text: str) -> list[int]:
    """The section numbers a text cites as DESIGN §N (every number of a list like `DESIGN §4, §8`)."""
    return [int(n) for ref in REF.findall(text) for n in re.findall(r"§\s*(\d+)", ref)]


def sections(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, re.M)}


def project_files() -> list[Path]:
    """Every .py and .md file of the project (folders in SKIP not entered)."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP]
        out += [Path(folder) / f for f in files if f.endswith((".py", ".md"))]
    return sorted(out)


def test_the_reference_parser_reads_lists_and_misses_nothing_else():
    assert references("see DESIGN §4, §8, §10; DESIGN §5 and §6 (DESIGN §10 schema), §3 alone") == [4, 8, 10, 5, 6, 10]
    assert sections("## 1. One\n### 2. not a section\n## 10. Ten\n") == {1, 10}


def test_every_design_reference_resolves():
    have = sections(DESIGN.read_text())
    assert have == set(range(1, 11)), f"docs/design.md sections: {sorted(have)}"
    cited, bad = 0, []
    for f in project_files():
        for n in references(f.read_text(errors="replace")):
            cited += 1
            if n not in have:
                bad.append(f"{f.relative_to(ROOT)}: DESIGN §{n} has no section '## {n}.' in docs/design.md")
    assert cited >= 30, f"only {cited} DESIGN references found: the scan misses files"
    assert not bad, "\n".join(bad)


def test_a_missing_section_is_caught(tmp_path):
    page = tmp_path / "x.py"
    page.write_text('"""The loop (DESIGN §6) and the widget (DESIGN ' + '§11)."""\n')   # split: not a reference here
    assert [n for n in references(page.read_text()) if n not in sections(DESIGN.read_text())] == [11]


def test_the_design_stays_inside_the_repository():
    text = DESIGN.read_text()
    for target in re.findall(r"\]\(([^)\s#]+)", text):
        if re.match(r"^[a-z]+://", target):
            continue
        path = (DESIGN.parent / target).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"docs/design.md links {target}"
    assert "../" not in re.sub(r"\]\([^)]*\)", "", text), "docs/design.md names a path outside the repository"
