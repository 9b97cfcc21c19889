"""Room sizes: a product module past 450 lines or a function past 80 holds two ideas.

Benchmarks (refitd/bench) and generated protobuf code (refitd/_proto) are outside the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "refitd"
EXEMPT = ("bench", "_proto")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _product_modules() -> list[Path]:
    return sorted(
        p
        for p in PACKAGE.rglob("*.py")
        if not any(part in EXEMPT for part in p.relative_to(PACKAGE).parts)
    )


def test_product_modules_are_found() -> None:
    assert len(_product_modules()) > 100


def test_no_product_module_over_the_line_limit() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in _product_modules()
        if (n := p.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_product_function_over_the_line_limit() -> None:
    long: dict[str, int] = {}
    for p in _product_modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
