"""Delta codec: apply(encode(base, new)) onto base == new bit for bit, at every density and
element width, for streams and for every delta-capable wire format through its real
segment encoder and its destination regions; and smaller than dense where few changed.
The compiled codec's bytes, stats and destinations equal the NumPy reference's
(_delta_reference.py) on random data of every width, density and memory layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _delta_reference import (
    apply_stream_reference,
    encode_parts_reference,
    encode_stream_reference,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.formats import decode_segment, dest_region, encode_segment
from refitd.formats.delta import (
    BITMAP,
    DENSE,
    INDEX,
    UNCHANGED,
    DeltaError,
    apply_parts,
    apply_segment_delta,
    apply_stream,
    encode_parts,
    encode_segment_delta,
    encode_stream,
    sampled_changes,
    segment_streams,
)
from refitd.plan.wire import delta_capable, fp8_block_scale_shape, mxfp8_scale_shape, segment_nbytes

DENSITIES = [0.0, 1e-5, 0.04, 0.5, 1.0]
UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def changed_version(base: np.ndarray, density: float, rng: np.random.Generator) -> np.ndarray:
    """base with about `density` of its elements given new random bits (at least one changed
    element when density > 0 so every density exercises a change)."""
    new = base.copy()
    pick = rng.random(base.size) < density
    if density > 0 and not pick.any():
        pick[rng.integers(base.size)] = True
    fresh = rng.integers(0, np.iinfo(base.dtype).max, size=int(pick.sum()), dtype=base.dtype)
    fresh[fresh == base[pick]] ^= 1  # a picked element always changes
    new[pick] = fresh
    return new


@settings(max_examples=40, deadline=None)
@given(
    density=st.sampled_from(DENSITIES),
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(1, 40_000),
    block=st.sampled_from([8, 64, 512, 4096]),
    frame_blocks=st.sampled_from([1, 3, 1024]),
    seed=st.integers(0, 2**32 - 1),
)
def test_stream_round_trip(
    density: float, width: int, n: int, block: int, frame_blocks: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, np.iinfo(UINTS[width]).max, size=n, dtype=UINTS[width])
    new = changed_version(base, density, rng)
    delta, stats = encode_stream(base, new, block=block, frame_blocks=frame_blocks)
    assert stats.changed == int(np.count_nonzero(base != new))
    assert stats.elements == n and stats.nbytes == delta.size
    dst = base.copy()
    applied = apply_stream(delta.tobytes(), dst)
    assert np.array_equal(dst, new)
    assert applied.changed == stats.changed and applied.blocks == stats.blocks
    # smaller than dense at low density, where frames amortise their headers (a frame of one
    # 8-element block costs more than its elements)
    if stats.density <= 0.04 and n * width >= 64 * 1024 and block * frame_blocks >= 4096:
        assert delta.size < n * width


@settings(max_examples=20, deadline=None)
@given(density=st.sampled_from(DENSITIES), seed=st.integers(0, 2**32 - 1))
def test_large_stream_sizes(density: float, seed: int) -> None:
    """At 4 KiB-element blocks over 1 M BF16 elements the delta is much smaller than dense at
    low density and never more than 0.1 % above it."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**16, size=1 << 20, dtype=np.uint16)
    new = changed_version(base, density, rng)
    delta, stats = encode_stream(base, new)
    dst = base.copy()
    apply_stream(delta, dst)
    assert np.array_equal(dst, new)
    assert delta.size <= stats.dense_nbytes * 1.001
    limits = {0.0: 0.001, 1e-5: 0.002, 0.04: 0.2}
    if density in limits:
        assert delta.size < stats.dense_nbytes * limits[density]


