"""Layout identity apart from memory handles and epochs: what a restart keeps, what a
layout change moves, and which slots get their program again."""

from __future__ import annotations

import copy
import dataclasses

from refitd.plan.layout import TensorSpec
from refitd.plan.layouts import make_spec, megatron_layout
from refitd.plan.table import SpecTable
from refitd.server.model_tables import ModelTables
from refitd.server.planning import (
    PlanOptions,
    WorkerKey,
    make_digest,
    make_plan,
    stale_slots,
)

OPTIONS = PlanOptions(bucket_bytes=256, relay=True)
SHAPE = (16, 8)


def tp_side(
    pool: str, tp: int, dp: int, stride: int, shape: tuple[int, ...], dim: int, slot_base: int
) -> list[TensorSpec]:
    """One tensor "w" of a Megatron TP x DP pool, rank d * tp + t on slot slot_base + rank."""
    return [
        make_spec(
            model="m",
            pool=pool,
            rank=d * tp + t,
            slot=slot_base + d * tp + t,
            name="w",
            canonical=None,
            global_shape=shape,
            dtype="float32",
            layout=megatron_layout(
                shape,
                label="w",
                tp_rank=t,
                tp_size=tp,
                partition_dim=dim,
                partition_stride=stride,
            ),
        )
        for d in range(dp)
        for t in range(tp)
    ]


def _sides() -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Trainer tp=2 on slots 0-1; inference tp=2 x dp=2 on slots 10-13."""
    return tp_side("train", 2, 1, 1, SHAPE, 0, 0), tp_side("infer", 2, 2, 1, SHAPE, 1, 10)


def test_layout_digest_ignores_handles_and_epochs_not_layouts() -> None:
    src, dst = _sides()
    digest = make_digest("m", src, dst, OPTIONS)
    # a rank registering again: equal specs in new objects (memory lives elsewhere)
    restarted = [copy.copy(t) if t.rank == 1 else t for t in dst]
    assert make_digest("m", src, restarted, OPTIONS) == digest
    assert (
        make_plan("m", 1, src, dst, OPTIONS).digest == make_plan("m", 7, src, dst, OPTIONS).digest
    )
    # layouts: other TP, a new pool, a rank on another slot, another config
    other_tp = tp_side("infer", 4, 1, 1, SHAPE, 1, 10)
    assert make_digest("m", src, other_tp, OPTIONS) != digest
    pool = tp_side("infer-2", 2, 1, 1, SHAPE, 1, 20)
    assert make_digest("m", src, dst + pool, OPTIONS) != digest
    moved = [dataclasses.replace(t, slot=30) if t.rank == 3 else t for t in dst]
    assert make_digest("m", src, moved, OPTIONS) != digest
    assert make_digest("m", src, dst, PlanOptions(bucket_bytes=256, relay=False)) != digest


def test_rebuilt_tables_keep_the_first_registration_order() -> None:
    """Ranks registered out of order, one removed and back: the rebuilt tables (the
    registry lists workers by rank) give the digest of the tables kept as they came."""
    src, dst = _sides()
    tables = ModelTables()
    tables.add("source", SpecTable.from_specs([t for t in src if t.rank == 1]))
    tables.add("source", SpecTable.from_specs([t for t in src if t.rank == 0]))
    for rank in (3, 0, 2, 1):
        tables.add("destination", SpecTable.from_specs([t for t in dst if t.rank == rank]))
    kept = tables.snapshot(lambda: ([], []))
    digest = make_digest("m", *kept, OPTIONS)
    tables.release()
    tables.invalidate()
    rebuilt = tables.snapshot(lambda: (src, dst))  # by rank, as the registry lists them
    tables.release()
    assert tables.rebuilds == 1 and make_digest("m", *rebuilt, OPTIONS) == digest
    assert make_digest("m", SpecTable.from_specs(src), dst, OPTIONS) != digest  # order counts


def test_only_slots_of_a_new_registration_are_stale() -> None:
    src, dst = _sides()
    cp = make_plan("m", 1, src, dst, OPTIONS)
    ident: dict[WorkerKey, str] = {(t.pool, t.rank): "first" for t in [*src, *dst]}
    assert set(cp.slots) == {0, 1, 10, 11, 12, 13}
    loaded = stale_slots(cp, lambda s: None, ident.__getitem__)
    assert set(loaded) == set(cp.slots)  # nothing loaded yet: every slot
    assert not stale_slots(cp, loaded.get, ident.__getitem__)  # loaded with these inputs
    ident[("infer", 2)] = "restarted"
    assert set(stale_slots(cp, loaded.get, ident.__getitem__)) == {12}
    ident[("train", 0)] = "restarted"
    assert set(stale_slots(cp, loaded.get, ident.__getitem__)) == {0, 12}
    # a pool switching to staged: the slots holding its ranks
    again = stale_slots(cp, loaded.get, ident.__getitem__, staged=frozenset({"infer"}))
    assert set(again) == {0, 10, 11, 12, 13}
