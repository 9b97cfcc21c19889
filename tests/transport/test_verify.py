"""Checksum verification of landed versions: the hash, the executor over real Gloo (ranks in
threads of this process), and the controller's comparison over real executor checksums."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _executors import run_verified
from _transport_layouts import expected, fill_sources, globals_for, make_model

from refitd.executor.checksums import MASK, A, Checksummer, checksum, combine
from refitd.executor.errors import ExecutionError
from refitd.executor.run import DirectResolver, Executor, ExecutorConfig
from refitd.executor.segments import ResolvedTensor
from refitd.plan.layout import Box, TensorSpec
from refitd.plan.planner import Plan, PlanConfig, build_plan
from refitd.plan.wire import MXFP8, PLAIN, RAW, mxfp8_scale_shape
from refitd.server.planning import ControllerPlan
from refitd.server.refit.checksums import compare_checksums
from refitd.slot_protocol import ExecReport
from refitd.transport.local import LocalTransport


def reference(t: torch.Tensor) -> int:
    """The documented formula, in plain Python integers over NumPy words."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % 4)
    words = np.frombuffer(raw, dtype="<i4").tolist()
    return sum(w * (2 * A * i + 1) for i, w in enumerate(words)) & MASK


def test_checksum_matches_the_documented_formula_across_blocks_and_tails() -> None:
    g = torch.Generator().manual_seed(1)
    for n, dtype in ((1, torch.uint8), (7, torch.bfloat16), (1001, torch.float32), (3, torch.int8)):
        t = (torch.randn(n, generator=g) * 100).to(dtype)
        assert checksum(t) == reference(t), (n, dtype)
        # block decomposition: tiny blocks give the same value as one block
        assert Checksummer(block_words=3)(t) == checksum(t)


