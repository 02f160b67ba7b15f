"""The README and docs/ for a newcomer: every relative link points to a file that exists, the README stays short,
and every command it shows is a command kvshot has."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "results").glob("*/README.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = page.read_text()
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+://|^mailto:|^#", target):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"


def test_readme_is_short_and_its_commands_exist():
    from typer.main import get_command

    from pipeline.cli import app

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    commands = set(get_command(app).commands)
    shown = re.findall(r"^kvshot ([a-z][a-z0-9-]*)", text, re.M)
    assert shown and set(shown) <= commands, set(shown) - commands
    assert "make repro" in text and "make test" in text
