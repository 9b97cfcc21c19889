"""Refits into quantized persistent buffers through the executor over real Gloo (ranks in
threads of this process): NVFP4 storage landed whole by the receiver (raw wire) or the
sender (nvfp4 wire) and by a local copy, block-FP8 storage fed by raw copies that a small
bucket cuts, raw segments arriving whole with their amax side words, local NVFP4 copies from a
snapshot captured with its amax, and verified
sender-quantized segments larger than a chunk. Every destination
is compared bit for bit with the quantization of its shard of the global tensor (Megatron
row split)."""

from __future__ import annotations

import pytest
import torch
from _executors import run_verified

from refitd import formats
from refitd.executor.chunks import CopyInfo, chunk_messages
from refitd.executor.run import DirectResolver, Executor, ExecutorConfig
from refitd.executor.segments import ResolvedTensor
from refitd.plan.layout import Box, TensorSpec
from refitd.plan.planner import Plan, PlanConfig, build_plan
from refitd.plan.wire import FP8_BLOCK, MXFP8, NVFP4, PLAIN, nvfp4_data_shape, nvfp4_scale_shape
from refitd.server.refit.checksums import compare_checksums
from refitd.transfer.snapshot import SnapshotResolver, prepare_snapshot


def _spec(pool, rank, slot, name, gshape, rows, storage=PLAIN, dtype="bfloat16") -> TensorSpec:
    """A shard of rows [rows[0], rows[1]) of a global tensor."""
    gshape = tuple(gshape)
    local = (rows[1] - rows[0], *gshape[1:])
    box = Box((rows[0], *[0] * (len(gshape) - 1)), local, (0,) * len(gshape))
    return TensorSpec("m", pool, rank, slot, name, name, gshape, dtype, local, (box,), storage)


def _checksums_agree(plan: Plan, reports: dict) -> None:
    sent, landed = {}, {}
    for slot, rep in reports.items():
        sent.update({i: (slot, h) for i, h in rep.checksums["send"].items()})
        landed.update({i: (slot, h) for i, h in rep.checksums["recv"].items()})
    assert sent and compare_checksums(plan, sent, landed) is None


@pytest.mark.parametrize("sender_quantization", [False, True])
def test_nvfp4_storage_lands_whole_shards_bit_for_bit(sender_quantization: bool) -> None:
    """The trainer (slot 0) holds two whole tensors; inference splits their rows over TP=2
    (slots 0 and 1: rank 0 is collocated, a local copy), in NVFP4 buffers whose addresses
    stay put. A tiny bucket and chunk: the segments travel in several chunks."""
    shapes = {"w": (64, 96), "b": (32, 160)}
    g = torch.Generator().manual_seed(7)
    full = {n: (torch.randn(s, generator=g) * 3).to(torch.bfloat16) for n, s in shapes.items()}
    full["w"][5, 17] = -0.0
    src = [_spec("train", 0, 0, n, s, (0, s[0])) for n, s in shapes.items()]
    half = {n: s[0] // 2 for n, s in shapes.items()}
    dst = [
        _spec("infer", r, r, n, s, (r * half[n], (r + 1) * half[n]), NVFP4)
        for r in (0, 1)
        for n, s in shapes.items()
    ]
    cfg = PlanConfig(bucket_bytes=1024, sender_quantization=sender_quantization)
    plan = build_plan("m", 1, src, dst, cfg)
    wires = {c.wire for p in plan.programs().values() for m in p.sends for c in m.copies}
    assert wires == {"nvfp4" if sender_quantization else "raw"}
    assert any(p.local for p in plan.programs().values())

    resolved = {i: ResolvedTensor(f"train/0/{s.name}", full[s.name]) for i, s in enumerate(src)}
    buffers = {}
    for i, d in enumerate(dst, start=len(src)):
        buffers[i] = (
            torch.full(nvfp4_data_shape(d.local_shape), 0x55, dtype=torch.uint8),
            torch.full(nvfp4_scale_shape(d.local_shape), 0x11, dtype=torch.uint8),
            torch.full((1,), -5.0),
        )
        data, scales, gscale = buffers[i]
        resolved[i] = ResolvedTensor(f"infer/{d.rank}/{d.name}", data, scales, NVFP4, gscale)
    ptrs = {i: [b.data_ptr() for b in bufs] for i, bufs in buffers.items()}
    resolvers = {
        slot: DirectResolver({i: resolved[i] for i in plan.program(slot).tensors})
        for slot in plan.slots()
    }
    reports = run_verified(plan, resolvers, ExecutorConfig(staging_bytes=4 << 10, wire_chunk=512))
    _checksums_agree(plan, reports)
    for i, d in enumerate(dst, start=len(src)):
        lo = d.boxes[0].offset[0]
        want = formats.nvfp4_quantize(full[d.name][lo : lo + d.local_shape[0]])
        for got, expect in zip(buffers[i], want, strict=True):
            assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8)), d
        assert ptrs[i] == [b.data_ptr() for b in buffers[i]]


