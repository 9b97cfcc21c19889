"""Grouped landing (refitd.formats.grouped): many regions copied, hashed or quantized in one
launch, bit for bit against the per-region torch reference and the CPU checksum.

The region-layout logic runs everywhere. The kernels run on a CUDA device (gpu tests), or
on the CPU in Triton's interpreter when TRITON_INTERPRET=1 is set and triton is installed
(tiny shapes only).
"""

from __future__ import annotations

import os

import pytest
import torch
from _fp8_data import special_tensor

from refitd.executor.checksums import MASK, Checksummer, checksum
from refitd.formats import (
    dest_region,
    fp8_block_quantize,
    grouped,
    mxfp8_quantize,
    nvfp4_quantize,
)
from refitd.formats.tuning import CANDIDATES, DirectLaunches, TileTuner
from refitd.plan.wire import FP8_BLOCK, NVFP4

HAS_CUDA = torch.cuda.is_available() and grouped.available(torch.device("cuda"))
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not grouped.triton_installed(),
    reason="set TRITON_INTERPRET=1 with triton installed to run the kernels on CPU",
)


def _bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaN/Inf patterns included) viewed as dtype."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    return raw.view(dtype).reshape(shape)


def test_word_rows_splits_views_into_rows_of_words() -> None:
    big = torch.zeros(40, 300, dtype=torch.bfloat16)
    other = torch.zeros(50, 320, dtype=torch.bfloat16)
    layout = grouped.word_rows(big[3:20, 10:110], other[5:22, 100:200])
    assert layout is not None
    addrs, rows, words, strides = layout
    assert (rows, words, strides) == (17, 50, (150, 160))
    assert addrs == (big[3:20, 10:110].data_ptr(), other[5:22, 100:200].data_ptr())
    # contiguous: one row; a 3-d view whose outer dims collapse: rows of the inner run
    assert grouped.word_rows(big)[1:3] == (1, 40 * 150)  # type: ignore[index]
    cube = torch.zeros(4, 6, 8, dtype=torch.float32)
    assert grouped.word_rows(cube[:, :, :4])[1:] == (24, 4, (8,))  # type: ignore[index]
    # refused: rows of 3 bf16 (not whole words), a transposed view, odd addresses
    assert grouped.word_rows(big[:, 1:4]) is None
    assert grouped.word_rows(big.t()) is None
    assert grouped.word_rows(big.view(-1)[1:101]) is None
    assert grouped.word_rows(torch.zeros(0)) is None


def test_checksums_fall_back_without_cuda() -> None:
    x = torch.arange(100, dtype=torch.int32)
    assert grouped.hash_landing([x]) is None  # CPU tensors: the torch path
    assert Checksummer()(x) == checksum(x)


