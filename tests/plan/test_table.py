"""SpecTable columns against their definition: one geometry id per distinct Geo value and
one canonical id per distinct name, both in order of first appearance, whether specs
share their shape, box and string objects or only equal values, added at once or in parts."""

from __future__ import annotations

import copy
import dataclasses
import random

import numpy as np

from refitd.bench.presets import Parallel, build_specs, preset
from refitd.plan.layout import TensorSpec
from refitd.plan.table import Geo, SpecTable


def _mixed_specs() -> list[TensorSpec]:
    """A preset side where some specs are deep copies (equal values, other objects) and
    some keep their boxes object under another pool, dtype or canonical name."""
    specs = build_specs(preset("llama3-8b"), Parallel.parse("tp=2,pp=2", 8), "m", "a", 0)
    rng = random.Random(7)
    out = []
    for s in specs:
        r = rng.random()
        if r < 0.2:
            s = copy.deepcopy(s)
        elif r < 0.3:
            s = dataclasses.replace(s, pool="b")
        elif r < 0.4:
            s = dataclasses.replace(s, dtype="float32", canonical=s.canonical + ".f32")
        out.append(s)
    return out


def _expected(specs: list[TensorSpec]) -> tuple[list[Geo], list[int], list[str], list[int]]:
    geos = [Geo(s.pool, s.global_shape, s.dtype, s.storage, s.local_shape, s.boxes) for s in specs]
    geo_ids = {g: i for i, g in enumerate(dict.fromkeys(geos))}
    names = [s.canonical for s in specs]
    canon_ids = {c: i for i, c in enumerate(dict.fromkeys(names))}
    return list(geo_ids), [geo_ids[g] for g in geos], list(canon_ids), [canon_ids[c] for c in names]


def _assert_table(t: SpecTable, specs: list[TensorSpec]) -> None:
    geos, geo_col, canonicals, canon_col = _expected(specs)
    canon, geo, slot = t.columns()
    assert t.geos == geos
    assert t.canonicals == canonicals
    assert geo.tolist() == geo_col
    assert canon.tolist() == canon_col
    assert slot.tolist() == [s.slot for s in specs]
    assert t.ranks().tolist() == [s.rank for s in specs]
    assert t.specs == specs


def test_columns_follow_values_not_objects() -> None:
    specs = _mixed_specs()
    assert len({s.pool for s in specs}) == 2 and len({s.dtype for s in specs}) == 2
    _assert_table(SpecTable.from_specs(specs), specs)
    parts = [specs[i : i + 37] for i in range(0, len(specs), 37)]
    added = SpecTable()
    for part in parts:
        added.add(part)
    _assert_table(added, specs)
    joined = SpecTable.from_tables(SpecTable.from_specs(p) for p in parts)
    _assert_table(joined, specs)
    assert joined.layout_signature() == SpecTable.from_specs(specs).layout_signature()
    assert np.array_equal(joined.ranks(), added.ranks())
