"""One test per validation error (its message), preset byte totals, bench output."""

from __future__ import annotations

import json

import pytest

from refitd.bench.presets import PRESETS, preset
from refitd.plan.errors import PlanError
from refitd.plan.layout import Box
from refitd.plan.layouts import (
    Layout,
    Shard,
    dtensor_layout,
    explicit_layout,
    make_spec,
    megatron_layout,
)
from refitd.plan.planner import PlanConfig, build_plan


def spec(pool, rank, name, shape, dtype="float32", layout=None, storage="plain", slot=None):
    return make_spec(
        model="m",
        pool=pool,
        rank=rank,
        slot=rank if slot is None else slot,
        name=name,
        global_shape=shape,
        dtype=dtype,
        layout=layout or megatron_layout(shape),
        storage=storage,
    )


def plan(src, dst, **cfg):
    return build_plan("m", 0, src, dst, PlanConfig(**cfg))


def test_missing_in_source():
    with pytest.raises(PlanError, match=r"missing in the source.*'b'.*pool 'i', rank 3"):
        plan([spec("t", 0, "a", (4,))], [spec("i", 3, "b", (4,), slot=9)])


def test_global_shapes_disagree():
    with pytest.raises(PlanError, match=r"global shapes disagree.*'w'.*\(4, 2\).*\(4, 3\)"):
        plan([spec("t", 0, "w", (4, 3))], [spec("i", 0, "w", (4, 2), slot=9)])


def test_dtype_mismatch_without_cast():
    with pytest.raises(PlanError, match=r"dtype mismatch.*bfloat16.*float32.*allow_dtype_cast"):
        plan([spec("t", 0, "w", (4,))], [spec("i", 0, "w", (4,), dtype="bfloat16", slot=9)])


def test_dtype_mismatch_names_the_setting_and_casts_stay_between_floats():
    with pytest.raises(
        PlanError, match=r"refitd serve --allow-dtype-cast.*REFITD_ALLOW_DTYPE_CAST"
    ):
        plan([spec("t", 0, "w", (4,))], [spec("i", 0, "w", (4,), dtype="float16", slot=9)])
    # with casts on, a float destination plans; an integer one is refused at plan time
    plan(
        [spec("t", 0, "w", (4,))],
        [spec("i", 0, "w", (4,), dtype="float16", slot=9)],
        allow_dtype_cast=True,
    )
    with pytest.raises(PlanError, match=r"'w'.*int32.*float32; casts exist only between float"):
        plan(
            [spec("t", 0, "w", (4,))],
            [spec("i", 0, "w", (4,), dtype="int32", slot=9)],
            allow_dtype_cast=True,
        )


def test_overlapping_source_boxes():
    a = explicit_layout((3,), [((0,), (3,), (0,))])
    b = explicit_layout((3,), [((2,), (3,), (0,))])
    src = [spec("t", 0, "w", (5,), layout=a), spec("t", 1, "w", (5,), layout=b)]
    with pytest.raises(PlanError, match=r"overlapping boxes in the source.*rank 0.*rank 1"):
        plan(src, [spec("i", 0, "w", (5,), slot=9)])


def test_hole_in_destination():
    lay = explicit_layout((3,), [Box((0,), (3,), (0,))])
    with pytest.raises(PlanError, match=r"holes in the destination pool 'i'.*cover 3 of 5"):
        plan([spec("t", 0, "w", (5,))], [spec("i", 0, "w", (5,), layout=lay, slot=9)])


def test_hole_in_source():
    lay = explicit_layout((2,), [Box((0,), (2,), (0,))])
    with pytest.raises(PlanError, match=r"holes in the source.*cover 2 of 5"):
        plan([spec("t", 0, "w", (5,), layout=lay)], [spec("i", 0, "w", (5,), slot=9)])


