"""Shared oracle for planner tests: shard a global tensor by a spec, run, compare."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refitd.bench.plan_oracle import WireCodec, execute
from refitd.plan.layout import TensorSpec
from refitd.plan.planner import Plan, PlanConfig, build_plan

NP_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float64": np.float64}


def shard_of(full: np.ndarray, spec: TensorSpec, dtype: type | None = None) -> np.ndarray:
    """The local tensor a spec should hold, cut from the global tensor."""
    out = np.zeros(spec.local_shape, dtype=dtype or full.dtype)
    for b in spec.boxes:
        loc = tuple(slice(lo, lo + n) for lo, n in zip(b.local_offset, b.shape, strict=True))
        glo = tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape, strict=True))
        out[loc] = full[glo]
    return out


def run_and_check(
    sources: Sequence[TensorSpec],
    destinations: Sequence[TensorSpec],
    config: PlanConfig | None = None,
    globals_: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    codecs: dict[str, WireCodec] | None = None,
) -> Plan:
    """Plan, execute in memory and compare every destination shard bit for bit with the
    expected one (source canonical tensors are random; destinations are derived from them
    by `globals_` when given, e.g. for name maps). codecs: by wire name, for wires other
    than raw (simulate.WireCodec)."""
    config = config or PlanConfig()
    rng = np.random.default_rng(seed)
    full: dict[str, np.ndarray] = {}
    for s in sources:
        if s.canonical not in full:
            dt = NP_DTYPES[s.dtype]
            full[s.canonical] = rng.integers(0, 2**15, size=s.global_shape).astype(dt)
    plan = build_plan("m", 1, sources, destinations, config)
    n = len(sources)
    src_arrays = {i: shard_of(full[s.canonical], s) for i, s in enumerate(sources)}
    dst_arrays = {
        n + i: np.full(s.local_shape, 7, NP_DTYPES[s.dtype]) for i, s in enumerate(destinations)
    }
    execute(plan, src_arrays, dst_arrays, codecs=codecs)
    expected = dict(full)
    if globals_:
        expected.update(globals_(full) if callable(globals_) else globals_)
    for i, s in enumerate(destinations):
        want = shard_of(expected[s.canonical].astype(NP_DTYPES[s.dtype]), s)
        got = dst_arrays[n + i]
        assert got.dtype == want.dtype
        assert np.array_equal(got, want), f"destination {s.pool}/{s.rank}/{s.name} differs"
    return plan
