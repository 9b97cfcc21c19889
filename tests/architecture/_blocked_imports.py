"""Import modules with some imports blocked; print what was blocked, and from where, as JSON.

Run by test_layering.py in a fresh interpreter:

    python _blocked_imports.py '{"root": ..., "modules": [...], "forbidden": [...],
                                 "only_refitd": [...] | null, "optional": [...]}'

A finder placed first on sys.meta_path refuses (ImportError) every module whose name is, or
is under, one of `forbidden`, and, when `only_refitd` is given, every `refitd.*` module
outside those packages. Each refusal is recorded with the chain of modules (and functions)
that led to it, even when the importing code catches the ImportError. `optional`: missing
third-party packages that make a module unimportable without it being a layering fault.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from types import FrameType, ModuleType
from typing import Any


def _blocked(name: str, forbidden: list[str], only_refitd: list[str] | None) -> bool:
    def under(prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    if any(under(p) for p in forbidden):
        return True
    if only_refitd is None or not name.startswith("refitd."):
        return False
    return not any(under(p) for p in only_refitd)


def _chain(frame: FrameType | None) -> list[str]:
    """Who is importing: module bodies (and functions doing a lazy import), outermost first,
    skipping the import machinery and this script."""
    out: list[str] = []
    while frame is not None:
        module = frame.f_globals.get("__name__", "?")
        if not module.startswith(("importlib", "__main__")):
            code = frame.f_code
            where = module if code.co_name == "<module>" else f"{module}:{code.co_qualname}"
            where += f" (line {frame.f_lineno})"
            if not out or out[-1] != where:
                out.append(where)
        frame = frame.f_back
    return out[::-1]


class BlockingFinder:
    """Refuses the forbidden imports and remembers each attempt."""

    def __init__(self, forbidden: list[str], only_refitd: list[str] | None) -> None:
        self.forbidden = forbidden
        self.only_refitd = only_refitd
        self.attempts: list[dict[str, Any]] = []

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> None:
        if _blocked(name, self.forbidden, self.only_refitd):
            self.attempts.append({"blocked": name, "chain": _chain(sys._getframe(1))})
            raise ImportError(f"layering test: import of {name!r} is forbidden here")
        return None


def main(args: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, args["root"])
    forbidden, only = args["forbidden"], args["only_refitd"]
    preloaded = sorted(m for m in sys.modules if _blocked(m, forbidden, only))
    finder = BlockingFinder(forbidden, only)
    sys.meta_path.insert(0, finder)
    unavailable: dict[str, str] = {}
    broken: dict[str, str] = {}
    for module in args["modules"]:
        seen = len(finder.attempts)
        try:
            importlib.import_module(module)
        except ImportError as e:
            if len(finder.attempts) > seen:
                continue  # a layering fault, recorded by the finder
            if getattr(e, "name", None) in args["optional"]:
                unavailable[module] = str(e)
            else:
                broken[module] = "".join(traceback.format_exception_only(e)).strip()
        except Exception as e:
            broken[module] = "".join(traceback.format_exception_only(e)).strip()
    return {
        "preloaded": preloaded,
        "attempts": finder.attempts,
        "unavailable": unavailable,
        "broken": broken,
        "loaded_from": sys.modules["refitd"].__file__ if "refitd" in sys.modules else None,
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
