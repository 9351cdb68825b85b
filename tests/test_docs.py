"""The docs name files that exist and link pages that exist, so a moved module cannot leave them stale."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# A repository path in backticks: from one of the top-level folders, no placeholders or globs.
REPO_PATH = re.compile(r"`((?:metalserve|tests|tools|bench|docs|\.github|\.ci)/[\w./-]*)`")
# Written by tools on a Mac (docs/mac.md says so), not committed yet.
RECORDED = {"tests/kernels/data/metal_outputs.npz", "tests/kernels/data"}
LINK = re.compile(r"\]\((?!https?://)([^)#\s]*)(?:#([^)\s]*))?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.+)$", page.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_paths_exist(page: Path) -> None:
    named = {m.rstrip("/.") for m in REPO_PATH.findall(page.read_text())}
    missing = sorted(p for p in named - RECORDED if not (ROOT / p).exists())
    assert not missing, f"{page_id(page)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target, anchor in LINK.findall(page.read_text()):
        linked = (page.parent / target).resolve() if target else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{page_id(page)} has broken links: {broken}"


def test_the_readme_stays_short_and_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 10 * 1024
    assert "\n    make serve\n" in readme and "\n    make test\n" in readme
