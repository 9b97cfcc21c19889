"""Wire formats: how a copy's values travel, their size rule, the registry and name lookups.

A copy's wire segment is its values followed, for a blocked (quantized) format, by one
scale per block and, for a format with a tensor scale (NVFP4's FP32 global scale), that
one scale; each part starts SEGMENT_ALIGN-aligned so the receiver can view it in its dtype
without a copy. A block covers the trailing dims of a tensor (a tensor with fewer dims than
the block is treated as a single row). Values may be packed several to a byte along the
last dim (each row starts on a byte). The planner, the program checks, the executor and
the codecs (refitd.formats.Transform) all size segments through WireFormat.

A copy's wire is stored as a small integer code: the format's position in a WireRegistry
(raw is always code 0). BUILTIN_WIRES holds raw, MXFP8 (OCP MX: E4M3 values, one E8M0
scale per 32 along the last dim), block FP8 (E4M3 values, one FP32 scale per 128x128
tile) and NVFP4 (E2M1 values two per byte, one E4M3 scale per 16 along the last dim, one
FP32 global scale per region, which is therefore never cut); a new built-in format is one
more WireFormat in it, appended so that the codes of the others stay. A registry is immutable: `with_format` returns a new one, so a plan's
registry (PlanConfig.wires) is part of its digest and cannot change under it.

A destination tensor's storage is "plain" or the storage of a format whose parts it keeps
unchanged (STORAGE_FORMATS, from the built-in registry).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from refitd.plan.rowwise import row_prod

SEGMENT_ALIGN = 16
WHOLE = 1 << 62  # split granularity of a region that is never cut

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
CAST_DTYPES = ("float64", "float32", "bfloat16", "float16")  # what quantizers and casts read

RAW = "raw"  # the source dtype's values as they are
PLAIN = "plain"  # a destination storage of plain values (raw lands there unchanged)
MXFP8 = "mxfp8"  # wire format and storage name
FP8_BLOCK = "fp8_block"  # wire format and storage name
NVFP4 = "nvfp4"  # wire format and storage name
MXFP8_BLOCK = 32
FP8_TILE = 128
NVFP4_BLOCK = 16
RAW_CODE = 0


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
    values_per_byte: values packed into one byte along the last dim (a row of n values
    takes ceil(n / values_per_byte) bytes), 1 for unpacked formats;
    tensor_scale_bytes: bytes of one scale computed over the copy's whole region (a third
    part), 0 for none: such a region is never cut, and a destination of this format's
    storage must be landed by one copy of its whole tensor;
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
    values_per_byte: int = 1
    tensor_scale_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a wire format needs a name")
        if any(b < 1 for b in self.block) or (self.block and self.scale_bytes < 1):
            raise ValueError(f"wire format {self.name!r}: blocks need sizes and scale bytes")
        if self.values_per_byte < 1 or (self.values_per_byte > 1 and self.element_bytes != 1):
            raise ValueError(f"wire format {self.name!r}: packed values need element_bytes=1")
        if self.tensor_scale_bytes and not self.block:
            raise ValueError(f"wire format {self.name!r}: a tensor scale needs blocks")

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

    def values_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the values part of a region of `shape`, in its elements (bytes when
        packed: the last dim shrinks to ceil(n / values_per_byte))."""
        if self.values_per_byte == 1 or not shape:
            return tuple(shape)
        return (*shape[:-1], -(-shape[-1] // self.values_per_byte))

    def segment_parts(self, shape: tuple[int, ...], src_dtype: str) -> tuple[int, ...]:
        """Byte sizes of the parts of one copy's segment, in wire order: (values,),
        (values, scales) or (values, scales, tensor scale)."""
        values = math.prod(self.values_shape(shape)) * (self.element_bytes or dtype_size(src_dtype))
        if not self.block:
            return (values,)
        scales = self.scale_bytes * math.prod(self.scale_shape(shape))
        if not self.tensor_scale_bytes:
            return (values, scales)
        return (values, scales, self.tensor_scale_bytes)

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
            return storage == PLAIN and src_dtype == dst_dtype
        return storage == self.storage

    # ------------------------------------------------------------------ columns
    def segment_nbytes_columns(
        self, shape: np.ndarray, ndim: np.ndarray, esize: np.ndarray
    ) -> np.ndarray:
        """segment_nbytes of many copies of this format (shape [N, D] padded with 1s past
        ndim; esize: the source element sizes)."""
        numel = row_prod(shape)
        values = numel * (self.element_bytes or esize)
        if self.values_per_byte > 1:
            last = shape[np.arange(shape.shape[0]), np.maximum(ndim.astype(np.int64) - 1, 0)]
            values = numel // np.maximum(last, 1) * -(-last // self.values_per_byte)
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
        tensor_scale = aligned(self.tensor_scale_bytes)
        return aligned_columns(values) + aligned_columns(self.scale_bytes * scales) + tensor_scale

    def split_granularity_columns(self, ndim: np.ndarray) -> np.ndarray:
        """Rows of dim 0 that keep whole blocks when a copy is cut along dim 0 (WHOLE: a
        region with a tensor scale is never cut)."""
        k = len(self.block)
        if self.tensor_scale_bytes:
            return np.full(ndim.size, WHOLE, np.int64)
        if not k:
            return np.ones(ndim.size, np.int64)
        j = np.clip(k - ndim, 0, k - 1)
        return np.where((ndim >= 1) & (ndim <= k), np.asarray(self.block, np.int64)[j], 1)


RAW_FORMAT = WireFormat(RAW)
MXFP8_FORMAT = WireFormat(
    MXFP8,
    element_bytes=1,
    block=(MXFP8_BLOCK,),
    scale_bytes=1,
    scale_dtype="uint8",
    storage=MXFP8,
    src_dtypes=CAST_DTYPES,
)
FP8_BLOCK_FORMAT = WireFormat(
    FP8_BLOCK,
    element_bytes=1,
    block=(FP8_TILE, FP8_TILE),
    scale_bytes=4,
    scale_dtype="float32",
    storage=FP8_BLOCK,
    src_dtypes=CAST_DTYPES,
)
NVFP4_FORMAT = WireFormat(
    NVFP4,
    element_bytes=1,
    block=(NVFP4_BLOCK,),
    scale_bytes=1,
    scale_dtype="uint8",
    storage=NVFP4,
    src_dtypes=CAST_DTYPES,
    values_per_byte=2,
    tensor_scale_bytes=4,
)


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
        """Bytes of one value on the wire for every copy (the source size for raw; a packed
        format counts one byte, a weight for replica choice, not a size)."""
        per = np.array([f.element_bytes for f in self.formats], np.int64)[codes]
        return np.where(per == 0, esize, per)


# The built-in formats, one entry each; codes are positions, so a new one is appended.
BUILTIN_WIRES = WireRegistry((RAW_FORMAT, MXFP8_FORMAT, FP8_BLOCK_FORMAT, NVFP4_FORMAT))
WIRE_FORMATS = BUILTIN_WIRES.names()  # built-in wire code -> name
# destination storages: plain, then the storage of every built-in format that has one
STORAGE_FORMATS = (PLAIN, *(f.storage for f in BUILTIN_WIRES.formats if f.storage))


def default_wires() -> WireRegistry:
    """The built-in formats: raw, mxfp8, fp8_block, nvfp4 (codes 0, 1, 2, 3)."""
    return BUILTIN_WIRES


# ---------------------------------------------------------------------- lookups by name
def mxfp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the E8M0 scales of an MXFP8 block of `shape` (one per 32 of the last dim)."""
    return MXFP8_FORMAT.scale_shape(shape)


def fp8_block_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the FP32 scales of a block-FP8 block of `shape` (one per 128x128 tile).

    A 1-D tensor is treated as a single row.
    """
    return FP8_BLOCK_FORMAT.scale_shape(shape)


def nvfp4_data_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the packed NVFP4 values of a block of `shape`: two E2M1 values per byte
    along the last dim (ceil(n / 2) bytes per row)."""
    return NVFP4_FORMAT.values_shape(shape)


def nvfp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the E4M3 scale bytes of an NVFP4 block of `shape` (one per 16 of the last
    dim)."""
    return NVFP4_FORMAT.scale_shape(shape)


def storage_data_shape(storage: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the data buffer of a tensor of `shape` (elements) kept in `storage`: the
    values part of the format that storage keeps (nvfp4: two values per byte), else
    `shape` itself."""
    code = BUILTIN_WIRES.for_storage(storage)
    return tuple(shape) if code is None else BUILTIN_WIRES.formats[code].values_shape(shape)


def segment_parts(
    wire: str, shape: tuple[int, ...], src_dtype: str, wires: WireRegistry = BUILTIN_WIRES
) -> tuple[int, ...]:
    """Byte sizes of the parts of one copy's wire segment, in wire order (each part starts
    SEGMENT_ALIGN-aligned): raw (values in the source dtype,); mxfp8 (E4M3 values, E8M0
    scales); fp8_block (E4M3 values, FP32 scales); nvfp4 (packed E2M1 values, E4M3
    scales, the FP32 global scale)."""
    return wires.get(wire).segment_parts(shape, src_dtype)


def segment_nbytes(
    wire: str, shape: tuple[int, ...], src_dtype: str, wires: WireRegistry = BUILTIN_WIRES
) -> int:
    """Bytes one copy occupies in a message, alignment padding included."""
    return wires.get(wire).segment_nbytes(shape, src_dtype)


def delta_capable(
    wire: str, src_dtype: str, storage: str, dst_dtype: str, wires: WireRegistry = BUILTIN_WIRES
) -> bool:
    """Whether a copy's destination holds the wire's elements unchanged, so a delta of them
    can land in place: raw into plain storage of the source dtype, MXFP8 into MXFP8, block
    FP8 into block FP8, NVFP4 into NVFP4 (a cast, quantization or dequantization on
    landing cannot)."""
    return wires.get(wire).lands_unchanged(src_dtype, storage, dst_dtype)
