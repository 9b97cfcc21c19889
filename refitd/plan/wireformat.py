"""One wire format's geometry and its size rule, scalar and vectorised.

A copy's wire segment is its values followed, for a blocked (quantized) format, by one
scale per block; each part starts SEGMENT_ALIGN-aligned so the receiver can view it in its
dtype without a copy. A block covers the trailing dims of a tensor (a tensor with fewer
dims than the block is treated as a single row). The planner, the program checks, the
executor and the codecs (refitd.formats.Transform) all size segments through this class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from refitd.plan.rowwise import row_prod

SEGMENT_ALIGN = 16

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_size(dtype: str) -> int:
    """Element size in bytes of a dtype name; a clear error for unknown names."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}") from None


def aligned(n: int) -> int:
    """n rounded up to SEGMENT_ALIGN."""
    return -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN


def aligned_columns(n: np.ndarray) -> np.ndarray:
    """aligned() of every element."""
    return -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN


@dataclass(frozen=True, slots=True)
class WireFormat:
    """How one wire format lays a copy out.

    element_bytes: bytes of one value on the wire, 0 for the source dtype's size (raw);
    block: the scale block over the trailing dims, () for a format without scales;
    scale_bytes / scale_dtype: one scale's size and dtype name;
    storage: the destination storage that keeps this wire's parts unchanged (the planner
    sends this wire to such destinations under sender quantization; deltas land in place),
    None for raw (which lands unchanged in plain storage of the source dtype);
    src_dtypes: the source dtypes it encodes, None for any.
    """

    name: str
    element_bytes: int = 0
    block: tuple[int, ...] = ()
    scale_bytes: int = 0
    scale_dtype: str = ""
    storage: str | None = None
    src_dtypes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a wire format needs a name")
        if any(b < 1 for b in self.block) or (self.block and self.scale_bytes < 1):
            raise ValueError(f"wire format {self.name!r}: blocks need sizes and scale bytes")

    def accepts(self, src_dtype: str) -> bool:
        """Whether sources of this dtype can be sent in this format."""
        return self.src_dtypes is None or src_dtype in self.src_dtypes

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the scales of a region of `shape` (one per block), () without blocks."""
        k = len(self.block)
        if not k or not shape:
            return ()
        full = (1,) * (k - len(shape)) + tuple(shape)
        tail = (-(-n // b) for n, b in zip(full[-k:], self.block, strict=True))
        return (*full[:-k], *tail)

    def segment_parts(self, shape: tuple[int, ...], src_dtype: str) -> tuple[int, ...]:
        """Byte sizes of the parts of one copy's segment, in wire order: (values,) or
        (values, scales)."""
        values = math.prod(shape) * (self.element_bytes or dtype_size(src_dtype))
        if not self.block:
            return (values,)
        return (values, self.scale_bytes * math.prod(self.scale_shape(shape)))

    def segment_nbytes(self, shape: tuple[int, ...], src_dtype: str) -> int:
        """Bytes one copy occupies in a message, alignment padding included."""
        return sum(aligned(p) for p in self.segment_parts(shape, src_dtype))

    def block_of_dim(self, dim: int, ndim: int) -> int:
        """The block size along `dim` of an ndim-d region, 1 where no block applies."""
        k = len(self.block)
        j = k - (ndim - dim)
        return self.block[j] if 0 <= j < k else 1

    def lands_unchanged(self, src_dtype: str, storage: str, dst_dtype: str) -> bool:
        """Whether a destination holds this wire's elements unchanged, so a delta of them
        can land in place (a cast, quantization or dequantization on landing cannot)."""
        if self.storage is None:
            return storage == "plain" and src_dtype == dst_dtype
        return storage == self.storage

    # ------------------------------------------------------------------ columns
    def segment_nbytes_columns(
        self, shape: np.ndarray, ndim: np.ndarray, esize: np.ndarray
    ) -> np.ndarray:
        """segment_nbytes of many copies of this format (shape [N, D] padded with 1s past
        ndim; esize: the source element sizes)."""
        numel = row_prod(shape)
        values = numel * (self.element_bytes or esize)
        if not self.block:
            return aligned_columns(values)
        k = len(self.block)
        rows = np.arange(shape.shape[0])
        covered = np.ones(rows.size, np.int64)
        scales = np.ones(rows.size, np.int64)
        for j, b in enumerate(self.block):
            dim = ndim - k + j
            n = np.where(dim >= 0, shape[rows, np.maximum(dim, 0)], 1)
            covered = covered * n
            scales = scales * -(-n // b)
        scales = numel // np.maximum(covered, 1) * scales
        return aligned_columns(values) + aligned_columns(self.scale_bytes * scales)

    def split_granularity_columns(self, ndim: np.ndarray) -> np.ndarray:
        """Rows of dim 0 that keep whole blocks when a copy is cut along dim 0."""
        k = len(self.block)
        if not k:
            return np.ones(ndim.size, np.int64)
        j = np.clip(k - ndim, 0, k - 1)
        return np.where((ndim >= 1) & (ndim <= k), np.asarray(self.block, np.int64)[j], 1)
