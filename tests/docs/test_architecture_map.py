"""docs/architecture.md names only modules that exist: every row of its module map, and every
module path its prose names (`plan/layout.py`, `server/refit/run.RefitRun`, `refitd/config.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = sorted(p.name for p in (ROOT / "refitd").iterdir() if (p / "__init__.py").exists())
SECTION = re.compile(r"^### (.*)$", re.M)
ROW = re.compile(r"^\| `([^`]+)` \|", re.M)
# `pkg/sub/module.py`, `pkg/module.Name`, `refitd/pkg/module.py`, `clients/pkg/module.py`
PATH = re.compile(r"`((?:refitd/|clients/)?[a-z_]+(?:/[a-z_0-9]+)*(?:\.py)?)(?:[.:][A-Za-z_]\w*)*`")


def exists(path: str) -> bool:
    """A module path (file or package, with or without .py) under the repository."""
    p = ROOT / path.rstrip("/")
    return p.exists() or p.with_suffix(".py").exists() or any(p.parent.glob(p.name + ".*"))


def module_map_rows() -> list[tuple[str, str]]:
    """(section package, row module) for every row of the module map's tables; the package
    is the section heading's backticked path, or "" where rows give whole paths."""
    text = PAGE.read_text().split("## Module map", 1)[1]
    sections = list(SECTION.finditer(text))
    rows: list[tuple[str, str]] = []
    for i, heading in enumerate(sections):
        end = sections[i + 1].start() if i + 1 < len(sections) else len(text)
        package = re.match(r"`([^`]+)`", heading.group(1))
        where = package.group(1) if package else ""
        rows += [(where, m.group(1)) for m in ROW.finditer(text, heading.end(), end)]
    return rows


def row_path(package: str, module: str) -> str | None:
    """The repository path a row names (None: a one-file section lists its contents)."""
    if package.endswith(".py"):
        return None
    if not package or module.startswith(("refitd/", "clients/", "protos/")):
        return module.rstrip("/")
    return f"{package.rstrip('/')}/{module}".rstrip("/")


def missing_rows() -> list[str]:
    out = []
    for package, module in module_map_rows():
        path = row_path(package, module)
        if path is not None and not exists(path):
            out.append(f"module map, section {package or '(whole paths)'}: {module}")
    return out


def missing_prose_paths() -> list[str]:
    out = []
    for token in sorted(set(PATH.findall(PAGE.read_text()))):
        first = token.split("/", 1)[0]
        if "/" not in token and not token.endswith(".py"):
            continue  # a bare word (`agent`, `apply`): not a path
        if first in ("refitd", "clients", "protos", "tests", "docs", "deploy", "scripts"):
            path = token
        elif first in PACKAGES:
            path = f"refitd/{token}"
        else:
            continue  # a file named inside its own section's table
        if not exists(path):
            out.append(token)
    return out


def test_every_module_in_the_module_map_exists() -> None:
    rows = module_map_rows()
    assert len(rows) > 100, f"the module map parse found only {len(rows)} rows"
    assert missing_rows() == []


def test_every_module_path_in_the_prose_exists() -> None:
    assert missing_prose_paths() == []


def test_every_product_module_is_in_the_module_map() -> None:
    """The map is complete: each module of refitd (generated code aside) has a row."""
    listed = {row_path(p, m) for p, m in module_map_rows()}
    listed |= {p for p, _ in module_map_rows() if p.endswith(".py")}
    unlisted = [
        str(f.relative_to(ROOT))
        for f in sorted((ROOT / "refitd").rglob("*.py"))
        if f.name != "__init__.py"
        and not str(f.relative_to(ROOT)).startswith("refitd/_proto/")
        and str(f.relative_to(ROOT)) not in listed
    ]
    assert unlisted == []
