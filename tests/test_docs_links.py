"""The README and docs/ cite only files that exist: every relative markdown link resolves inside the checkout,
and no doc points outside the repository. README stays short (instructions first; tables live in docs/)."""

from __future__ import annotations

import re

import pytest

from pipeline.core.config import PROJECT_ROOT

DOCS = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    dead = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same file
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.exists() or PROJECT_ROOT.resolve() not in (path, *path.parents):
            dead.append(target)
    assert not dead, f"{doc.relative_to(PROJECT_ROOT)} links to files that do not exist in the checkout: {dead}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_doc_cites_the_missing_notes_or_a_path_outside_the_repository(doc):
    text = doc.read_text(encoding="utf-8")
    assert "domain.md" not in text and "../shared/docs" not in text


def test_readme_is_short():
    assert len((PROJECT_ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 200
