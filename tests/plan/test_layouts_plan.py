"""Randomised layouts, planned and executed in memory, compared bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.plan.errors import PlanError
from refitd.plan.layout import Box
from refitd.plan.layouts import (
    Replicate,
    Shard,
    chunk_layout,
    dtensor_layout,
    make_spec,
    megatron_layout,
    torch_chunk_bounds,
)
from refitd.plan.names import (
    NameMap,
    canonical_name,
    rename,
    source_boxes,
    split_fused_qkv,
    split_gated_fc1,
)
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import decode_program, encode_program

from .oracle import run_and_check

FEW = settings(max_examples=12, deadline=None)


def mspec(pool, rank, slot, name, shape, dtype="float32", canonical=None, **kw):
    lay = megatron_layout(shape, label=name, **kw)
    return make_spec(
        model="m",
        pool=pool,
        rank=rank,
        slot=slot,
        name=name,
        canonical=canonical,
        global_shape=shape,
        dtype=dtype,
        layout=lay,
    )


def tp_side(pool, tp, dp, stride, shape, dim, slot_base, name="w", sizes=None):
    return [
        mspec(
            pool,
            d * tp + t,
            slot_base + d * tp + t,
            name,
            shape,
            tp_rank=t,
            tp_size=tp,
            partition_dim=dim,
            partition_stride=stride,
            partition_sizes=sizes,
        )
        for d in range(dp)
        for t in range(tp)
    ]


@FEW
@given(
    tp_s=st.sampled_from([1, 2, 4]),
    tp_d=st.sampled_from([1, 2, 3]),
    st_s=st.sampled_from([1, 2, 3]),
    st_d=st.sampled_from([1, 2, 3]),
    dim=st.sampled_from([0, 1]),
    dp_s=st.sampled_from([1, 2]),
    dp_d=st.sampled_from([1, 3]),
    bucket=st.sampled_from([64, 1 << 20]),
)
def test_tp_strides_replicas(tp_s, tp_d, st_s, st_d, dim, dp_s, dp_d, bucket):
    n = 72  # divisible by every tp*stride used
    shape = (n, 10) if dim == 0 else (6, n)
    src = tp_side("train", tp_s, dp_s, st_s, shape, dim, 0)
    dst = tp_side("inf", tp_d, dp_d, st_d, shape, dim, 100)
    plan = run_and_check(src, dst, PlanConfig(bucket_bytes=bucket))
    assert plan.stats.total_bytes >= 4 * n * shape[1 - dim] * dp_d


def test_partition_sizes_and_collocated():
    shape = (24, 4)
    sizes = [8, 4, 12]
    src = tp_side("train", 4, 1, 1, shape, 0, 0, sizes=sizes)
    dst = tp_side("inf", 2, 2, 1, shape, 0, 0, sizes=sizes)  # collocated: same slots
    plan = run_and_check(src, dst)
    assert plan.stats.local_copies > 0 and plan.stats.local_bytes > 0


def test_pp_change_and_tied_embedding():
    h, v, layers = 8, 16, 4
    src, dst = [], []
    for stage in range(2):  # PP 2: layers 0-1 on stage 0, 2-3 on stage 1
        for local in range(2):
            g = stage * 2 + local
            name = f"decoder.layers.{local}.mlp.linear_fc2.weight"
            canon = canonical_name(name, layer_offset=stage * 2)
            assert canon == f"decoder.layers.{g}.mlp.linear_fc2.weight"
            src.append(mspec("train", stage, stage, name, (h, h), canonical=canon))
    src.append(mspec("train", 0, 0, "embedding.word_embeddings.weight", (v, h)))
    for g in range(layers):
        name = f"decoder.layers.{g}.mlp.linear_fc2.weight"
        dst += [
            mspec("inf", r, 10 + r, name, (h, h), tp_rank=r, tp_size=2, partition_dim=1)
            for r in range(2)
        ]
    dst += [
        mspec(
            "inf", r, 10 + r, "output_layer.weight", (v, h), tp_rank=r, tp_size=2, partition_dim=0
        )
        for r in range(2)
    ]
    run_and_check(
        src,
        dst,
        globals_=lambda f: {"output_layer.weight": f["embedding.word_embeddings.weight"]},
    )


@FEW
@given(
    ep_s=st.sampled_from([8, 16]),
    etp_s=st.sampled_from([1, 2]),
    etp_d=st.sampled_from([1, 2]),
    grouped=st.booleans(),
)
def test_experts(ep_s, etp_s, etp_d, grouped):
    ep_d = 24 // ep_s  # 8 <-> 16 would need 16 experts; use 16 experts
    experts = 16
    ep_d = 16 if ep_s == 8 else 8
    shape = (4, 6)
    src, dst = [], []
    for side, ep, etp, out, base in (
        ("train", ep_s, etp_s, src, 0),
        ("inf", ep_d, etp_d, dst, 100),
    ):
        local = experts // ep
        for e in range(ep):
            for t in range(etp):
                rank = e * etp + t
                if grouped:
                    out.append(
                        mspec(
                            side,
                            rank,
                            base + rank,
                            "experts.weight",
                            (experts, *shape),
                            expert_dim=0,
                            ep_rank=e,
                            ep_size=ep,
                            tp_rank=t,
                            tp_size=etp,
                            partition_dim=1,
                            partition_stride=2,
                        )
                    )
                    continue
                for k in range(local):
                    name = f"decoder.layers.0.mlp.experts.linear_fc1.weight{k}"
                    out.append(
                        mspec(
                            side,
                            rank,
                            base + rank,
                            name,
                            shape,
                            canonical=canonical_name(name, expert_offset=e * local),
                            tp_rank=t,
                            tp_size=etp,
                            partition_dim=0,
                            partition_stride=2,
                        )
                    )
    run_and_check(src, dst)


@FEW
@given(
    n0=st.integers(1, 13),
    n1=st.integers(1, 9),
    mesh_s=st.sampled_from([(2, 3), (3, 1), (4, 2)]),
    pl_s=st.sampled_from(["00", "01", "0R", "R1", "11"]),
    mesh_d=st.sampled_from([(2, 2), (5, 1)]),
    pl_d=st.sampled_from(["00", "10", "R0", "RR", "0R"]),
    relay=st.booleans(),
)
def test_dtensor_uneven_two_dims(n0, n1, mesh_s, pl_s, mesh_d, pl_d, relay):
    shape = (n0, n1)

    def side(pool, mesh, code, base):
        pls = [Replicate() if c == "R" else Shard(int(c)) for c in code]
        out = []
        for a in range(mesh[0]):
            for b in range(mesh[1]):
                r = a * mesh[1] + b
                # torch.chunk leaves trailing ranks empty: they register with no boxes
                lay = dtensor_layout(shape, mesh, (a, b), pls, label="w")
                out.append(
                    make_spec(
                        model="m",
                        pool=pool,
                        rank=r,
                        slot=base + r,
                        name="w",
                        global_shape=shape,
                        dtype="float32",
                        layout=lay,
                    )
                )
        return out

    run_and_check(
        side("train", mesh_s, pl_s, 0), side("inf", mesh_d, pl_d, 50), PlanConfig(relay=relay)
    )


def dspec(pool, rank, slot, name, shape, mesh, placements):
    return make_spec(
        model="m",
        pool=pool,
        rank=rank,
        slot=slot,
        name=name,
        global_shape=shape,
        dtype="float32",
        layout=dtensor_layout(shape, mesh, (rank,), placements, label=name),
    )


def test_empty_shards_plan_and_move_nothing():
    """[3, 4] Shard(0) over 4 ranks (1, 1, 1, 0 rows) and a [2] bias (1, 1, 0, 0) into an
    unsharded pool, Shard(1) over 3 (2, 2, 0 columns) and Shard(0) over 5 (ranks 3 and 4
    hold nothing and share slot 33 with nothing else)."""
    tensors = {"e": (3, 4), "bias": (2,)}
    src = [dspec("t", r, r, n, s, (4,), [Shard(0)]) for r in range(4) for n, s in tensors.items()]
    full = [dspec("full", 0, 10, n, s, (1,), [Replicate()]) for n, s in tensors.items()]
    cols = [
        dspec("cols", r, 20 + r, n, s, (3,), [Shard(len(s) - 1)])
        for r in range(3)
        for n, s in tensors.items()
    ]
    rows = [
        dspec("rows", r, 30 + min(r, 3), n, s, (5,), [Shard(0)])
        for r in range(5)
        for n, s in tensors.items()
    ]
    empty = [x for x in src + cols + rows if 0 in x.local_shape]
    assert {(x.pool, x.rank, x.name) for x in empty} == {
        ("t", 3, "e"),
        ("t", 2, "bias"),
        ("t", 3, "bias"),
        ("cols", 2, "e"),
        ("cols", 2, "bias"),
        ("rows", 3, "e"),
        ("rows", 4, "e"),
        ("rows", 2, "bias"),
        ("rows", 3, "bias"),
        ("rows", 4, "bias"),
    }
    assert all(x.boxes == () for x in empty)
    for relay in (False, True):
        plan = run_and_check(src, full + cols + rows, PlanConfig(relay=relay, bucket_bytes=16))
        # only empty shards on slot 33: its program sends, receives and maps nothing
        idle = plan.program(33)
        assert (idle.sends, idle.recvs, idle.local, idle.tensors) == ((), (), (), {})
        tensors_of = plan.tensors
        for slot in plan.slots():
            prog = plan.program(slot)
            copies = [*prog.local, *(c for m in (*prog.sends, *prog.recvs) for c in m.copies)]
            touched = {c.src_tensor for c in copies} | {c.dst_tensor for c in copies}
            assert not [i for i in touched if 0 in tensors_of[i].local_shape], slot


def test_torch_chunk_semantics_and_explicit_chunks():
    assert [torch_chunk_bounds(5, 4, i) for i in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    shape = (7, 3)
    cuts = [(0, 1), (1, 4), (5, 2)]
    src = [
        make_spec(
            model="m",
            pool="t",
            rank=r,
            slot=r,
            name="w",
            global_shape=shape,
            dtype="float32",
            layout=chunk_layout(shape, (o, 0), (n, 3)),
        )
        for r, (o, n) in enumerate(cuts)
    ]
    dst = [mspec("inf", 0, 9, "w", shape)]
    run_and_check(src, dst)


def test_two_destination_pools_and_buffer_fp32():
    shape = (24, 4)
    src = tp_side("train", 2, 2, 1, shape, 0, 0) + [
        mspec("train", r, r, "router.expert_bias", (12,)) for r in range(4)
    ]
    dst = tp_side("a", 3, 1, 1, shape, 0, 10) + tp_side("b", 4, 1, 2, shape, 0, 20)
    dst += [mspec("a", r, 10 + r, "router.expert_bias", (12,)) for r in range(3)]
    dst += [mspec("b", r, 20 + r, "router.expert_bias", (12,)) for r in range(4)]
    plan = run_and_check(src, dst)
    # replicas spread: all four source slots send something
    assert sum(1 for b in plan.send_bytes().values() if b) == 4
    relayed = run_and_check(src, dst, PlanConfig(relay=True, bucket_bytes=32))
    assert relayed.stats.source_max_send_bytes <= plan.stats.source_max_send_bytes


def test_name_map_fused_qkv_and_gated_fc1():
    heads, kv, hd, h, ffn = 4, 2, 2, 6, 6
    qkv_rows = (heads + 2 * kv) * hd
    src = tp_side("train", 2, 1, 1, (qkv_rows, h), 0, 0, name="qkv")
    src += tp_side("train", 2, 1, 2, (2 * ffn, h), 0, 0, name="fc1")
    nm = NameMap(
        tuple(
            split_fused_qkv("qkv", "q", "k", "v", heads, kv, hd)
            + split_gated_fc1("fc1", "gate", "up", ffn)
        )
    )
    dst = tp_side("hf", 2, 1, 1, (heads * hd, h), 0, 10, name="q")
    dst += tp_side("hf", 2, 1, 1, (kv * hd, h), 0, 10, name="k")
    dst += tp_side("hf", 2, 1, 1, (kv * hd, h), 0, 10, name="v")
    dst += tp_side("hf", 1, 1, 1, (ffn, h), 0, 10, name="gate")
    dst += tp_side("hf", 3, 1, 1, (ffn, h), 0, 10, name="up")

    def expect(f):
        g = f["qkv"].reshape(kv, heads // kv + 2, hd, h)
        return {
            "q": g[:, : heads // kv].reshape(-1, h),
            "k": g[:, heads // kv].reshape(-1, h),
            "v": g[:, heads // kv + 1].reshape(-1, h),
            "gate": f["fc1"][:ffn],
            "up": f["fc1"][ffn:],
        }

    run_and_check(src, dst, PlanConfig(name_map=nm), globals_=expect)


def test_dtype_cast_when_allowed():
    src = [mspec("t", 0, 0, "w", (4, 4), dtype="float32")]
    dst = [mspec("i", 0, 1, "w", (4, 4), dtype="float64")]
    run_and_check(src, dst, PlanConfig(allow_dtype_cast=True))


def test_block_aligned_split_and_digest():
    from refitd.plan.planner import build_plan, plan_digest

    shape = (256, 64)
    src = tp_side("t", 2, 1, 1, shape, 0, 0)
    dst = [
        make_spec(
            model="m",
            pool="i",
            rank=0,
            slot=5,
            name="w",
            global_shape=shape,
            dtype="float32",
            layout=megatron_layout(shape),
            storage="fp8_block",
        )
    ]
    cfg = PlanConfig(bucket_bytes=20000, sender_quantization=True)
    plan = build_plan("m", 1, src, dst, cfg)
    copies = [c for m in plan.program(5).recvs for c in m.copies]
    assert copies and all(c.wire == "fp8_block" for c in copies)
    assert all(c.dst_offset[0] % 128 == 0 and c.shape[0] % 128 == 0 for c in copies)
    assert plan.digest == plan_digest("m", src, dst, cfg)
    assert plan.digest == build_plan("m", 2, src, dst, cfg).digest  # the epoch is no layout
    moved = [*src[:1], mspec("t", 1, 3, "w", shape, tp_rank=1, tp_size=2, partition_dim=0)]
    assert plan.digest != plan_digest("m", moved, dst, cfg)
    mx = [
        make_spec(
            model="m",
            pool="i",
            rank=0,
            slot=5,
            name="w",
            global_shape=shape,
            dtype="float32",
            layout=megatron_layout(shape),
            storage="mxfp8",
        )
    ]
    plan = build_plan("m", 1, src, mx, PlanConfig(bucket_bytes=4096, sender_quantization=True))
    msgs = plan.program(5).recvs
    assert all(c.wire == "mxfp8" for m in msgs for c in m.copies)
    assert max(m.nbytes for m in msgs) <= 4096


def test_raw_copies_are_cut_only_at_the_blocks_of_their_destination_storage():
    """The receiver quantizes a raw copy block by block, so a bucket cut keeps the blocks of
    the destination's storage: 128-row tiles (block FP8), 32-element blocks of a 1-D MXFP8
    tensor."""
    for storage, shape, block in (("fp8_block", (512, 64), 128), ("mxfp8", (1024,), 32)):
        src = tp_side("train", 1, 1, 1, shape, 0, 0)
        dst = [
            dataclasses.replace(s, storage=storage) for s in tp_side("inf", 1, 1, 1, shape, 0, 10)
        ]
        plan = build_plan("m", 1, src, dst, PlanConfig(bucket_bytes=1024))
        pieces = [c for m in plan.program(10).recvs for c in m.copies]
        assert len(pieces) > 1 and {c.wire for c in pieces} == {"raw"}
        assert all(c.dst_offset[0] % block == 0 for c in pieces), storage


def test_slot_program_round_trip_and_rounds():
    src = tp_side("train", 4, 2, 2, (48, 8), 0, 0)
    dst = tp_side("inf", 3, 2, 1, (48, 8), 0, 20)
    plan = run_and_check(src, dst, PlanConfig(bucket_bytes=128))
    for slot in plan.slots():
        p = plan.program(slot)
        assert decode_program(encode_program(p)) == p
        keys = [(m.round, m.id) for m in p.sends]
        assert keys == sorted(keys)
        per_round = [(m.round, m.dst_slot) for m in p.sends]
        assert len(per_round) == len(set(per_round))  # one message per peer per round
    assert plan.source_slots_of("train", 3) == [3]


def test_padded_vocabulary_rows_are_declared_padding_never_written():
    """An engine vocabulary padded to a multiple of 64 (250 -> 256) and split over TP=4
    from a Megatron TP=2 embedding: the 6 padding rows keep their bytes (7 in the oracle),
    and the rule's declared padding is what makes the plan valid."""
    vocab, padded, h = 250, 256, 8
    src = tp_side("train", 2, 1, 1, (vocab, h), 0, 0, name="emb")
    dst = tp_side("vllm", 4, 1, 1, (padded, h), 0, 10, name="embed_tokens")
    nm = NameMap((rename("embed_tokens", "emb", vocab, padding=padded - vocab),))

    def expect(f):
        return {"embed_tokens": np.concatenate([f["emb"], np.full((6, h), 7, f["emb"].dtype)])}

    plan = run_and_check(src, dst, PlanConfig(name_map=nm), globals_=expect)
    assert plan.stats.total_bytes == vocab * h * 4
    with pytest.raises(PlanError, match=r"cover 250 of dim 0 .*embed_tokens.*\(256, 8\)"):
        build_plan(
            "m", 1, src, dst, PlanConfig(name_map=NameMap((rename("embed_tokens", "emb", vocab),)))
        )
    with pytest.raises(PlanError, match=r"cover 258 of dim 0"):
        bad = NameMap((rename("embed_tokens", "emb", vocab, padding=8),))
        build_plan("m", 1, src, dst, PlanConfig(name_map=bad))


