"""The registry of wire formats: the one list the planner, the executor and the codecs read.

A copy's wire is stored as a small integer code: the format's position in the registry
(raw is always code 0). BUILTIN_WIRES holds raw, MXFP8 (OCP MX: E4M3 values, one E8M0
scale per 32 along the last dim) and block FP8 (E4M3 values, one FP32 scale per 128x128
tile). A registry is immutable: `with_format` returns a new one, so a plan's registry
(PlanConfig.wires) is part of its digest and cannot change under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refitd.plan.wireformat import WireFormat

CAST_DTYPES = ("float64", "float32", "bfloat16", "float16")
MXFP8_BLOCK = 32
FP8_TILE = 128

RAW_FORMAT = WireFormat("raw")
MXFP8_FORMAT = WireFormat(
    "mxfp8",
    element_bytes=1,
    block=(MXFP8_BLOCK,),
    scale_bytes=1,
    scale_dtype="uint8",
    storage="mxfp8",
    src_dtypes=CAST_DTYPES,
)
FP8_BLOCK_FORMAT = WireFormat(
    "fp8_block",
    element_bytes=1,
    block=(FP8_TILE, FP8_TILE),
    scale_bytes=4,
    scale_dtype="float32",
    storage="fp8_block",
    src_dtypes=CAST_DTYPES,
)
RAW_CODE = 0


@dataclass(frozen=True, slots=True)
class WireRegistry:
    """Wire formats by code (their position); the first is raw."""

    formats: tuple[WireFormat, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.formats]
        if len(set(names)) != len(names):
            raise ValueError(f"wire format names repeat: {names}")
        if not self.formats or self.formats[RAW_CODE] != RAW_FORMAT:
            raise ValueError("the first wire format of a registry is raw")
        if len(self.formats) > 255:
            raise ValueError("at most 255 wire formats (codes travel as uint8)")

    def with_format(self, fmt: WireFormat, *, replace: bool = False) -> WireRegistry:
        """A registry with `fmt` added (or, with replace=True, put in place of the format
        of the same name, keeping its code)."""
        if fmt.name in self.names():
            if not replace:
                raise ValueError(f"wire format {fmt.name!r} is already registered")
            i = self.code(fmt.name)
            return WireRegistry((*self.formats[:i], fmt, *self.formats[i + 1 :]))
        return WireRegistry((*self.formats, fmt))

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.formats)

    def code(self, name: str) -> int:
        for i, f in enumerate(self.formats):
            if f.name == name:
                return i
        raise ValueError(f"unknown wire format {name!r}; known: {self.names()}")

    def get(self, name: str) -> WireFormat:
        return self.formats[self.code(name)]

    def for_storage(self, storage: str) -> int | None:
        """Code of the wire whose parts a destination of this storage keeps unchanged."""
        for i, f in enumerate(self.formats):
            if f.storage is not None and f.storage == storage:
                return i
        return None

    # ------------------------------------------------------------------ columns
    def _present(self, codes: np.ndarray) -> list[int]:
        if codes.size and (int(codes.max()) >= len(self.formats) or int(codes.min()) < 0):
            raise ValueError(f"wire codes outside 0..{len(self.formats) - 1}")
        counts = np.bincount(codes, minlength=len(self.formats)) if codes.size else []
        return [i for i, n in enumerate(counts) if n]

    def segment_nbytes(
        self, codes: np.ndarray, shape: np.ndarray, ndim: np.ndarray, esize: np.ndarray
    ) -> np.ndarray:
        """WireFormat.segment_nbytes of every copy at once (shape [N, D] padded with 1s
        past ndim, esize the source element sizes)."""
        present = self._present(codes)
        if len(present) == 1:
            return self.formats[present[0]].segment_nbytes_columns(shape, ndim, esize)
        out = np.zeros(codes.size, np.int64)
        for i in present:
            rows = np.flatnonzero(codes == i)
            out[rows] = self.formats[i].segment_nbytes_columns(shape[rows], ndim[rows], esize[rows])
        return out

    def split_granularity(self, codes: np.ndarray, ndim: np.ndarray) -> np.ndarray:
        """Rows of dim 0 that keep whole blocks when each copy is cut along dim 0."""
        out = np.ones(codes.size, np.int64)
        for i in self._present(codes):
            if self.formats[i].block:
                rows = np.flatnonzero(codes == i)
                out[rows] = self.formats[i].split_granularity_columns(ndim[rows])
        return out

    def element_bytes(self, codes: np.ndarray, esize: np.ndarray | int) -> np.ndarray:
        """Bytes of one value on the wire for every copy (the source size for raw)."""
        per = np.array([f.element_bytes for f in self.formats], np.int64)[codes]
        return np.where(per == 0, esize, per)


BUILTIN_WIRES = WireRegistry((RAW_FORMAT, MXFP8_FORMAT, FP8_BLOCK_FORMAT))


def default_wires() -> WireRegistry:
    """The built-in formats: raw, mxfp8, fp8_block (codes 0, 1, 2)."""
    return BUILTIN_WIRES
