"""The docs a newcomer reads stay inside the repository: every relative link resolves to
a file here, none climbs out of it, and README links every page of docs/."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
OUTSIDE = ("../shared", "shared/reference", "shared/ARCHITECTURE", "steering", "/work/")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_in_the_repository_and_resolve(page):
    text = page.read_text()
    for marker in OUTSIDE:
        assert marker not in text, f"{page.name} points outside the repository: {marker}"
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)  # code is not links
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        resolved = (page.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert resolved.exists(), f"{page.name}: {target} does not exist"


def test_readme_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{doc.name})" in readme, f"README.md does not link docs/{doc.name}"