def _copies(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source view, destination view) pairs: contiguous, strided rows, 1-row, 3-d, rows
    of several tiles."""
    src = _bits((40, 300), torch.bfloat16, 1).to(device)

    def zeros(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    return [
        (_bits((1000,), torch.bfloat16, 2).to(device), zeros(1000)),
        (src[3:20, 10:110], zeros(50, 320)[5:22, 100:200]),
        (src, zeros(60, 300)[10:50]),
        (_bits((7, 33), torch.int32, 3).to(device), zeros(7, 33, dtype=torch.int32)),
        (src[2:3, 4:8], zeros(3, 4)[1:2]),
        (
            _bits((3, 5, 64), torch.float32, 4).to(device)[:, :, 8:40],
            zeros(3, 5, 32, dtype=torch.float32),
        ),
        # strided rows longer than a tile: column tiles past the first, the last one masked
        (
            _bits((6, 1200), torch.int32, 5).to(device)[:, 100:1180],
            zeros(6, 1080, dtype=torch.int32),
        ),
    ]


def _check_copy_and_hash(device: str) -> None:
    dev = torch.device(device)
    g = grouped.GroupedLanding(dev)
    pairs = []
    for s, d in _copies(device):
        assert g.add_copy(s, d), tuple(s.shape)
        pairs.append((s, d))
    g.build()
    for rnd in range(3):  # new source bytes each time: on CUDA runs 2, 3 replay a graph
        for i, (s, d) in enumerate(pairs):
            s.copy_(_bits(tuple(s.shape), s.dtype, seed=100 * rnd + i).to(device))
            d.fill_(rnd + 1)
        sums = g.run(hash=True)
        assert sums is not None
        for i, (s, d) in enumerate(pairs):
            assert torch.equal(s.view(torch.uint8), d.view(torch.uint8)), (rnd, i)
            want = checksum(s.cpu())
            src_sum, dst_sum = (int(v) & MASK for v in sums[i].tolist())
            assert src_sum == want and dst_sum == want, (rnd, i, hex(src_sum), hex(want))
    if dev.type == "cuda":
        assert g.graph_error is None and True in g._graphs
    h = grouped.GroupedLanding(dev)
    for s, _ in pairs:
        assert h.add_copy(s, s)
    only = h.build().hash_only().tolist()
    assert [v & MASK for v in only] == [checksum(s.cpu()) for s, _ in pairs]


QUANT_CASES = [
    ("mxfp8", (64, 200), (0, 0), (64, 200)),
    ("mxfp8", (64, 256), (16, 64), (20, 128)),
    ("mxfp8", (3, 5, 100), (1, 0, 0), (2, 5, 100)),
    ("fp8_block", (300, 260), (128, 0), (172, 260)),
    ("fp8_block", (256, 384), (0, 128), (256, 128)),
    ("fp8_block", (2, 130, 129), (0, 0, 0), (2, 130, 129)),
    ("nvfp4", (24, 96), (0, 0), (24, 96)),  # nvfp4 regions are whole tensors
]
QUANTIZERS = {"mxfp8": mxfp8_quantize, "fp8_block": fp8_block_quantize, "nvfp4": nvfp4_quantize}


def _check_quantize(
    device: str, fast: bool, dtypes: tuple[torch.dtype, ...], own_launch: int | None = None
) -> None:
    dev = torch.device(device)
    g = grouped.GroupedLanding(dev, fast=fast, tune=own_launch is not None)
    if own_launch is not None:  # regions from this size take the per-tensor kernel, and
        g.own_launch_elements = own_launch  # the first run times two tiles for each
        g.tuner = TileTuner(candidates={k: v[:2] for k, v in CANDIDATES.items()})
    landed = []
    for n, (fmt, shape, off, size) in enumerate(QUANT_CASES):
        for dtype in dtypes:
            block = {"mxfp8": 32, "fp8_block": 128, "nvfp4": 16}[fmt]
            full = special_tensor(shape, dtype, seed=n, block=block).to(dev)
            # persistent buffers of the reference's shapes and dtypes, filled with garbage
            bufs = [torch.full_like(b, 7).to(dev) for b in QUANTIZERS[fmt](full.cpu())]
            gscale = bufs[2] if fmt == "nvfp4" else None
            region = dest_region(fmt, bufs[0], bufs[1], off, size, global_scale=gscale)
            src = full[tuple(slice(o, o + k) for o, k in zip(off, size, strict=True))]
            assert g.add_quantize(src, region), (fmt, shape, dtype)
            landed.append((fmt, src, region))
    assert g.regions == len(landed)
    g.build()
    for _ in range(3):  # on CUDA the later runs replay a graph
        for _, _, region in landed:
            region.values.fill_(0xAB)
        g.run()
    if dev.type == "cuda" and g.tuner is not None:  # the per-tensor launches were timed
        assert {(NVFP4, torch.bfloat16), (FP8_BLOCK, torch.bfloat16)} <= {
            k[:2] for k in g.tuner.picks
        }
        assert all(len(r) == 2 for r in g.tuner.timings.values())
    for row in g.chosen:  # what a refit's report shows: the config each shape ran with
        key = (row["kernel"], getattr(torch, row["dtype"]), row["shape"])
        assert row["timed"] == (dev.type == "cuda")
        assert row["config"] == (g.tuner.picks[key] if row["timed"] else CANDIDATES[key[0]][0])
    for fmt, src, region in landed:
        for got, want in zip(region.parts(), QUANTIZERS[fmt](src.cpu()), strict=True):
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), (
                fmt,
                tuple(src.shape),
                src.dtype,
            )


def test_direct_launches_report_the_config_each_shape_runs_with() -> None:
    """Per distinct (kernel, dtype, shape) one row: off CUDA the tuner times nothing and
    every launch runs the default config."""
    d, ran = DirectLaunches(), []
    a, b = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16)
    for x in (a, a.clone(), b):
        d.add("mxfp8", x, lambda **config: ran.append(config))
    d.tune(None)
    assert d.chosen == [] and not d.tuned  # no tuner: nothing chosen, defaults run
    d.tune(TileTuner())
    default = CANDIDATES["mxfp8"][0]
    rows = [(r["kernel"], r["dtype"], r["shape"], r["config"], r["timed"]) for r in d.chosen]
    assert rows == [
        ("mxfp8", "bfloat16", (4, 32), default, False),
        ("mxfp8", "bfloat16", (8, 32), default, False),
    ]
    d.run()
    assert ran == [default] * 3


@interpreter
def test_grouped_kernels_in_interpreter() -> None:
    _check_copy_and_hash("cpu")
    _check_quantize("cpu", fast=False, dtypes=(torch.bfloat16,))
    _check_quantize("cpu", fast=False, dtypes=(torch.bfloat16,), own_launch=20000)


@pytest.mark.gpu
@gpu
def test_grouped_copy_and_checksums_on_gpu() -> None:
    _check_copy_and_hash("cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("own_launch", [None, 20000])
def test_grouped_quantizers_on_gpu(fast: bool, own_launch: int | None) -> None:
    _check_quantize("cuda", fast, (torch.bfloat16, torch.float32, torch.float16), own_launch)


@pytest.mark.gpu
@gpu
def test_gpu_checksum_equals_cpu_checksum() -> None:
    """The Checksummer on CUDA (kernel where the region is rows of words, torch ops
    otherwise) equals the CPU checksum bit for bit."""
    for dtype in (torch.bfloat16, torch.float32, torch.int32, torch.uint8, torch.float16):
        for shape in [(1,), (2,), (3, 2), (33, 64), (129, 257), (3, 5, 100), (2048, 1024)]:
            x = _bits(shape, dtype, seed=shape[-1]).cuda()
            views = [x, x[..., 1:], x.transpose(0, -1)]
            if x.dim() >= 2:
                views.append(x[1:, : max(1, x.shape[-1] // 2)])
            for v in views:
                assert Checksummer()(v) == checksum(v.cpu()), (dtype, tuple(v.shape))
    big = _bits((1 << 22,), torch.int32, 9).cuda()  # crosses the torch path's block size
    assert Checksummer()(big) == Checksummer(block_words=1 << 20)(big) == checksum(big.cpu())


@pytest.mark.gpu
@gpu
def test_checksummer_reuses_kernel_tables_per_view() -> None:
    """One Checksummer over views it has seen before (the kernel tables it keeps per view):
    new bytes in a view, and views that share a start address but not a shape or stride,
    still give the CPU checksum."""
    summer = Checksummer()
    x = _bits((64, 96), torch.int32, 11).cuda()
    views = [x, x[:, :40], x[:40], x[:, :40].t()]
    for rnd in range(2):
        x.copy_(_bits((64, 96), torch.int32, 12 + rnd).cuda())
        for v in views:
            assert summer(v) == checksum(v.cpu()), (rnd, tuple(v.shape), v.stride())