def test_block_kinds_follow_cost() -> None:
    """An unchanged block sends nothing, a sparse one indices, a half-changed one a bitmap, a
    fully changed one every element."""
    block = 4096
    base = np.zeros(4 * block, dtype=np.uint16)
    new = base.copy()
    new[block + 5] = 1  # index
    new[2 * block : 2 * block + block // 2] = 2  # bitmap
    new[3 * block :] = 3  # dense
    delta, stats = encode_stream(base, new, block=block)
    assert stats.blocks[UNCHANGED] == stats.blocks[INDEX] == 1
    assert stats.blocks[BITMAP] == stats.blocks[DENSE] == 1
    dst = base.copy()
    apply_stream(delta, dst)
    assert np.array_equal(dst, new)


def test_float_bit_patterns_are_changes() -> None:
    """-0.0 vs 0.0 and two NaNs with different payloads differ; equal NaNs do not."""
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0, float("nan")], dtype=torch.float32)
    new = base.clone()
    new[0] = -0.0
    new.view(torch.int32)[2] = 0x7FC00001  # another NaN payload
    delta, stats = encode_stream(base, new, block=8)
    assert stats.changed == 2
    dst = base.clone()
    apply_stream(delta, dst)
    assert torch.equal(dst.view(torch.int32), new.view(torch.int32))


def test_strided_destination_in_place() -> None:
    """A delta lands in a region view of a larger tensor; nothing outside it is written."""
    base = torch.randn(64, 300).to(torch.bfloat16)
    new = base.clone()
    new[::3, ::7] += 1
    big = torch.full((64, 600), 5.0, dtype=torch.bfloat16)
    big[:, 100:400] = base
    delta, _ = encode_stream(base, new, block=64)
    apply_stream(delta, big[:, 100:400])
    assert torch.equal(big[:, 100:400].view(torch.int16), new.view(torch.int16))
    assert bool((big[:, :100] == 5).all() and (big[:, 400:] == 5).all())


def test_bad_deltas_fail_clearly() -> None:
    base = np.arange(10_000, dtype=np.uint16)
    new = base.copy()
    new[::50] += 1
    delta, _ = encode_stream(base, new)
    with pytest.raises(DeltaError, match=r"layer\.w.*truncated"):
        apply_stream(delta[:-16], base.copy(), name="layer.w")
    with pytest.raises(DeltaError, match="cannot land in 9999"):
        apply_stream(delta, base[:-1].copy())
    with pytest.raises(DeltaError, match="cannot land"):
        apply_stream(delta, base.astype(np.uint32))
    bad = delta.copy()
    bad[:4] = 0
    with pytest.raises(DeltaError, match="bad magic"):
        apply_stream(bad, base.copy())
    bad = delta.copy()
    bad[24 + 16] = 9  # first block kind
    with pytest.raises(DeltaError, match="unknown block kind"):
        apply_stream(bad, base.copy())
    parts, _ = encode_parts([base], [new])
    with pytest.raises(DeltaError, match="1 parts for 2"):
        apply_parts(parts, [base.copy(), base.copy()])