def test_checksum_sees_a_flipped_bit_and_swapped_elements() -> None:
    t = torch.randn(4097, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    h = checksum(t)
    assert checksum(t.clone()) == h  # deterministic
    for byte in (0, 1, 4095, 8193):
        for bit in (0, 7):
            flipped = t.clone()
            flipped.view(torch.uint8)[byte] ^= 1 << bit
            assert checksum(flipped) != h, (byte, bit)
    swapped = t.clone()
    swapped[[10, 3000]] = t[[3000, 10]]
    assert not torch.equal(swapped, t)
    assert checksum(swapped) != h
    adjacent = t.clone()
    adjacent[[0, 1]] = t[[1, 0]]  # both halves of one 32-bit word
    assert checksum(adjacent) != h


def test_checksum_of_a_strided_view_equals_its_contiguous_copy() -> None:
    base = torch.randn(12, 10, 6, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    views = [base[2:9, 1:8:2, 3:], base.transpose(0, 2)[1:], base[5, :, 1]]
    for v in views:
        assert not v.is_contiguous()
        assert checksum(v) == checksum(v.contiguous()) == reference(v)
    assert checksum(base[1:, :, 1:]) != checksum(base[:-1, :, 1:])
    assert combine([1, 2]) != combine([2, 1])


# ----------------------------------------------------------------------------- executor
def _tensors(src, dst, globals_):
    tensors = fill_sources(src, globals_)
    tensors += [torch.zeros(d.local_shape, dtype=getattr(torch, d.dtype)) for d in dst]
    return tensors


def _resolvers(plan: Plan, tensors: list[torch.Tensor]) -> dict[int, DirectResolver]:
    out = {}
    for slot in plan.slots():
        p = plan.program(slot)
        out[slot] = DirectResolver(
            {i: ResolvedTensor(plan.tensors[i].name, tensors[i]) for i in p.tensors}
        )
    return out


def _gather(reports: dict[int, ExecReport]) -> tuple[dict, dict]:
    sent, landed = {}, {}
    for slot, rep in reports.items():
        assert rep.checksums is not None
        sent.update({i: (slot, h) for i, h in rep.checksums["send"].items()})
        landed.update({i: (slot, h) for i, h in rep.checksums["recv"].items()})
    return sent, landed


def test_verified_refit_agrees_and_a_stale_sender_checksum_is_named() -> None:
    # a float32 destination (cast on landing) and small chunks (zero-copy + staged paths)
    src, dst = make_model(2, 3, [0, 1], [1, 0, 1], {"qkv": "float32"})
    plan = build_plan("m", 1, src, dst, PlanConfig(1024, allow_dtype_cast=True))
    g1 = globals_for(1)
    tensors = _tensors(src, dst, g1)
    resolvers = _resolvers(plan, tensors)
    sent1, landed1 = _gather(run_verified(plan, resolvers))
    for i, d in enumerate(dst):
        assert torch.equal(tensors[len(src) + i], expected(d, g1)), (d.name, d.rank)
    assert sent1 and sent1.keys() == landed1.keys()
    assert compare_checksums(plan, sent1, landed1) is None

    # new weights: every message's checksum changes with the data, and the controller's
    # comparison of this landing with the previous version's sources names what differs
    g2 = globals_for(2)
    for t, fresh in zip(tensors, fill_sources(src, g2), strict=False):
        t.copy_(fresh)
    sent2, landed2 = _gather(run_verified(plan, resolvers))
    assert compare_checksums(plan, sent2, landed2) is None
    assert all(sent2[i][1] != sent1[i][1] for i in sent1)
    reason = compare_checksums(plan, sent1, landed2)
    assert reason is not None and f"checksum mismatch in {len(sent1)} messages" in reason
    mid = min(sent1)
    program = plan.program(landed2[mid][0])
    (m,) = [m for m in program.recvs if m.id == mid]
    d = plan.tensors[m.copies[0].dst_tensor]
    assert (
        f"message {mid} from slot {m.src_slot} to slot {m.dst_slot}: sent "
        f"{sent1[mid][1]:#018x} != landed {landed2[mid][1]:#018x}"
    ) in reason
    assert f"({d.pool!r}, {d.rank}, {d.name!r})" in reason
    # the controller's view of the plan names the same, from its programs' bytes
    assert compare_checksums(ControllerPlan.of(plan, None), sent1, landed2) == reason
    missing = dict(landed2)
    del missing[mid]
    assert f"message {mid}: no receiver checksum" in str(compare_checksums(plan, sent2, missing))
    n = plan.stats.messages
    assert compare_checksums(plan, {}, {}) == f"checksums of {n} of {n} messages were not reported"


def _aliased_specs(dst_slot: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Tensors a and b, whole on one source rank (slot 0) and one destination rank."""

    def spec(pool: str, name: str, slot: int) -> TensorSpec:
        box = Box((0, 0), (8, 16), (0, 0))
        return TensorSpec("m", pool, 0, slot, name, name, (8, 16), "bfloat16", (8, 16), (box,))

    src = [spec("train", n, 0) for n in ("a", "b")]
    return src, [spec("infer", n, dst_slot) for n in ("a", "b")]


def _aliased(plan: Plan, src: list[TensorSpec]) -> tuple[dict[int, DirectResolver], torch.Tensor]:
    """Sources a = 1.0, b = 2.0; the destinations a and b share one storage (a
    registration bug): whatever lands last in it wins, so a's landed bytes are b's."""
    tensors = [torch.full((8, 16), 1.0 + k, dtype=torch.bfloat16) for k in range(len(src))]
    shared = torch.zeros(8, 16, dtype=torch.bfloat16)
    tensors += [shared, shared]
    return _resolvers(plan, tensors), shared


def test_receiver_readback_catches_a_landing_overwritten_by_an_aliased_destination() -> None:
    src, dst = _aliased_specs(dst_slot=1)
    plan = build_plan("m", 1, src, dst, PlanConfig(1 << 20))
    resolvers, shared = _aliased(plan, src)
    sent, landed = _gather(run_verified(plan, resolvers))
    assert torch.all(shared == 2.0)  # b landed last over a
    (mid,) = sent
    reason = compare_checksums(plan, sent, landed)
    assert reason is not None, "the overwritten landing of a went unnoticed"
    assert f"message {mid} from slot 0 to slot 1" in reason
    assert "('infer', 0, 'a')" in reason and "('infer', 0, 'b')" in reason


def test_local_copy_check_names_the_overwritten_destination() -> None:
    src, dst = _aliased_specs(dst_slot=0)
    plan = build_plan("m", 1, src, dst, PlanConfig(1 << 20))
    (program,) = [plan.program(s) for s in plan.slots()]
    assert program.local and not program.sends
    resolvers, _ = _aliased(plan, src)
    ex = Executor(program, resolvers[0], LocalTransport())
    ex.run(5.0)  # unverified: the torn landing goes through
    with pytest.raises(ExecutionError, match=r"'a' \(pool train, rank 0\) .* -> 'a' \(pool infer"):
        ex.run(5.0, verify=True)


@pytest.mark.parametrize("sender_quantization", [False, True])
def test_quantized_destinations_are_verified_on_their_segments(sender_quantization: bool) -> None:
    """MXFP8 storage: the raw wire (receiver quantizes) or the MXFP8 wire (sender quantizes),
    each segment larger than a chunk (reassembled): checksums agree, bytes match a local
    quantization of the same values."""
    from refitd import formats

    shape = (64, 96)
    box = Box((0, 0), shape, (0, 0))

    def spec(pool: str, slot: int, storage: str) -> TensorSpec:
        return TensorSpec(
            "m", pool, 0, slot, "w", "w", shape, "bfloat16", shape, (box,), storage=storage
        )

    src, dst = [spec("train", 0, PLAIN)], [spec("infer", 1, MXFP8)]
    cfg = PlanConfig(1 << 20, sender_quantization=sender_quantization)
    plan = build_plan("m", 1, src, dst, cfg)
    assert {c.wire for m in plan.program(0).sends for c in m.copies} == (
        {"mxfp8"} if sender_quantization else {RAW}
    )
    values = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    data = torch.zeros(shape, dtype=torch.uint8)
    scales = torch.zeros(mxfp8_scale_shape(shape), dtype=torch.uint8)
    resolvers = {
        0: DirectResolver({0: ResolvedTensor("train/0/w", values)}),
        1: DirectResolver({1: ResolvedTensor("infer/0/w", data, scales, MXFP8)}),
    }
    config = ExecutorConfig(staging_bytes=8 << 10, wire_chunk=1024)
    sent, landed = _gather(run_verified(plan, resolvers, config))
    assert sent and compare_checksums(plan, sent, landed) is None
    ref_data, ref_scales = torch.zeros_like(data), torch.zeros_like(scales)
    region = formats.dest_region(MXFP8, ref_data, ref_scales, (0, 0), shape)
    formats.copy_region(values, region)
    assert torch.equal(data, ref_data) and torch.equal(scales, ref_scales)
