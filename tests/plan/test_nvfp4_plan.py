"""Planning NVFP4: its size rule, destinations landed by one whole uncut copy, layouts that
split such a tensor refused by name, and `explain` of an NVFP4 shard."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from refitd.plan.errors import PlanError
from refitd.plan.explain import explain, format_explanations
from refitd.plan.layout import Box, TensorSpec
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.wire import MXFP8, NVFP4, NVFP4_FORMAT, aligned, segment_nbytes, segment_parts

from .test_layouts_plan import tp_side


def _stored(specs, storage: str):
    return [dataclasses.replace(s, storage=storage) for s in specs]


def _copies_into(plan, index: int) -> list:
    """Every copy into plan tensor `index`, from its slot's program."""
    p = plan.program(plan.tensors[index].slot)
    return [c for m in p.recvs for c in m.copies if c.dst_tensor == index] + [
        c for c in p.local if c.dst_tensor == index
    ]


@pytest.mark.parametrize("shape", [(6, 100), (3, 2, 48), (40,), (2,), (5, 18), (7, 34)])
def test_size_rule_counts_packed_values_block_scales_and_the_global_scale(shape) -> None:
    rows, n = math.prod(shape[:-1]), shape[-1]
    parts = (rows * -(-n // 2), rows * -(-n // 16), 4)
    assert segment_parts("nvfp4", shape, "bfloat16") == parts
    want = sum(aligned(p) for p in parts)
    assert segment_nbytes("nvfp4", shape, "float32") == want
    padded = np.array([[*shape, *[1] * (4 - len(shape))]], np.int64)
    cols = NVFP4_FORMAT.segment_nbytes_columns(padded, np.array([len(shape)]), np.array([2]))
    assert cols.tolist() == [want]


@pytest.mark.parametrize("sender_quantization", [False, True])
def test_nvfp4_destinations_take_one_whole_copy_that_is_never_cut(sender_quantization) -> None:
    # the trainer holds whole tensors (two replicas); inference splits rows over TP=2, with
    # a bucket far below one shard: MXFP8 destinations are cut into many pieces, NVFP4 not
    shape = (64, 96)
    src = tp_side("train", 1, 2, 1, shape, 0, 0)
    cfg = PlanConfig(bucket_bytes=512, sender_quantization=sender_quantization)
    for storage in (MXFP8, NVFP4):
        dst = _stored(tp_side("inf", 2, 1, 1, shape, 0, 10), storage)
        plan = build_plan("m", 1, src, dst, cfg)
        for i in range(len(src), len(plan.tensors)):
            copies = _copies_into(plan, i)
            if storage == MXFP8:
                assert len(copies) > 1
                continue
            (c,) = copies
            assert c.shape == plan.tensors[i].local_shape == (32, 96)
            assert c.wire == ("nvfp4" if sender_quantization else "raw")
    if sender_quantization:  # the shard's bytes: 32 x 48 packed, 32 x 6 scales, 4
        assert plan.stats.remote_bytes == 2 * (aligned(32 * 48) + aligned(32 * 6) + 16)
        [shard] = explain(plan, "w", "inf", 1)
        [feed] = shard.feeds
        assert (feed.wire, feed.nbytes) == ("nvfp4", segment_nbytes("nvfp4", (32, 96), "float32"))
        assert "local 32x96 float32 nvfp4" in format_explanations([shard])
        assert "-> R[0:32, 0:96]  1.7 KiB nvfp4" in feed.line()


def test_layouts_that_split_an_nvfp4_tensor_are_refused_naming_it() -> None:
    shape = (64, 96)
    # trainer TP=2 over rows, inference unsharded: two source blocks feed the one shard
    src = tp_side("train", 2, 1, 1, shape, 0, 0)
    dst = _stored(tp_side("inf", 1, 1, 1, shape, 0, 10), NVFP4)
    with pytest.raises(
        PlanError,
        match=r"nvfp4 storage needs the whole tensor in one copy: tensor 'w' .*pool 'inf', "
        r"rank 0 \(local shape \(64, 96\)\): 2 copies feed it",
    ):
        build_plan("m", 1, src, dst, PlanConfig(sender_quantization=True))
    # an odd last dim cannot be packed two values per byte
    src = tp_side("train", 1, 1, 1, (8, 7), 0, 0)
    dst = _stored(tp_side("inf", 1, 1, 1, (8, 7), 0, 10), NVFP4)
    with pytest.raises(PlanError, match=r"tensor 'w' .*rank 0 .*last dim 7 is odd"):
        build_plan("m", 1, src, dst, PlanConfig())


def test_an_nvfp4_destination_its_boxes_cover_in_part_is_refused() -> None:
    """Rows of a destination that its boxes leave unwritten (padding of an engine buffer)
    would make its one copy less than the whole tensor: refused when planning, not when
    the copy lands."""
    box = Box((0, 0), (4, 64), (0, 0))
    src = [TensorSpec("m", "t", 0, 0, "w", "w", (4, 64), "bfloat16", (4, 64), (box,))]
    dst = [TensorSpec("m", "i", 0, 1, "w", "w", (4, 64), "bfloat16", (8, 64), (box,), NVFP4)]
    with pytest.raises(
        PlanError,
        match=r"tensor 'w' .*pool 'i', rank 0 \(local shape \(8, 64\)\): its one copy lands "
        r"\(4, 64\), not all of it",
    ):
        build_plan("m", 1, src, dst, PlanConfig())