def quantized(storage: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Persistent quantized buffers as an engine holds them (garbage-filled)."""
    data = torch.full(shape, 0x55, dtype=torch.uint8)
    if storage == "mxfp8":
        return data, torch.full(mxfp8_scale_shape(shape), 0x11, dtype=torch.uint8)
    return data, torch.full(fp8_block_scale_shape(shape), -3.0, dtype=torch.float32)


WIRES = [
    ("raw", "bfloat16"),
    ("raw", "float16"),
    ("raw", "float32"),
    ("mxfp8", "bfloat16"),
    ("fp8_block", "bfloat16"),
]


@settings(max_examples=15, deadline=None)
@given(
    wire_dtype=st.sampled_from(WIRES),
    density=st.sampled_from(DENSITIES),
    seed=st.integers(0, 2**31 - 1),
)
def test_five_successive_segment_deltas(
    wire_dtype: tuple[str, str], density: float, seed: int
) -> None:
    """Five versions in a row, each sent as the delta of its wire segment against the
    previous one and applied into a region of the destination's persistent buffers, equal
    the destination a dense send of the last version produces, bit for bit."""
    wire, src_dtype = wire_dtype
    shape, full, off = (256, 384), (384, 512), (128, 128)
    storage = {"raw": "plain", "mxfp8": "mxfp8", "fp8_block": "fp8_block"}[wire]
    dtype = getattr(torch, src_dtype)
    assert delta_capable(wire, src_dtype, storage, src_dtype)
    g = torch.Generator().manual_seed(seed)
    live = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    nbytes = segment_nbytes(wire, shape, src_dtype)

    def segment(x: torch.Tensor) -> torch.Tensor:
        seg = torch.zeros(nbytes, dtype=torch.uint8)
        encode_segment(wire, x, seg)
        return seg

    if storage == "plain":
        values, scales = torch.full(full, 7.0, dtype=dtype), None
    else:
        values, scales = quantized(storage, full)
    region = dest_region(storage, values, scales, off, shape, name="w")
    want_values, want_scales = values.clone(), None if scales is None else scales.clone()
    want = dest_region(storage, want_values, want_scales, off, shape)
    base_seg = segment(live)
    decode_segment(wire, base_seg, shape, src_dtype, region)  # version 0 lands dense
    for _ in range(5):
        pick = torch.rand(shape, generator=g) < density
        live = torch.where(pick, (torch.randn(shape, generator=g) * 0.02).to(dtype), live)
        live_seg = segment(live)
        delta, stats = encode_segment_delta(wire, shape, src_dtype, base_seg, live_seg)
        want_delta = encode_parts_reference(
            segment_streams(wire, shape, src_dtype, base_seg),
            segment_streams(wire, shape, src_dtype, live_seg),
        )
        assert np.array_equal(delta, want_delta)  # the NumPy reference's bytes
        assert apply_segment_delta(delta, region, name="w").changed == stats.changed
        base_seg = live_seg
        if density <= 0.04:
            assert delta.size < nbytes
    decode_segment(wire, base_seg, shape, src_dtype, want)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    if scales is not None:
        assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))


def test_converting_destinations_are_not_delta_capable() -> None:
    assert not delta_capable("raw", "bfloat16", "plain", "float32")  # cast on landing
    assert not delta_capable("raw", "bfloat16", "mxfp8", "bfloat16")  # quantize on landing
    assert not delta_capable("mxfp8", "bfloat16", "plain", "bfloat16")  # dequantize on landing
    assert delta_capable("fp8_block", "bfloat16", "fp8_block", "bfloat16")


def test_sampled_changes_counts_every_strided_row_exactly() -> None:
    """The estimate counts exactly the changed bit patterns of rows 0, k, 2k ... of each
    part (a torch BF16 view and a NumPy FP32 part), a -0.0 for +0.0 included."""
    rng = np.random.default_rng(7)
    base16 = rng.integers(0, 2**16, size=(37, 64), dtype=np.uint16)
    new16 = changed_version(base16.reshape(-1), 0.3, rng).reshape(37, 64)
    base32 = np.zeros(50, np.float32)
    new32 = base32.copy()
    new32[::5] = -0.0
    tb = torch.from_numpy(base16.view(np.int16)).view(torch.bfloat16)
    tn = torch.from_numpy(new16.view(np.int16)).view(torch.bfloat16)
    e, c = sampled_changes([tb, base32], [tn, new32], 4)
    want = int((base16[::4] != new16[::4]).sum()) + int(
        (base32[::4].view(np.uint32) != new32[::4].view(np.uint32)).sum()
    )
    assert e == base16[::4].size + base32[::4].size
    assert c == want and c > 0
    assert sampled_changes([base32], [base32.copy()], 1) == (50, 0)
    with pytest.raises(DeltaError, match="base shape"):
        sampled_changes([base32], [base32[:10]], 2)
    with pytest.raises(ValueError, match="stride"):
        sampled_changes([base32], [base32], 0)


LAYOUTS = ["contiguous", "block", "reversed", "transposed", "block3d"]


def laid_out(values: np.ndarray, shape: tuple[int, int, int], layout: str) -> np.ndarray:
    """A view holding `values` (flat) in row-major order, in memory laid out as named: the
    array itself; a 2-D block of a wider matrix (rows of any length, so 64-element words
    straddle rows); rows in reverse memory order (negative stride); column-major (element
    step > 1); a 3-D block of a larger 3-D array (not collapsible to rows)."""
    a, r, w = shape
    x = values.reshape(a * r, w)
    if layout == "contiguous":
        return values
    if layout == "block":
        big = np.zeros((a * r, w + 13), dtype=values.dtype)
        big[:, 5 : 5 + w] = x
        return big[:, 5 : 5 + w]
    if layout == "reversed":
        return x[::-1].copy()[::-1]
    if layout == "transposed":
        return np.asfortranarray(x)
    big = np.zeros((a + 1, r + 2, w + 3), dtype=values.dtype)
    big[1:, 1 : r + 1, 2 : w + 2] = values.reshape(a, r, w)
    return big[1:, 1 : r + 1, 2 : w + 2]


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 120), st.integers(1, 300)),
    density=st.sampled_from([0.0, 1e-5, 0.04, 0.3, 0.6, 1.0]),
    block=st.sampled_from([8, 64, 512, 4096]),
    frame_blocks=st.sampled_from([1, 3, 1024]),
    layouts=st.tuples(*[st.sampled_from(LAYOUTS)] * 3),
    threads=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_compiled_codec_equals_reference(
    width: int,
    shape: tuple[int, int, int],
    density: float,
    block: int,
    frame_blocks: int,
    layouts: tuple[str, str, str],
    threads: int,
    seed: int,
) -> None:
    """Base, live and destination each in any memory layout, frames encoded and applied by
    one thread or by several: the delta's bytes and stats are the NumPy reference's, and
    applying it writes exactly live into the destination's elements and nothing around them."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    base = rng.integers(0, np.iinfo(UINTS[width]).max, size=n, dtype=UINTS[width])
    new = changed_version(base, density, rng)
    b, lv = laid_out(base, shape, layouts[0]), laid_out(new, shape, layouts[1])
    delta, stats = encode_stream(b, lv, block=block, frame_blocks=frame_blocks, threads=threads)
    want, want_stats = encode_stream_reference(b, lv, block=block, frame_blocks=frame_blocks)
    assert np.array_equal(delta, want)
    assert stats == want_stats
    a, r, w = shape
    guard = np.full((a + 1, r + 2, w + 3), 0x5A, dtype=UINTS[width])
    inner = guard[1:, 1 : r + 1, 2 : w + 2]
    inner[...] = base.reshape(a, r, w)
    dst = inner if layouts[2] == "block3d" else laid_out(base.copy(), shape, layouts[2])
    applied = apply_stream(delta, dst, threads=threads)
    assert np.array_equal(dst.reshape(-1), new)
    assert applied == apply_stream_reference(want, laid_out(base.copy(), shape, layouts[2]))
    inner[...] = 0x5A
    assert (guard == 0x5A).all()  # nothing written around the destination


@pytest.mark.parametrize("density", [0.006, 0.04, 0.3])
def test_compiled_codec_equals_reference_over_frames(density: float) -> None:
    """Several default-sized frames of BF16 bit patterns, the live side a column block of a
    wider matrix as a resharding sender reads it: same bytes as the reference."""
    rng = np.random.default_rng(int(density * 1000))
    base = rng.integers(0, 2**16, size=(1200, 2048), dtype=np.uint16)
    new = changed_version(base.reshape(-1), density, rng).reshape(base.shape)
    wide = np.zeros((1200, 4096), dtype=np.uint16)
    wide[:, 2048:] = new
    delta, stats = encode_stream(base, wide[:, 2048:])
    want, want_stats = encode_stream_reference(base, wide[:, 2048:])
    assert np.array_equal(delta, want) and stats == want_stats
    dst = base.copy()
    apply_stream(delta, dst)
    assert np.array_equal(dst, new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float_specials_equal_reference(dtype: torch.dtype) -> None:
    """NaNs of other payloads, -0.0 for +0.0 and infinities are changes, encoded as the
    reference encodes them and reproduced exactly."""
    ints = {2: torch.int16, 4: torch.int32}[torch.tensor([], dtype=dtype).element_size()]
    base = torch.randn(3, 1000).to(dtype)
    base[0, :5] = torch.tensor([0.0, float("nan"), float("inf"), 1.0, float("nan")])
    new = base.clone()
    new[0, 0] = -0.0
    new.view(ints)[0, 1] += 1  # another NaN payload
    new[0, 2] = float("-inf")
    new[1, ::17] += 1
    delta, _ = encode_stream(base, new, block=512)
    want, _ = encode_stream_reference(base, new, block=512)
    assert np.array_equal(delta, want)
    dst = base.clone()
    apply_stream(delta, dst)
    assert torch.equal(dst.view(ints), new.view(ints))


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    truncate=st.integers(0, 64),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32 - 1),
)
def test_malformed_delta_never_writes_outside(
    cuts: list[tuple[int, int]], truncate: int, threads: int, seed: int
) -> None:
    """A delta with bytes changed or cut off either fails as a DeltaError or, where it is
    still well formed, lands as the reference lands it (by one thread or several); nothing
    around the destination is ever written."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**16, size=(40, 300), dtype=np.uint16)
    new = changed_version(base.reshape(-1), 0.2, rng).reshape(base.shape)
    delta, _ = encode_stream(base, new, block=512, frame_blocks=3)
    bad = delta[: delta.size - truncate].copy()
    for at, value in cuts:
        bad[at % bad.size] = value
    guard = np.full((42, 310), 7, dtype=np.uint16)
    guard[1:41, 5:305] = base
    try:
        apply_stream(bad, guard[1:41, 5:305], threads=threads)
    except DeltaError:
        return
    want = base.copy()
    apply_stream_reference(bad, want)
    assert np.array_equal(guard[1:41, 5:305], want)
    guard[1:41, 5:305] = 7
    assert (guard == 7).all()


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3])
def test_nvfp4_segment_deltas_land_all_three_parts(density: float) -> None:
    """NVFP4 segments (packed values, scale bytes, global scale) as deltas into the whole
    persistent buffers equal a dense landing of the last version, bit for bit."""
    shape = (64, 96)
    g = torch.Generator().manual_seed(int(density * 100))
    live = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    nbytes = segment_nbytes("nvfp4", shape, "bfloat16")

    def segment(x: torch.Tensor) -> torch.Tensor:
        seg = torch.zeros(nbytes, dtype=torch.uint8)
        encode_segment("nvfp4", x, seg)
        return seg

    def buffers() -> list[torch.Tensor]:
        return [
            torch.full((64, 48), 0x55, dtype=torch.uint8),
            torch.full((64, 6), 0x11, dtype=torch.uint8),
            torch.full((1,), -3.0),
        ]

    got, want = buffers(), buffers()
    region = dest_region("nvfp4", got[0], got[1], (0, 0), shape, global_scale=got[2])
    assert delta_capable("nvfp4", "bfloat16", "nvfp4", "bfloat16")
    base_seg = segment(live)
    decode_segment("nvfp4", base_seg, shape, "bfloat16", region)
    for step in range(5):
        pick = torch.rand(shape, generator=g) < density
        live = torch.where(pick, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16), live)
        if step == 2:
            live[0, 0] = 1.0  # a new amax: the global scale changes too
        live_seg = segment(live)
        delta, stats = encode_segment_delta("nvfp4", shape, "bfloat16", base_seg, live_seg)
        want_delta = encode_parts_reference(
            segment_streams("nvfp4", shape, "bfloat16", base_seg),
            segment_streams("nvfp4", shape, "bfloat16", live_seg),
        )
        assert np.array_equal(delta, want_delta)  # the NumPy reference's bytes
        assert apply_segment_delta(delta, region, name="w").changed == stats.changed
        base_seg = live_seg
    decode_segment(
        "nvfp4", base_seg, shape, "bfloat16",
        dest_region("nvfp4", want[0], want[1], (0, 0), shape, global_scale=want[2]),
    )  # fmt: skip
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(got, want, strict=True)
    )