def test_hole_beside_empty_shards_names_tensor_and_region():
    # [3, 4] Shard(0) over 4 ranks: rank 3's shard is empty, rank 1 never registered
    def rows(pool, r, slot=None):
        lay = dtensor_layout((3, 4), (4,), (r,), [Shard(0)], label="e")
        return spec(pool, r, "e", (3, 4), layout=lay, slot=slot)

    assert rows("t", 3).boxes == ()
    plan([rows("t", r) for r in range(4)], [rows("i", r, 9 + r) for r in range(4)])
    with pytest.raises(
        PlanError,
        match=r"holes in the source: tensor 'e' .*global shape \(3, 4\) cover 8 of 12 elements; "
        r"no shard holds the block at offset \(1, 0\) of shape \(1, 4\)",
    ):
        plan([rows("t", r) for r in (0, 2, 3)], [rows("i", r, 9 + r) for r in range(4)])
    with pytest.raises(
        PlanError,
        match=r"holes in the destination pool 'i': tensor 'e'.*offset \(2, 0\) of shape \(1, 4\)",
    ):
        plan([rows("t", r) for r in range(4)], [rows("i", r, 9 + r) for r in (0, 1, 3)])
    # a replica that holds nothing of a non-empty local tensor is refused, not skipped
    with pytest.raises(PlanError, match=r"no boxes, but local shape \(3, 4\) is not empty"):
        spec("i", 0, "e", (3, 4), layout=Layout((3, 4), ()))


def test_stride_not_dividing():
    with pytest.raises(PlanError, match=r"stride does not divide.*10.*4 parts x stride 2.*fc1"):
        megatron_layout(
            (10, 4), tp_rank=0, tp_size=4, partition_dim=0, partition_stride=2, label="fc1"
        )


def test_quantized_block_not_whole():
    src = [
        spec(
            "t",
            r,
            "w",
            (4, 64),
            layout=megatron_layout((4, 64), tp_rank=r, tp_size=4, partition_dim=1),
        )
        for r in range(4)
    ]
    dst = [spec("i", 0, "w", (4, 64), storage="mxfp8", slot=9)]
    with pytest.raises(PlanError, match=r"quantized block not whole.*'w'.*pool 'i', rank 0"):
        plan(src, dst, sender_quantization=True)
    plan(src, dst)  # raw wire: the receiver quantizes whole tensors, fine


def test_box_outside_and_local_overlap():
    lay = explicit_layout((2,), [((0,), (2,), (0,)), ((2,), (2,), (1,))])
    with pytest.raises(PlanError, match=r"outside the local shape.*'w', pool 't', rank 0"):
        spec("t", 0, "w", (4,), layout=lay)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_byte_totals(name):
    expected = {
        "llama3-8b": 16_060_522_496,
        "llama3-70b": 141_107_412_992,
        "kimi-k2": 2_052_816_510_976,
    }[name]
    assert preset(name).nbytes() == expected


def test_bench_plan_small(capsys):
    from refitd.cli.main import main

    argv = [
        "bench",
        "plan",
        "--model",
        "llama3-8b",
        "--src",
        "tp=4,pp=2",
        "--src-world",
        "16",
        "--dst",
        "tp=2",
        "--dst-world",
        "4",
        "--repeat",
        "1",
        "--no-megatron",  # its reference: test_bench_megatron.py, in a child process
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # every destination rank holds a full dp replica share: 4 ranks x (model / tp 2) ... total
    assert out["total_bytes"] >= 2 * preset("llama3-8b").nbytes()
    assert out["send_imbalance"] >= 1.0 and out["copies"] > 0
    assert out["relay_bytes"] == 0 and out["plan_from_table_s"] > 0
    assert out["megatron"] == "skipped (--no-megatron)"
    assert main([*argv, "--relay"]) == 0
    relay = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert relay["relay"] and relay["total_bytes"] == out["total_bytes"]
    assert relay["source_max_send_bytes"] <= out["source_max_send_bytes"]
    assert relay["max_send_bytes"] >= relay["source_max_send_bytes"]
    # --programs: the controller's path, in this process and from a planning process
    assert main([*argv, "--relay", "--programs"]) == 0
    programs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert programs["controller_path_s"] > 0 and programs["process_path_s"] > 0
    assert programs["process_wall_s"] >= programs["process_path_s"]
