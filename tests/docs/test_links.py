"""The user-facing prose holds together: every relative link in README.md, CONTRIBUTING.md
and docs/*.md points to a file that exists (and, for a `#fragment`, to a heading of it),
docs/operations.md lists every setting, and the README stays a short front door."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from refitd.config import Settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# Lab-notebook phrases that date a sentence; product prose says what is, in present tense.
HISTORY = (
    "slower hour",
    "slow hour",
    "final tree",
    "last stop",
    "earlier stop",
    "this round",
    "earlier tree",
    "this tree",
    "after the merges",
    "before this work",
)


def prose(path: Path) -> str:
    """The page without fenced code blocks and inline code, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", path.read_text()))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes,
    repeated headings numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for title in HEADING.findall(FENCE.sub("", path.read_text())):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file {dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == [], f"{page.relative_to(ROOT)} has broken links"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_is_present_tense(page: Path) -> None:
    text = page.read_text().lower()
    found = [phrase for phrase in HISTORY if phrase in text]
    assert found == [], f"{page.relative_to(ROOT)} narrates history: {found}"


def test_operations_page_lists_every_setting() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    missing = [name for name in Settings.model_fields if f"| `{name}` |" not in text]
    assert missing == [], f"docs/operations.md has no row for settings {missing}"


def test_readme_is_a_front_door() -> None:
    """What refitd is comes before any command, and the page stays short."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"
    first_command = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert any("refitd is" in line for line in lines[:first_command])
