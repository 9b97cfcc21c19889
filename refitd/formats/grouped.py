"""Grouped landing: many regions copied, quantized or hashed in a few kernel launches.

A refit step (the local copies of a slot program) may hold thousands of regions. Landing
them one call at a time costs tens of microseconds of Python and a launch each, which is
more than the GPU needs for a region of a few MiB. `GroupedLanding` collects the regions
once (when the executor prepares a program), builds per-kernel tables on the device, and
each refit then runs one launch per (kernel, source dtype, alignment) group:
  - plain copies of the same dtype (optionally hashing source and landed destination:
    the checksums of refitd.executor.checksums, fused into the copy),
  - MXFP8 and block-FP8 quantization into persistent buffers (the per-tensor kernels'
    tiles, so the bytes are the same); a region large enough to fill the GPU alone gets
    the per-tensor kernel's own launch instead, as every NVFP4 region does; the first run
    times a few tile configs on those regions and keeps the fastest (refitd.formats.tuning).
On CUDA the launches of a run are captured once into a CUDA graph and replayed.
Regions it cannot take (other strides, dtypes, a CPU device, no triton) are refused by
`add_*` returning False; the caller lands those one by one as before. Importable without
triton; the kernels load on first use. Table addresses are fixed at build: the caller must
rebuild when a registered storage moves (the executor's storage check refuses such refits).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
from dataclasses import dataclass, field

import torch

from refitd.formats.region import DestRegion
from refitd.formats.tuning import DirectLaunches, TileTuner
from refitd.plan.wire import FP8_BLOCK, FP8_TILE, MXFP8, MXFP8_BLOCK, NVFP4

COPY_BLOCK_R = 8
COPY_BLOCK_W = 512  # 32-bit words: a 16 KiB tile per program
COPY_WARPS = 4
MX_BLOCK_M, MX_BLOCK_C, MX_WARPS = 8, 512, 4
FB_SUB_R, FB_WARPS = 32, 8
_SRC_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# quantized regions of at least this many elements get a per-tensor kernel launch of their
# own (in the same graph): measured on an H100, 8 regions of 64 Mi elements ran 0.71 ms as
# per-tensor launches and 0.86 ms through the table-driven grouped kernel
OWN_LAUNCH_ELEMENTS = 1 << 24


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device) -> bool:
    """Whether grouped kernels can run on `device` (CUDA with triton installed)."""
    return device.type == "cuda" and triton_installed()


def _squeeze(t: torch.Tensor) -> tuple[list[int], list[int]]:
    dims = [(n, s) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1]
    return [n for n, _ in dims], [s for _, s in dims]


def _inner_start(shape: list[int], strides: list[int]) -> int:
    """First dim of the innermost contiguous run of a (squeezed) view; len(shape) if none."""
    if not shape or strides[-1] != 1:
        return len(shape)
    j, run = len(shape) - 1, shape[-1]
    while j > 0 and strides[j - 1] == run:
        run *= shape[j - 1]
        j -= 1
    return j


def _rows_at(shape: list[int], strides: list[int], j: int) -> tuple[int, int, int] | None:
    """(rows, row elements, row stride) with dims j.. as one contiguous row and dims ..j
    collapsed into one strided dim; None when the outer dims do not collapse."""
    row = math.prod(shape[j:])
    if j == 0:
        return 1, row, row
    for d in range(j - 1):
        if strides[d] != strides[d + 1] * shape[d + 1]:
            return None
    return math.prod(shape[:j]), row, strides[j - 1]


def _matrix(t: torch.Tensor, cols: int) -> tuple[int, int] | None:
    """(rows, row stride) of t viewed as rows of its last dim (cols, unit stride)."""
    if t.numel() == 0 or (cols > 1 and t.stride(-1) != 1):
        return None
    shape, strides = list(t.shape[:-1]), list(t.stride()[:-1])
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    if not dims:
        return 1, cols
    for (_, s0), (n1, s1) in itertools.pairwise(dims):
        if s0 != s1 * n1:
            return None
    return math.prod(n for n, _ in dims), dims[-1][1]


@dataclass
class _Group:
    kernel: str
    meta: dict
    bases: tuple[torch.Tensor, ...]
    rows: list[list[int]] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    seg: torch.Tensor | None = None
    work: torch.Tensor | None = None
    prog_seg: torch.Tensor | None = None
    order: torch.Tensor | None = None  # copy groups: positions of its regions in add order
    n_programs: int = 0


class GroupedLanding:
    """Regions of one refit step; `build` once, then `run` every refit (see the module doc)."""

    def __init__(
        self, device: torch.device, fast: bool = True, tiles: dict | None = None, tune: bool = True
    ) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.fast = fast  # the quantizers' hardware-cvt variant (bit-identical on sm_89+)
        # tile configs (benchmarks try others): mxfp8 (block_m, block_c, warps), fp8_block
        # (sub_r, warps), copy (block_r, block_w, warps)
        self.tiles = {
            "mxfp8": (MX_BLOCK_M, MX_BLOCK_C, MX_WARPS),
            "fp8_block": (FB_SUB_R, FB_WARPS),
            "copy": (COPY_BLOCK_R, COPY_BLOCK_W, COPY_WARPS),
        } | (tiles or {})
        self._anchor = torch.empty(64, dtype=torch.uint8, device=device)
        self._groups: dict[tuple, _Group] = {}
        self.copies = 0  # copy regions added, in order (rows of run(hash=True))
        self._copy_keys: list[tuple] = []
        self._direct = DirectLaunches()  # regions with a launch of their own
        self.chosen = self._direct.chosen  # their configs once tuned (reports show them)
        self.tuner = TileTuner() if tune else None  # their configs, timed at the first run
        self.own_launch_elements = OWN_LAUNCH_ELEMENTS
        self.graphs = device.type == "cuda"  # replay a captured graph after the first run
        self.graph_error: str | None = None
        self._graphs: dict[bool, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.regions = 0
        self.nbytes = 0

    def _base(self, dtype: torch.dtype) -> torch.Tensor:
        return self._anchor.view(dtype)

    def _off(self, t: torch.Tensor, itemsize: int) -> int:
        delta = t.data_ptr() - self._anchor.data_ptr()
        return delta // itemsize

    def _group(self, key: tuple, kernel: str, meta: dict, bases: tuple) -> _Group:
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(kernel, meta, bases)
        return g

    # ------------------------------------------------------------------ regions
    def add_copy(self, src: torch.Tensor, dst: torch.Tensor) -> bool:
        """A same-dtype copy src -> dst as 32-bit words; False when not eligible."""
        if (
            src.device != self.device
            or dst.device != self.device
            or src.dtype != dst.dtype
            or tuple(src.shape) != tuple(dst.shape)
        ):
            return False
        layout = word_rows(src, dst)
        if layout is None:
            return False
        (s_addr, d_addr), n_rows, row_words, (s_stride, d_stride) = layout
        total = n_rows * row_words
        block_r, block_w, warps = self.tiles["copy"]
        if n_rows == 1 or (s_stride == row_words and d_stride == row_words):  # contiguous
            n_rows, row_words = -(-total // block_w), block_w
            s_stride = d_stride = block_w
        s_off = (s_addr - self._anchor.data_ptr()) // 4
        d_off = (d_addr - self._anchor.data_ptr()) // 4
        fields = [s_off, d_off, n_rows, row_words, s_stride, d_stride, total]
        wa = 4 if all(fields[i] % 4 == 0 for i in (0, 1, 3, 4, 5, 6)) else 1
        key = ("copy", wa)
        g = self._group(
            key,
            "copy_hash_kernel",
            {"BLOCK_R": block_r, "BLOCK_W": block_w, "WA": wa, "num_warps": warps},
            (self._base(torch.int32), self._base(torch.int32)),
        )
        n_c = -(-row_words // block_w)
        g.rows.append([v if i == 2 else v // wa for i, v in enumerate(fields)] + [n_c])
        g.counts.append(-(-n_rows // block_r) * n_c)
        self._copy_keys.append(key)
        self.copies += 1
        self.regions += 1
        self.nbytes += src.numel() * src.element_size()
        return True

    def add_quantize(
        self, src: torch.Tensor, dst: DestRegion, amax: torch.Tensor | None = None
    ) -> bool:
        """Quantize src into a persistent MXFP8 / block-FP8 / NVFP4 region (amax: src's
        NVFP4 amax bits, when folded already); False when not eligible. NVFP4 regions (whole
        tensors) and large ones take the per-tensor kernels, launched with the rest (in the
        same graph): a large region fills the GPU alone, and that kernel runs faster there."""
        from refitd.formats import triton_kernels

        bad = src.device != self.device or src.dtype not in _SRC_DTYPES or dst.scales is None
        if bad or src.numel() == 0:
            return False
        if dst.storage == NVFP4 and dst.global_scale is not None:
            kernel = triton_kernels.nvfp4_quantize_into
            call = functools.partial(kernel, src, *dst.parts(), amax=amax)
            self._direct.add(NVFP4, src, call)
            ok = True
        elif tuple(src.shape) != tuple(dst.values.shape):
            return False
        elif dst.storage in (MXFP8, FP8_BLOCK) and src.numel() >= self.own_launch_elements:
            kernel = getattr(triton_kernels, f"{dst.storage}_quantize_into")
            call = functools.partial(kernel, src, dst.values, dst.scales, fast=self.fast)
            self._direct.add(dst.storage, src, call)
            ok = True
        elif dst.storage == MXFP8:
            ok = self._add_mxfp8(src, dst.values, dst.scales)
        elif dst.storage == FP8_BLOCK:
            ok = self._add_fp8_block(src, dst.values, dst.scales)
        else:
            return False
        if ok:
            self.regions += 1
            self.nbytes += src.numel() * src.element_size()
        return ok

    def _src_meta(self, src: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
        """(base tensor, elements per 16 bytes, bf16?) of a source dtype."""
        bf16 = src.dtype == torch.bfloat16
        base = self._base(torch.int16 if bf16 else src.dtype)
        return base, 16 // src.element_size(), bf16

    def _add_mxfp8(self, src: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> bool:
        cols = src.shape[-1]
        nb = -(-cols // MXFP8_BLOCK)
        xm, qm, sm = _matrix(src, cols), _matrix(q, cols), _matrix(s, nb)
        if xm is None or qm is None or sm is None or not (xm[0] == qm[0] == sm[0]):
            return False
        base, xa, bf16 = self._src_meta(src)
        x_off = self._off(src, src.element_size())
        q_off = self._off(q, 1)
        s_off = self._off(s, 1)
        aligned = x_off % xa == 0 and xm[1] % xa == 0 and cols % 16 == 0
        aligned = aligned and q_off % 16 == 0 and qm[1] % 16 == 0
        xa, qa = (xa, 16) if aligned else (1, 1)
        block_m, block_c, warps = self.tiles["mxfp8"]
        block_c = max(MXFP8_BLOCK, min(block_c, 1 << max(0, (cols - 1).bit_length())))
        key = ("mxfp8", src.dtype, aligned, block_c)
        meta = {"BLOCK_M": block_m, "BLOCK_C": block_c, "SRC_BF16": bf16, "FAST": self.fast}
        meta |= {"XA": xa, "QA": qa, "num_warps": warps}
        bases = (base, self._base(torch.uint8), self._base(torch.uint8))
        g = self._group(key, "mxfp8_grouped_kernel", meta, bases)
        n_c = -(-cols // block_c)
        row = [x_off // xa, q_off // qa, s_off, xm[0], cols // qa, n_c, xm[1] // xa]
        g.rows.append([*row, qm[1] // qa, sm[1]])
        g.counts.append(-(-xm[0] // block_m) * n_c)
        return True

    def _add_fp8_block(self, src: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> bool:
        x3, q3, s3 = _batched(src), _batched(q), _batched(s)
        if x3 is None or q3 is None or s3 is None:
            return False
        (b, r, c, sxb, sxr), (qb, _, _, sqb, sqr), (sb, tr, tc, ssb, ssr) = x3, q3, s3
        if not (b == qb == sb) or tr != -(-r // FP8_TILE) or tc != -(-c // FP8_TILE):
            return False
        base, xa, bf16 = self._src_meta(src)
        x_off = self._off(src, src.element_size())
        q_off = self._off(q, 1)
        s_off = self._off(s, 4)
        aligned = all(v % xa == 0 for v in (x_off, sxr, sxb)) and all(
            v % 16 == 0 for v in (q_off, sqr, sqb, c)
        )
        xa, qa = (xa, 16) if aligned else (1, 1)
        key = ("fp8_block", src.dtype, aligned)
        sub_r, warps = self.tiles["fp8_block"]
        meta = {"SUB_R": sub_r, "TILE": FP8_TILE, "SRC_BF16": bf16, "FAST": self.fast}
        meta |= {"XA": xa, "QA": qa, "num_warps": warps}
        bases = (base, self._base(torch.uint8), self._base(torch.float32))
        g = self._group(key, "fp8_block_grouped_kernel", meta, bases)
        row = [x_off // xa, q_off // qa, s_off, r, c // qa, tr, tc, sxb // xa, sxr // xa]
        g.rows.append([*row, sqb // qa, sqr // qa, ssb, ssr])
        g.counts.append(b * tr * tc)
        return True

    # ------------------------------------------------------------------ run
    def build(self) -> GroupedLanding:
        """Move the tables to the device (once)."""
        dev = self.device
        for key, g in self._groups.items():
            n = sum(g.counts)
            # the per-program table is built on the device: a region of 1 GiB has 64 Ki
            # programs, which would otherwise be built on the host and copied over
            counts = torch.tensor(g.counts, dtype=torch.int64).to(dev)
            seg_of = torch.repeat_interleave(
                torch.arange(len(g.counts), device=dev), counts, output_size=n
            )
            starts = torch.cumsum(counts, 0) - counts
            local = torch.arange(n, device=dev) - torch.repeat_interleave(
                starts, counts, output_size=n
            )
            g.work = torch.stack([seg_of, local], 1).to(torch.int32)
            g.seg = torch.tensor(g.rows, dtype=torch.int64).to(dev)
            g.prog_seg = seg_of
            g.n_programs = n
            mine = [i for i, k in enumerate(self._copy_keys) if k == key]
            g.order = torch.tensor(mine, dtype=torch.int64).to(dev)
        return self

    def _hash_copies(self, g: _Group, out: torch.Tensor, sums: torch.Tensor) -> None:
        """Per-region checksums of a copy group from its per-program partials."""
        per = torch.zeros((len(g.rows), 2), dtype=torch.int64, device=self.device)
        sums[g.order] = per.index_add_(0, g.prog_seg, out)

    def run(self, hash: bool = False) -> torch.Tensor | None:
        """Land every region (queued on the current stream). With hash, the copies also
        checksum source and landed destination: an int64 (copies, 2) tensor, in add order
        (valid until the next run).

        On CUDA the first run of each mode launches the kernels (compiling them), then
        captures them into a CUDA graph that later runs replay: every address is fixed at
        build, so one replay costs the host microseconds where a Triton launch costs a
        quarter of a millisecond. A capture that fails leaves eager launches in place."""
        entry = self._graphs.get(hash)
        if entry is not None:
            graph, sums = entry
            with torch.cuda.device(self.device):
                graph.replay()
            return sums
        self._direct.tune(self.tuner)
        sums = self._launch(hash)
        if self.graphs and hash not in self._graphs:
            self._capture(hash)
        return sums

    def _capture(self, hash: bool) -> None:
        try:
            with torch.cuda.device(self.device):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    sums = self._launch(hash)
            self._graphs[hash] = (graph, sums)
        except Exception as e:  # e.g. a driver without graph support: stay eager
            self.graphs = False
            self.graph_error = f"{type(e).__name__}: {e}"

    def _launch(self, hash: bool) -> torch.Tensor | None:
        from refitd.formats import _triton_grouped as k

        sums = torch.zeros((self.copies, 2), dtype=torch.int64, device=self.device)
        sums = sums if hash else None
        self._direct.run()
        for g in self._groups.values():
            if g.n_programs == 0:
                continue
            kernel = getattr(k, g.kernel)
            if g.kernel != "copy_hash_kernel":
                kernel[(g.n_programs,)](*g.bases, g.seg, g.work, **g.meta)
                continue
            out = torch.empty((g.n_programs, 2), dtype=torch.int64, device=self.device)
            kernel[(g.n_programs,)](
                *g.bases, g.seg, g.work, out, COPY=True, HASH_SRC=hash, HASH_DST=hash,
                **g.meta,
            )  # fmt: skip
            if sums is not None:
                self._hash_copies(g, out, sums)
        return sums

    def hash_only(self) -> torch.Tensor:
        """Checksums of the copy regions' sources alone (no copy): int64 (copies,)."""
        from refitd.formats import _triton_grouped as k

        sums = torch.zeros((self.copies, 2), dtype=torch.int64, device=self.device)
        for g in self._groups.values():
            if g.kernel != "copy_hash_kernel" or g.n_programs == 0:
                continue
            out = torch.zeros((g.n_programs, 2), dtype=torch.int64, device=self.device)
            k.copy_hash_kernel[(g.n_programs,)](
                *g.bases, g.seg, g.work, out, COPY=False, HASH_SRC=True, HASH_DST=False,
                **g.meta,
            )  # fmt: skip
            self._hash_copies(g, out, sums)
        return sums[:, 0]


