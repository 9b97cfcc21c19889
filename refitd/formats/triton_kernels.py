"""GPU quantizers (Triton), bit-identical to the torch reference codecs.

Importable without triton: the kernels live in refitd.formats._triton_jit, imported on the
first call. Each function writes into the given output buffers (views into persistent
destination buffers or message buffers are fine); when a buffer cannot be viewed as rows
of its last dim, the kernel writes a temporary that is then copied in place.
"""

from __future__ import annotations

import importlib.util

import torch

from refitd.formats.fp8 import check_buffer, check_float, check_nvfp4_buffers
from refitd.formats.tuning import CANDIDATES
from refitd.plan.wire import (
    FP8_TILE,
    MXFP8_BLOCK,
    NVFP4_BLOCK,
    fp8_block_scale_shape,
    mxfp8_scale_shape,
)

# Defaults: the first of the tuner's candidates (refitd.formats.tuning), the best measured
# by refitd.bench.gpu.quantizers on an H100 80GB HBM3 (fast=True: bit-identical there, 0.77
# / 0.76 of copy_ bandwidth). NVFP4's amax pass folds tiles into at most amax_programs
# programs (one atomic each), a few per SM on an H100 / H200.
MXFP8_CONFIG = CANDIDATES["mxfp8"][0] | {"fast": True}
FP8_BLOCK_CONFIG = CANDIDATES["fp8_block"][0] | {"fast": True}
NVFP4_CONFIG = CANDIDATES["nvfp4"][0] | {"amax_programs": 1056}


def available() -> bool:
    """Whether triton is installed (the kernels need a CUDA device or TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


def _view(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    try:
        return t.view(shape)
    except RuntimeError:
        return None


HASHABLE = (torch.bfloat16, torch.float32)  # sources whose bytes the quantizers read as is


def check_hashable(x: torch.Tensor, hash: bool) -> None:
    if hash and x.dtype not in HASHABLE:
        raise ValueError(
            f"a fused checksum needs a bfloat16 or float32 source, not {x.dtype} (the kernel "
            "reads other dtypes converted)"
        )


def _partials(n: int, device: torch.device, hash: bool) -> torch.Tensor:
    """Per-program partial checksums (their int64 sum wraps as the checksum does); a
    placeholder the kernel never writes without hash."""
    return torch.empty(n if hash else 1, dtype=torch.int64, device=device)


def _as_kernel_input(x: torch.Tensor) -> torch.Tensor:
    """bf16 goes in as its int16 bits (widened exactly in the kernel); float64 as float32."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16)
    return x.to(torch.float32) if x.dtype == torch.float64 else x


