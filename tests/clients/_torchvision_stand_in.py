"""Import-time stand-in for the torchvision names that SGLang 0.5.23 imports at module
level on the way to its request classes, for a machine without torchvision.

Why: `sglang.srt.managers.io_struct` (UpdateWeightsFromTensorReqInput) imports the package
`sglang.srt.configs`, whose multimodal configs run `import torchvision.transforms` and
`from torchvision.transforms[.functional] import InterpolationMode` at import
(sglang/srt/multimodal/internvl_utils.py, sglang/srt/configs/deepseek_ocr.py) and use them
only inside image-preprocessing functions. PyPI's Linux torchvision wheels are CUDA builds
that fail to import beside a CPU torch ("operator torchvision::nms does not exist"), and
PyPI has no torchvision source to build for the installed torch.

What is stood in: the modules `torchvision`, `torchvision.transforms` and
`torchvision.transforms.functional`, holding the one name `InterpolationMode`; handed only
to importers inside the `sglang` package and only inside `torchvision_stand_in()`, after
which they leave `sys.modules` (transformers and every other importer see no torchvision).
Any use of the stood-in name raises, and any other torchvision name is missing: the tested
path (SGLang's request class, MultiprocessingSerializer, dynamic_import and the loader
call) uses no torchvision behaviour, and SGLang's own classes stay SGLang's.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from typing import Any, NoReturn

NAMES: dict[str, tuple[str, ...]] = {
    "torchvision": (),
    "torchvision.transforms": ("InterpolationMode",),
    "torchvision.transforms.functional": ("InterpolationMode",),
}
WHY = "torchvision is not installed; a test stand-in satisfies SGLang's module-level import"


class StoodIn:
    """A torchvision name SGLang imports at module level: using it in any way raises."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _refuse(self, *_: Any, **__: Any) -> NoReturn:
        raise RuntimeError(f"{self._name} was used, but {WHY} only")

    __call__ = _refuse

    def __getattr__(self, attr: str) -> NoReturn:
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._refuse()

    def __setattr__(self, attr: str, value: Any) -> NoReturn:
        self._refuse()


class _SglangOnlyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the stood-in modules for `import` statements in SGLang's own modules only."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in NAMES or not _importer().startswith("sglang."):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, WHY)
        for attr in NAMES[spec.name]:
            setattr(module, attr, StoodIn(f"{spec.name}.{attr}"))
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: create_module made the whole module."""


def _importer() -> str:
    """The module whose code asked for the import: the first frame outside the import
    machinery (util.find_spec probes, e.g. transformers', come from importlib.util)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen "):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


@contextlib.contextmanager
def torchvision_stand_in() -> Iterator[None]:
    """Within: SGLang's module-level torchvision imports get the stand-ins. After: they
    leave sys.modules (SGLang's modules keep what they bound)."""
    finder = _SglangOnlyFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in NAMES:
            module = sys.modules.get(name)
            if module is not None and getattr(module.__spec__, "loader", None) is finder:
                del sys.modules[name]