def _batched(t: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """(batches, rows, cols, batch stride, row stride) of t over its last two dims (a 1-D
    tensor is one row), unit stride along the last dim; None when it does not collapse."""
    if t.dim() == 1:
        t = t.unsqueeze(0)
    r, c = t.shape[-2], t.shape[-1]
    if c > 1 and t.stride(-1) != 1:
        return None
    lead = [(n, s) for n, s in zip(t.shape[:-2], t.stride()[:-2], strict=True) if n != 1]
    for (_, s0), (n1, s1) in itertools.pairwise(lead):
        if s0 != s1 * n1:
            return None
    b = math.prod(n for n, _ in lead)
    sb = lead[-1][1] if lead else 0
    return b, r, c, sb, t.stride(-2)


def word_rows(
    *views: torch.Tensor,
) -> tuple[tuple[int, ...], int, int, tuple[int, ...]] | None:
    """Views of one shape as rows of 32-bit words: (addresses, rows, words per row, row
    strides in words), the same row split for all; None when some view has no such split
    (inner dims not contiguous, rows not whole words, misaligned)."""
    first = views[0]
    if first.numel() == 0:
        return None
    itemsize = first.element_size()
    squeezed = [_squeeze(v) for v in views]
    shape = squeezed[0][0]
    if not shape:
        shape, squeezed = [1], [([1], [1]) for _ in views]
    j = max(_inner_start(s, st) for s, st in squeezed)
    if j >= len(shape):
        return None
    layouts = [_rows_at(s, st, j) for s, st in squeezed]
    if any(lay is None for lay in layouts):
        return None
    rows, row = layouts[0][0], layouts[0][1]  # type: ignore[index]
    if (row * itemsize) % 4:
        return None
    addrs, strides = [], []
    for v, lay in zip(views, layouts, strict=True):
        stride_bytes = lay[2] * itemsize  # type: ignore[index]
        if v.data_ptr() % 4 or stride_bytes % 4:
            return None
        addrs.append(v.data_ptr())
        strides.append(stride_bytes // 4)
    return tuple(addrs), rows, row * itemsize // 4, tuple(strides)


def hash_landing(regions: list[torch.Tensor]) -> GroupedLanding | None:
    """A built landing whose `hash_only()` gives the checksums (refitd.executor.checksums)
    of CUDA regions in one launch; None when triton is missing or a region is not rows of
    whole 32-bit words. Its tables fix the regions' addresses and layouts: reuse it for
    the same views only (building costs blocking host-to-device copies)."""
    if not regions or not available(regions[0].device):
        return None
    g = GroupedLanding(regions[0].device)
    for r in regions:
        if not g.add_copy(r, r):
            return None
    return g.build()