def test_raw_copies_cut_by_the_bucket_land_in_block_fp8_storage() -> None:
    """A raw copy larger than the bucket is cut at 128-row tiles of its block-FP8
    destination, so the receiver quantizes whole tiles; bytes equal a local quantization."""
    shape = (512, 64)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    src = [_spec("train", 0, 0, "w", shape, (0, 512))]
    dst = [_spec("infer", 0, 1, "w", shape, (0, 512), FP8_BLOCK)]
    plan = build_plan("m", 1, src, dst, PlanConfig(bucket_bytes=20 << 10))  # 160 rows
    assert sum(len(m.copies) for m in plan.program(1).recvs) == 4
    data = torch.zeros(shape, dtype=torch.uint8)
    scales = torch.zeros(formats.fp8_block_quantize(full)[1].shape)
    resolvers = {
        0: DirectResolver({0: ResolvedTensor("train/0/w", full)}),
        1: DirectResolver({1: ResolvedTensor("infer/0/w", data, scales, FP8_BLOCK)}),
    }
    _checksums_agree(plan, run_verified(plan, resolvers, ExecutorConfig(wire_chunk=4096)))
    want_data, want_scales = formats.fp8_block_quantize(full)
    assert torch.equal(data, want_data) and torch.equal(scales, want_scales)


def test_verified_sender_quantized_segments_cut_into_chunks_agree() -> None:
    """An MXFP8 segment with alignment padding between its parts, larger than a chunk: the
    sender encodes it once per chunk, and every encoding must carry the same bytes (the
    padding included) for the checksums of both ends to agree."""
    shape = (7, 100)  # 700 value bytes and 28 scale bytes: both parts padded
    full = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    src = [_spec("train", 0, 0, "w", shape, (0, 7))]
    dst = [_spec("infer", 0, 1, "w", shape, (0, 7), MXFP8)]
    plan = build_plan("m", 1, src, dst, PlanConfig(sender_quantization=True))
    data = torch.zeros(shape, dtype=torch.uint8)
    scales = torch.zeros(formats.mxfp8_quantize(full)[1].shape, dtype=torch.uint8)
    resolvers = {
        0: DirectResolver({0: ResolvedTensor("train/0/w", full)}),
        1: DirectResolver({1: ResolvedTensor("infer/0/w", data, scales, MXFP8)}),
    }
    for _ in range(3):
        _checksums_agree(plan, run_verified(plan, resolvers, ExecutorConfig(wire_chunk=128)))
    assert all(
        torch.equal(a, b) for a, b in zip((data, scales), formats.mxfp8_quantize(full), strict=True)
    )