def mxfp8_quantize_into(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    block_m: int = MXFP8_CONFIG["block_m"],
    block_c: int = MXFP8_CONFIG["block_c"],
    num_warps: int = MXFP8_CONFIG["num_warps"],
    fast: bool = MXFP8_CONFIG["fast"],
    hash: bool = False,
) -> torch.Tensor | None:
    """MXFP8 of x into data (uint8, x.shape) and scales (uint8, mxfp8_scale_shape). With
    hash (bf16 or float32 x), also the checksum of x's bytes in row-major order
    (refitd.executor.checksums), computed as the kernel reads them: a 0-d int64 tensor."""
    from refitd.formats._triton_jit import mxfp8_kernel

    check_float(x, "mxfp8 quantize")
    check_buffer(data, torch.uint8, tuple(x.shape), "mxfp8 data")
    check_buffer(scales, torch.uint8, mxfp8_scale_shape(tuple(x.shape)), "mxfp8 scales")
    check_hashable(x, hash)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device) if hash else None
    cols = x.shape[-1]
    nb = -(-cols // MXFP8_BLOCK)
    xk = _as_kernel_input(x)
    x2 = _view(xk, (-1, cols))
    if x2 is None:
        x2 = xk.reshape(-1, cols)
    q2, s2 = _view(data, (-1, cols)), _view(scales, (-1, nb))
    q_out = q2 if q2 is not None else torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
    s_out = (
        s2 if s2 is not None else torch.empty((x2.shape[0], nb), dtype=torch.uint8, device=x.device)
    )
    block_c = max(MXFP8_BLOCK, min(block_c, triton_next_pow2(cols)))
    rows = x2.shape[0]
    n_c = -(-cols // block_c)
    grid = (-(-rows // block_m) * n_c,)
    partial = _partials(grid[0], x.device, hash)
    mxfp8_kernel[grid](
        x2, q_out, s_out, partial, rows, cols, nb, n_c,
        x2.stride(0), x2.stride(1), q_out.stride(0), q_out.stride(1), s_out.stride(0), s_out.stride(1),
        BLOCK_M=block_m, BLOCK_C=block_c, SRC_BF16=x.dtype == torch.bfloat16, FAST=fast,
        HASH=hash, num_warps=num_warps,
    )  # fmt: skip
    if q2 is None:
        data.copy_(q_out.view(data.shape))
    if s2 is None:
        scales.copy_(s_out.view(scales.shape))
    return partial.sum() if hash else None


def fp8_block_quantize_into(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    sub_r: int = FP8_BLOCK_CONFIG["sub_r"],
    num_warps: int = FP8_BLOCK_CONFIG["num_warps"],
    fast: bool = FP8_BLOCK_CONFIG["fast"],
    hash: bool = False,
) -> torch.Tensor | None:
    """Block FP8 of x into data (uint8, x.shape) and scales (float32, fp8_block_scale_shape);
    with hash, the checksum of x's bytes as for mxfp8_quantize_into."""
    from refitd.formats._triton_jit import fp8_block_kernel

    check_float(x, "fp8_block quantize")
    check_buffer(data, torch.uint8, tuple(x.shape), "fp8_block data")
    check_buffer(scales, torch.float32, fp8_block_scale_shape(tuple(x.shape)), "fp8_block scales")
    check_hashable(x, hash)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device) if hash else None
    rows, cols = (1, x.shape[0]) if x.dim() == 1 else tuple(x.shape[-2:])
    tr, tc = -(-rows // FP8_TILE), -(-cols // FP8_TILE)
    xk = _as_kernel_input(x)
    x3 = _view(xk, (-1, rows, cols))
    if x3 is None:
        x3 = xk.reshape(-1, rows, cols)
    q3, s3 = _view(data, (-1, rows, cols)), _view(scales, (-1, tr, tc))
    q_out = q3 if q3 is not None else torch.empty(x3.shape, dtype=torch.uint8, device=x.device)
    s_out = (
        s3
        if s3 is not None
        else torch.empty((x3.shape[0], tr, tc), dtype=torch.float32, device=x.device)
    )
    grid = (x3.shape[0] * tr * tc,)
    partial = _partials(grid[0], x.device, hash)
    fp8_block_kernel[grid](
        x3, q_out, s_out, partial, rows, cols, tr, tc,
        x3.stride(0), x3.stride(1), x3.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        s_out.stride(0), s_out.stride(1), s_out.stride(2),
        SUB_R=sub_r, TILE=FP8_TILE, SRC_BF16=x.dtype == torch.bfloat16, FAST=fast,
        HASH=hash, num_warps=num_warps,
    )  # fmt: skip
    if q3 is None:
        data.copy_(q_out.view(data.shape))
    if s3 is None:
        scales.copy_(s_out.view(scales.shape))
    return partial.sum() if hash else None


def nvfp4_quantize_into(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    block_m: int = NVFP4_CONFIG["block_m"],
    block_c: int = NVFP4_CONFIG["block_c"],
    num_warps: int = NVFP4_CONFIG["num_warps"],
    amax_programs: int = NVFP4_CONFIG["amax_programs"],
    amax: torch.Tensor | None = None,
) -> None:
    """NVFP4 of x (even last dim) into data (uint8, nvfp4_data_shape), scales (uint8,
    nvfp4_scale_shape) and global_scale (float32, one element). block_c counts elements.
    amax: x's amax bits (int32, one element on x's device: refitd.formats.nvfp4.amax_bits
    or nvfp4_amax_into) when already known; then one launch reads x once, else an amax
    pass reads it first."""
    from refitd.formats._triton_nvfp4 import nvfp4_kernel

    check_float(x, "nvfp4 quantize")
    shape = tuple(x.shape)
    check_nvfp4_buffers(shape, data, scales, global_scale, "nvfp4 quantize")
    if x.numel() == 0:
        return
    cols = shape[-1]
    nb = -(-cols // NVFP4_BLOCK)
    words = _pair_words(x)
    rows, width = words.shape
    q2, s2 = _row_major(data, (-1, width)), _row_major(scales, (-1, nb))
    q_out = q2 if q2 is not None else torch.empty(words.shape, dtype=torch.uint8, device=x.device)
    s_out = s2 if s2 is not None else torch.empty((rows, nb), dtype=torch.uint8, device=x.device)
    block_w = _nvfp4_block_w(cols, block_c)
    n_c = -(-width // block_w)
    n_tiles = -(-rows // block_m) * n_c
    if amax is None:
        amax = torch.zeros(1, dtype=torch.int32, device=x.device)
        _nvfp4_amax(x, words, amax, block_m, block_w, num_warps, amax_programs)
    elif amax.dtype != torch.int32 or amax.numel() != 1 or amax.device != x.device:
        raise ValueError(
            f"nvfp4 quantize: amax must be int32 bits of one element on {x.device}, got "
            f"{amax.dtype} of shape {tuple(amax.shape)} on {amax.device}"
        )
    nvfp4_kernel[(n_tiles,)](
        words, q_out, s_out, global_scale.view(-1), amax.view(-1), rows, width, nb, n_c, n_tiles,
        words.stride(0), q_out.stride(0), s_out.stride(0),
        BLOCK_M=block_m, BLOCK_W=block_w, SRC=_nvfp4_src(x), num_warps=num_warps,
    )  # fmt: skip
    if q2 is None:
        data.copy_(q_out.view(data.shape))
    if s2 is None:
        scales.copy_(s_out.view(scales.shape))


def nvfp4_amax_into(
    x: torch.Tensor,
    amax: torch.Tensor,
    block_m: int = NVFP4_CONFIG["block_m"],
    block_c: int = NVFP4_CONFIG["block_c"],
    num_warps: int = NVFP4_CONFIG["num_warps"],
    amax_programs: int = NVFP4_CONFIG["amax_programs"],
    out: torch.Tensor | None = None,
) -> None:
    """Fold the amax bits of x (even last dim) into amax (int32, one element, zeroed before
    the first piece): called on every piece of a tensor, amax ends as the tensor's, which
    nvfp4_quantize_into(amax=...) takes (refitd.formats.nvfp4.amax_bits on the CPU).
    out: a contiguous tensor of x's dtype and element count (not float64) that receives
    x's values in row-major order from the same read."""
    check_float(x, "nvfp4 amax")
    if amax.dtype != torch.int32 or amax.numel() != 1 or amax.device != x.device:
        raise ValueError(f"nvfp4 amax: the accumulator must be int32 of one element on {x.device}")
    if out is not None and (
        out.dtype != x.dtype
        or x.dtype == torch.float64
        or out.numel() != x.numel()
        or not out.is_contiguous()
        or out.device != x.device
    ):
        raise ValueError(
            f"nvfp4 amax: out must be a contiguous {x.dtype} tensor of {x.numel()} elements "
            f"on {x.device} (float64 has no copy), got {out.dtype} {tuple(out.shape)}"
        )
    if x.numel() == 0:
        return
    block_w = _nvfp4_block_w(x.shape[-1], block_c)
    _nvfp4_amax(x, _pair_words(x), amax, block_m, block_w, num_warps, amax_programs, out)


def _nvfp4_block_w(cols: int, block_c: int) -> int:
    """Tile width in words (two elements each) of a row of `cols` elements."""
    return max(NVFP4_BLOCK, min(block_c, triton_next_pow2(cols))) // 2


def _nvfp4_src(x: torch.Tensor) -> int:
    from refitd.formats._triton_nvfp4 import SRC_BF16, SRC_F16, SRC_F32

    return {torch.bfloat16: SRC_BF16, torch.float16: SRC_F16}.get(x.dtype, SRC_F32)


def _nvfp4_amax(
    x: torch.Tensor,
    words: torch.Tensor,
    amax: torch.Tensor,
    block_m: int,
    block_w: int,
    num_warps: int,
    amax_programs: int,
    out: torch.Tensor | None = None,
) -> None:
    """The amax pass over x's words: atomic max of its bits into amax (and, with `out`,
    the words stored there, rows back to back)."""
    from refitd.formats._triton_nvfp4 import nvfp4_amax_kernel

    rows, width = words.shape
    n_c = -(-width // block_w)
    flat = words.stride(0) == width  # rows back to back: the amax pass reads flat tiles
    a_tiles = -(-rows * width // (block_m * block_w)) if flat else -(-rows // block_m) * n_c
    o = words if out is None else out.reshape(-1).view(words.dtype)
    nvfp4_amax_kernel[(min(a_tiles, amax_programs),)](
        words, amax.view(-1), o, rows, width, n_c, a_tiles, words.stride(0),
        BLOCK_M=block_m, BLOCK_W=block_w, SRC=_nvfp4_src(x), FLAT=flat, COPY=out is not None,
        num_warps=num_warps,
    )  # fmt: skip


def _pair_words(x: torch.Tensor) -> torch.Tensor:
    """x (even last dim) as rows of words of two elements, the row-major view when there
    is one (else a copy): int32 words of bf16/fp16, int64 words of float32 (float64 is
    rounded to float32 first)."""
    x = x.to(torch.float32) if x.dtype == torch.float64 else x
    word = torch.int32 if x.element_size() == 2 else torch.int64
    x2 = _view(x, (-1, x.shape[-1]))
    if x2 is not None and x2.stride(1) == 1:
        w = _view_dtype(x2, word)
        if w is not None:
            return w
    return x.reshape(-1, x.shape[-1]).contiguous().view(word)


def _view_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


def _row_major(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """t viewed as rows of `shape` whose last dim is contiguous, else None."""
    v = _view(t, shape)
    return v if v is not None and (v.shape[1] <= 1 or v.stride(1) == 1) else None


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
