"""Twin plans (a catch-up from replicas of the same layout): every destination shard lands
bit for bit through the NumPy oracle executor, holders are taken in turn, and workers of
another layout or storage are refused with their pool and rank named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.bench.plan_oracle import execute
from refitd.plan.errors import PlanError
from refitd.plan.planner import PlanConfig
from refitd.plan.table import SpecTable
from refitd.plan.twins import build_twin_plan, pair_twins

from .oracle import NP_DTYPES, shard_of
from .test_layouts_plan import tp_side


def _workers(specs: list) -> list[SpecTable]:
    """One table per rank, in rank order (one registration each)."""
    ranks: dict[int, list] = {}
    for s in specs:
        ranks.setdefault(s.rank, []).append(s)
    return [SpecTable.from_specs(ranks[r]) for r in sorted(ranks)]


def _pool(name: str, tp: int, dp: int, stride: int, shape: tuple, dim: int, base: int) -> list:
    return tp_side(name, tp, dp, stride, shape, dim, base) + tp_side(
        name, tp, dp, 1, (2 * tp, 3), 0, base, "b"
    )


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    dp=st.integers(1, 3),
    joining=st.integers(1, 3),
    stride=st.sampled_from([1, 2]),
    dim=st.sampled_from([0, 1]),
    bucket=st.sampled_from([64, 1 << 20]),
)
def test_twin_plan_lands_every_shard(tp, dp, joining, stride, dim, bucket):
    shape = (8 * tp, 4 * tp)
    holders = _pool("inf", tp, dp, stride, shape, dim, 10)
    behind = _pool("inf-2", tp, joining, stride, shape, dim, 100)
    h_tables, b_tables = _workers(holders), _workers(behind)
    twins = pair_twins(h_tables, b_tables)
    assert twins is not None and len(twins) == len(b_tables)
    # rank k of a replica (tp rank k % tp) is fed by a holder of the same tp rank, and the
    # holders of one layout are taken in turn
    for i, j in twins:
        assert h_tables[i].specs[0].rank % tp == b_tables[j].specs[0].rank % tp
    for t in range(tp):
        used = [i for i, j in twins if b_tables[j].specs[0].rank % tp == t]
        assert len(set(used)) == min(dp, joining)
    pairs = [(h_tables[i], b_tables[j]) for i, j in twins]
    plan = build_twin_plan("m", 1, pairs, PlanConfig(bucket_bytes=bucket, relay=True))
    src = [s for h, _ in pairs for s in h.specs]
    dst = [s for _, b in pairs for s in b.specs]
    assert plan.tensors == src + dst
    rng = np.random.default_rng(tp * 100 + dp * 10 + joining)
    full = {
        s.canonical: rng.integers(0, 2**15, size=s.global_shape).astype(NP_DTYPES[s.dtype])
        for s in holders
    }
    n = len(src)
    src_arrays = {i: shard_of(full[s.canonical], s) for i, s in enumerate(src)}
    dst_arrays = {n + i: np.full(s.local_shape, 7, NP_DTYPES[s.dtype]) for i, s in enumerate(dst)}
    execute(plan, src_arrays, dst_arrays)
    for i, s in enumerate(dst):
        assert np.array_equal(dst_arrays[n + i], shard_of(full[s.canonical], s)), (s.rank, s.name)
    # each joining rank receives from its twin's slot only
    for i, j in twins:
        prog = plan.program(b_tables[j].specs[0].slot)
        assert set(prog.recv.src_slot.tolist()) == {h_tables[i].specs[0].slot}
    assert plan.stats.relay_copies == 0


def test_twin_plan_digest_follows_layout_and_placement():
    holders = _workers(_pool("inf", 2, 1, 1, (16, 8), 0, 10))
    behind = _workers(_pool("inf-2", 2, 1, 1, (16, 8), 0, 100))
    cfg = PlanConfig(bucket_bytes=1 << 20)
    pairs = list(zip(holders, behind, strict=True))
    a = build_twin_plan("m", 1, pairs, cfg)
    assert build_twin_plan("m", 2, pairs, cfg).digest == a.digest  # not the epoch
    moved = _workers(_pool("inf-2", 2, 1, 1, (16, 8), 0, 200))
    assert build_twin_plan("m", 1, list(zip(holders, moved, strict=True)), cfg).digest != a.digest
    swapped = list(zip(holders, reversed(behind), strict=True))
    with pytest.raises(
        PlanError, match="rank 1 of pool 'inf-2' does not hold the layout of rank 0"
    ):
        build_twin_plan("m", 1, swapped, cfg)


def test_workers_without_a_twin_or_of_quantized_storage():
    holders = _workers(_pool("inf", 2, 1, 1, (16, 8), 0, 10))
    other_tp = _workers(_pool("inf-2", 4, 1, 1, (16, 8), 0, 100))
    assert pair_twins(holders, other_tp) is None
    assert pair_twins([], _workers(_pool("inf-2", 2, 1, 1, (16, 8), 0, 100))) is None
    quantized = [
        SpecTable.from_specs([dataclasses.replace(s, storage="mxfp8") for s in w.specs])
        for w in holders
    ]
    same_q = [
        SpecTable.from_specs(
            [dataclasses.replace(s, pool="inf-2", slot=s.slot + 90) for s in w.specs]
        )
        for w in quantized
    ]
    assert pair_twins(quantized, same_q) is None  # quantized holders feed no twin
    with pytest.raises(PlanError, match="keeps mxfp8 storage"):
        build_twin_plan("m", 1, list(zip(quantized, same_q, strict=True)), PlanConfig())
    with pytest.raises(PlanError, match=r"no \(source, destination\) worker pair"):
        build_twin_plan("m", 1, [], PlanConfig())