def test_source_boxes_through_a_rule_drop_declared_padding():
    """A destination box resolved through a rule: parts become source boxes at their
    local offsets, rows in the declared padding map to nothing, rows past it are an error."""
    qkv = split_fused_qkv("qkv", "q", "k", "v", 4, 2, 2)  # groups [q q q q k k v v] x 2
    rules = {r.dst: r for r in [*qkv, rename("emb", "word", 250, padding=6)]}
    got = source_boxes(rules, "q", Box((2, 0), (4, 3), (10, 0)))  # q rows 2..6 at local 10
    assert got == [
        ("qkv", Box((2, 0), (2, 3), (10, 0))),  # end of group 0's q rows
        ("qkv", Box((8, 0), (2, 3), (12, 0))),  # start of group 1's q rows
    ]
    assert source_boxes(rules, "emb", Box((192, 0), (64, 8), (0, 0))) == [
        ("word", Box((192, 0), (58, 8), (0, 0)))
    ]
    assert source_boxes(rules, "emb", Box((250, 0), (6, 8), (58, 0))) == []
    assert source_boxes(rules, "other", Box((0,), (3,), (0,))) == [("other", Box((0,), (3,), (0,)))]
    with pytest.raises(PlanError, match=r"rows \[200, 264\) of dim 0 of 'emb'.*256 rows"):
        source_boxes(rules, "emb", Box((200, 0), (64, 8), (0, 0)))