@pytest.mark.parametrize("verify", [False, True])
def test_whole_raw_segments_carry_their_amax_into_nvfp4_storage(verify: bool) -> None:
    """Raw segments that arrive whole (one chunk, several NVFP4 tensors: more amax words
    than fit one 16-byte line, and a plain one between them) travel with the amax the
    sender folded as it packed them, and the receiver quantizes them in one read (a
    verified refit folds its own: the words are outside the checksums): NaN, +-Inf, -0.0,
    all-zero, bfloat16 / float16 / float32 sources land bit for bit as a local
    quantization of each tensor."""
    g = torch.Generator().manual_seed(11)
    full = {
        "bf": (torch.randn(24, 48, generator=g) * 5).to(torch.bfloat16),
        "plain": torch.randn(4, 24, generator=g).to(torch.bfloat16),
        "bf_small": (torch.randn(8, 64, generator=g) * 1e-3).to(torch.bfloat16),
        "f16_zero": torch.zeros(16, 32, dtype=torch.float16),
        "f16": (torch.randn(16, 40, generator=g) * 100).to(torch.float16),
        "f32": torch.randn(12, 34, generator=g) * 7,
    }
    full["bf"][3, 5], full["bf"][7, 0], full["bf"][0, 1] = float("nan"), float("inf"), -0.0
    full["f32"][2, 9], full["f32"][11, 33] = float("-inf"), 1e30
    dtype = {n: str(t.dtype).removeprefix("torch.") for n, t in full.items()}
    src = [
        _spec("train", 0, 0, n, t.shape, (0, t.shape[0]), dtype=dtype[n]) for n, t in full.items()
    ]
    storage = {n: PLAIN if n == "plain" else NVFP4 for n in full}
    dst = [
        _spec("infer", 0, 1, n, t.shape, (0, len(t)), storage[n], dtype[n]) for n, t in full.items()
    ]
    plan = build_plan("m", 1, src, dst, PlanConfig())
    config = ExecutorConfig(wire_chunk=64 << 10)
    recv = plan.program(1)
    chunks = chunk_messages(recv.recv, CopyInfo.of(recv, config.direct_min), config.wire_chunk)
    assert [len(ch.amax_rows) for ch in chunks] == [5]  # one chunk, every NVFP4 tensor's word
    resolved = {i: ResolvedTensor(f"train/0/{s.name}", full[s.name]) for i, s in enumerate(src)}
    buffers = {}
    for i, d in enumerate(dst, start=len(src)):
        if d.storage == PLAIN:
            buffers[i] = (torch.zeros(d.local_shape, dtype=torch.bfloat16),)
            resolved[i] = ResolvedTensor(d.name, buffers[i][0])
            continue
        buffers[i] = (
            torch.full(nvfp4_data_shape(d.local_shape), 0x55, dtype=torch.uint8),
            torch.full(nvfp4_scale_shape(d.local_shape), 0x11, dtype=torch.uint8),
            torch.full((1,), -5.0),
        )
        resolved[i] = ResolvedTensor(f"infer/0/{d.name}", *buffers[i][:2], NVFP4, buffers[i][2])
    resolvers = {
        s: DirectResolver({i: resolved[i] for i in plan.program(s).tensors}) for s in (0, 1)
    }
    reports = run_verified(plan, resolvers, config, verify)
    if verify:
        _checksums_agree(plan, reports)
    wire = sum(m.nbytes for m in recv.recvs)
    assert reports[0].sent_bytes == wire + 32  # the five amax words went over the wire
    for i, d in enumerate(dst, start=len(src)):
        want = (full[d.name],) if d.storage == PLAIN else formats.nvfp4_quantize(full[d.name])
        for got, expect in zip(buffers[i], want, strict=True):
            assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8)), d.name


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
def test_snapshot_capture_folds_the_amax_of_sources_read_whole_into_nvfp4(device: str) -> None:
    """Local copies into NVFP4 storage from a snapshot: a source read whole is captured
    with its amax (one read), so its copy quantizes in one read; a source read in row
    halves is not. The trainer overwrites its weights after the capture, and every
    destination holds the captured version bit for bit (NaN, Inf, all-zero, dtypes). On
    CUDA: the capture's copy through the amax kernel and the grouped landing."""
    g = torch.Generator().manual_seed(13)
    full = {
        "bf": (torch.randn(16, 48, generator=g) * 5).to(torch.bfloat16),
        "f16_zero": torch.zeros(8, 32, dtype=torch.float16),
        "f32": torch.randn(8, 34, generator=g) * 7,
        "halves": (torch.randn(16, 32, generator=g)).to(torch.bfloat16),
    }
    full["bf"][3, 5], full["bf"][7, 0] = float("nan"), float("-inf")
    dtype = {n: str(t.dtype).removeprefix("torch.") for n, t in full.items()}
    src = [
        _spec("train", 0, 0, n, t.shape, (0, t.shape[0]), dtype=dtype[n]) for n, t in full.items()
    ]
    dst = [_spec("infer", 0, 0, n, t.shape, (0, len(t)), NVFP4, dtype[n]) for n, t in full.items()]
    dst[-1:] = [_spec("infer", r, 0, "halves", (16, 32), (8 * r, 8 * r + 8), NVFP4) for r in (0, 1)]
    plan = build_plan("m", 1, src, dst, PlanConfig())
    program = plan.program(0)
    live = [t.to(device, copy=True) for t in full.values()]
    resolved = {i: ResolvedTensor(s.name, live[i]) for i, s in enumerate(src)}
    buffers = {}
    for i, d in enumerate(dst, start=len(src)):
        buffers[i] = (
            torch.zeros(nvfp4_data_shape(d.local_shape), dtype=torch.uint8, device=device),
            torch.zeros(nvfp4_scale_shape(d.local_shape), dtype=torch.uint8, device=device),
            torch.zeros(1, device=device),
        )
        resolved[i] = ResolvedTensor(f"{d.name}/{d.rank}", *buffers[i][:2], NVFP4, buffers[i][2])
    base = DirectResolver(resolved)
    snap = prepare_snapshot(program, base, range(len(src)), 1 << 20)
    assert snap.active, snap.fallback
    assert [snap.tensors[i].amax is not None for i in range(len(src))] == [True] * 3 + [False]
    ex = Executor(program, SnapshotResolver(base, snap), None, device=torch.device(device))
    snap.capture()
    for t in live:
        t.fill_(3.0)  # the trainer's next step, after the release
    ex.run(30.0)
    for i, d in enumerate(dst, start=len(src)):
        lo = d.boxes[0].offset[0]
        want = formats.nvfp4_quantize(full[d.name][lo : lo + d.local_shape[0]])
        for got, expect in zip(buffers[i], want, strict=True):
            assert torch.equal(got.cpu().view(torch.uint8), expect.view(torch.uint8)), d.name
    # the copies quantize with the amax the capture folded: other bits, other bytes
    snap.tensors[0].amax.fill_(int(torch.tensor(1.0).view(torch.int32)))
    ex.run(30.0)
    assert not torch.equal(buffers[len(src)][1].cpu(), formats.nvfp4_quantize(full["bf"])[1])
