"""Relay plans (destination replicas forwarding blocks): bit for bit, round rule, balance."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.bench.plan_oracle import execute
from refitd.plan.names import canonical_name
from refitd.plan.planner import Plan, PlanConfig, build_plan

from .oracle import run_and_check
from .test_layouts_plan import mspec, tp_side

FEW = settings(max_examples=10, deadline=None)


def _region(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def check_relay_rule(plan: Plan, n_src: int) -> int:
    """Every relay reads, on its sending slot, a destination region that messages of
    smaller rounds to that slot wrote in full; returns the number of relay copies."""
    relays = 0
    for slot in plan.slots():
        p = plan.program(slot)
        # one message per peer and round, both ways
        assert len({(m.round, m.dst_slot) for m in p.sends}) == len(p.sends)
        assert len({(m.round, m.src_slot) for m in p.recvs}) == len(p.recvs)
        for m in p.sends:
            for c in m.copies:
                if c.src_tensor < n_src:
                    continue
                relays += 1
                spec = p.tensors[c.src_tensor]
                assert spec.slot == slot and spec.storage == "plain"
                assert spec.dtype == plan.tensors[c.dst_tensor].dtype
                written = np.zeros(spec.local_shape, bool)
                for r in p.recvs:
                    if r.round >= m.round:
                        continue
                    for w in r.copies:
                        if w.dst_tensor == c.src_tensor:
                            written[_region(w.dst_offset, w.shape)] = True
                region = _region(c.src_offset, c.shape)
                assert written[region].all(), f"relay in round {m.round} reads unwritten data"
        for c in p.local:
            if c.src_tensor >= n_src:
                relays += 1
    return relays


@FEW
@given(
    tp_s=st.sampled_from([1, 2, 4]),
    tp_d=st.sampled_from([1, 2, 3]),
    st_s=st.sampled_from([1, 2]),
    st_d=st.sampled_from([1, 3]),
    dim=st.sampled_from([0, 1]),
    dp_s=st.sampled_from([1, 2]),
    dp_d=st.sampled_from([2, 3]),
    bucket=st.sampled_from([64, 1 << 20]),
    collocated=st.booleans(),
)
def test_relays_tp_replicas(tp_s, tp_d, st_s, st_d, dim, dp_s, dp_d, bucket, collocated):
    n = 72
    shape = (n, 10) if dim == 0 else (6, n)
    src = tp_side("train", tp_s, dp_s, st_s, shape, dim, 0)
    src += tp_side("train", tp_s, dp_s, 1, (n,), 0, 0, name="bias")
    base = 0 if collocated else 100
    dst = tp_side("inf", tp_d, dp_d, st_d, shape, dim, base)
    dst += tp_side("inf", tp_d, dp_d, 1, (n,), 0, base, name="bias")
    direct = run_and_check(src, dst, PlanConfig(bucket_bytes=bucket))
    plan = run_and_check(src, dst, PlanConfig(bucket_bytes=bucket, relay=True))
    relays = check_relay_rule(plan, len(src))
    assert relays == plan.stats.relay_copies + sum(
        1 for s in plan.slots() for c in plan.program(s).local if c.src_tensor >= len(src)
    )
    if bucket >= 1 << 20:  # 64-byte buckets cut copies into pieces, each padded to the
        # segment alignment, which the relay choice's copy-level loads do not see
        assert plan.stats.source_max_send_bytes <= direct.stats.source_max_send_bytes
    if not collocated and dp_s == 1:  # one source feeds every replica: it must shed
        assert relays > 0 and plan.stats.relay_bytes > 0
        assert plan.stats.source_max_send_bytes < direct.stats.source_max_send_bytes


def _expert_side(pool, layers_per_stage, ep, edp, experts, shape, base):
    """Per-expert tensors over PP stages x EP x expert-DP (rank = (stage, edp, ep))."""
    out, rank = [], 0
    local = experts // ep
    first = 0
    for n_layers in layers_per_stage:
        for _ in range(edp):
            for e in range(ep):
                for lay in range(n_layers):
                    for k in range(local):
                        name = f"decoder.layers.{lay}.mlp.experts.linear_fc2.weight{k}"
                        canon = canonical_name(name, layer_offset=first, expert_offset=e * local)
                        out.append(mspec(pool, rank, base + rank, name, shape, canonical=canon))
                rank += 1
        first += n_layers
    return out


@FEW
@given(
    stages=st.sampled_from([(2, 1), (3, 2, 2), (1,)]),
    ep_s=st.sampled_from([2, 4]),
    ep_d=st.sampled_from([2, 4]),
    edp_d=st.sampled_from([2, 4]),
    bucket=st.sampled_from([48, 1 << 20]),
)
def test_relays_experts_uneven_stages(stages, ep_s, ep_d, edp_d, bucket):
    experts, shape = 8, (4, 6)
    layers = sum(stages)
    src = _expert_side("train", stages, ep_s, 1, experts, shape, 0)
    dst = _expert_side("inf", (layers,), ep_d, edp_d, experts, shape, 100)
    direct = run_and_check(src, dst, PlanConfig(bucket_bytes=bucket))
    relay = run_and_check(src, dst, PlanConfig(bucket_bytes=bucket, relay=True))
    assert check_relay_rule(relay, len(src)) == relay.stats.relay_copies > 0
    s, d = relay.stats, direct.stats
    assert s.total_bytes == d.total_bytes and s.max_recv_bytes == d.max_recv_bytes
    # sources send less and no more unevenly; bytes leaving sources + relays = all bytes
    assert s.source_max_send_bytes < d.source_max_send_bytes
    assert s.send_imbalance <= d.send_imbalance + 1e-9
    assert s.ideal_send_bytes * s.source_slots + s.relay_bytes == s.remote_bytes
    assert s.max_send_bytes >= s.source_max_send_bytes


def test_relay_round_rule_is_enforced_by_the_oracle():
    """A relay moved into the round of its feed reads stale bytes: the simulation fails."""
    shape = (8, 4)
    src = tp_side("train", 1, 1, 1, shape, 0, 0)
    dst = tp_side("inf", 1, 3, 1, shape, 0, 10)
    plan = run_and_check(src, dst, PlanConfig(relay=True))
    assert plan.stats.relay_copies > 0
    plan._m_round[:] = 0  # every message in one round: relays no longer after their feeds
    plan._index = None  # programs are cached per plan: rebuild them from these rounds
    full = np.arange(32, dtype=np.float32).reshape(shape)
    dst_arrays = {1 + i: np.zeros(shape, np.float32) for i in range(3)}
    execute(plan, {0: full}, dst_arrays)
    assert not all(np.array_equal(a, full) for a in dst_arrays.values())


def test_relay_off_by_default_and_digest():
    from refitd.plan.planner import plan_digest

    src = tp_side("train", 2, 1, 1, (8, 4), 0, 0)
    dst = tp_side("inf", 2, 2, 1, (8, 4), 0, 10)
    plan = run_and_check(src, dst)
    assert plan.stats.relay_copies == 0 and plan.stats.relay_bytes == 0
    assert plan_digest("m", src, dst, PlanConfig()) != plan_digest(
        "m", src, dst, PlanConfig(relay=True)
    )
    relayed = run_and_check(src, dst, PlanConfig(relay=True))
    # a trainer rank is released once its sources are read: relays don't count
    for r in range(2):
        assert relayed.source_slots_of("train", r) == [r]


def _same_plan_from_lists_and_tables(src, dst, ts, td, cfg):
    """The plan from the spec lists and the one from the tables: same digest (also by
    plan_digest of the tables), statistics and programs; returns the first."""
    from refitd.plan.planner import build_plan, build_plan_from_table, plan_digest

    a = build_plan("m", 1, src, dst, cfg)
    b = build_plan_from_table("m", 1, ts, td, cfg)
    assert a.digest == b.digest == plan_digest("m", ts, td, cfg)
    assert a.stats == b.stats
    for slot in a.slots():
        assert a.program(slot) == b.program(slot)
    return a


def test_spec_table_incremental_equals_lists():
    """A controller adding each worker's specs as it registers gets the plan (digest,
    stats, programs) of the one-shot list path; any registration change moves the digest."""
    from refitd.plan.planner import plan_digest
    from refitd.plan.table import SpecTable

    src = tp_side("train", 2, 2, 2, (24, 4), 0, 0) + tp_side("train", 2, 2, 1, (8,), 0, 0, "b")
    dst = tp_side("inf", 3, 2, 1, (24, 4), 0, 10) + tp_side("inf", 1, 6, 1, (8,), 0, 10, "b")
    cfg = PlanConfig(bucket_bytes=64, relay=True)
    ts, td = SpecTable(), SpecTable()
    for rank in range(4):
        ts.add([s for s in src if s.rank == rank])
    for rank in range(6):
        td.add(s for s in dst if s.rank == rank)
    # same specs, registration order per worker
    src_o = [s for r in range(4) for s in src if s.rank == r]
    dst_o = [s for r in range(6) for s in dst if s.rank == r]
    _same_plan_from_lists_and_tables(src_o, dst_o, ts, td, cfg)
    renamed = [*dst_o[:-1], mspec("inf", 5, 15, "c", (8,), canonical="b")]
    assert plan_digest("m", ts, td, cfg) != plan_digest("m", src_o, renamed, cfg)
    assert len(ts) == len(src) and len(td.geos) < len(dst)


def test_spec_table_joined_from_worker_tables_equals_lists():
    """One table per worker joined (SpecTable.from_tables, as the controller's model
    tables and catch-up plans do) gives the one-shot list path's columns, digest and plan,
    with worker tables that share geometries and names; a joined table is unchanged by a
    later add to a worker table (its names digest follows its own content)."""
    from refitd.plan.planner import plan_digest
    from refitd.plan.table import SpecTable

    src = tp_side("train", 2, 2, 2, (24, 4), 0, 0) + tp_side("train", 2, 2, 1, (8,), 0, 0, "b")
    dst = tp_side("inf", 3, 2, 1, (24, 4), 0, 10) + tp_side("inf", 1, 6, 1, (8,), 0, 10, "b")
    cfg = PlanConfig(bucket_bytes=64, relay=True)
    src_o = [s for r in range(4) for s in src if s.rank == r]
    dst_o = [s for r in range(6) for s in dst if s.rank == r]
    per_src = [SpecTable.from_specs([s for s in src_o if s.rank == r]) for r in range(4)]
    per_dst = [SpecTable.from_specs([s for s in dst_o if s.rank == r]) for r in range(6)]
    ts, td = SpecTable.from_tables(per_src), SpecTable.from_tables(per_dst)
    one_s, one_d = SpecTable.from_specs(src_o), SpecTable.from_specs(dst_o)
    for joined, one in ((ts, one_s), (td, one_d)):
        assert joined.specs == one.specs and joined.geos == one.geos
        assert joined.canonicals == one.canonicals
        for a_col, b_col in zip(joined.columns(), one.columns(), strict=True):
            assert np.array_equal(a_col, b_col)
        assert np.array_equal(joined.ranks(), one.ranks())
    a = _same_plan_from_lists_and_tables(src_o, dst_o, ts, td, cfg)
    assert a.digest == plan_digest("m", one_s, one_d, cfg)
    per_dst[0].add([mspec("inf", 0, 10, "c", (8,), canonical="b")])
    assert plan_digest("m", ts, td, cfg) == a.digest
    # a joined table extended further hashes its new content
    td.extend(SpecTable.from_specs([mspec("inf", 6, 16, "x", (8,), canonical="b")]))
    assert plan_digest("m", ts, td, cfg) != a.digest


def test_relays_across_pools_of_the_same_layout():
    """Two pools of the same layout (one replica each) are replicas of each other: one
    source copy feeds one pool, which forwards to the other (the trainer sends each byte
    once, not once per pool). Bit for bit through the in-memory oracle."""
    shape = (64, 12)
    src = tp_side("train", 2, 1, 2, shape, 0, 0)
    dst = tp_side("pool-a", 2, 1, 1, shape, 0, 10) + tp_side("pool-b", 2, 1, 1, shape, 0, 20)
    direct = run_and_check(src, dst, PlanConfig(bucket_bytes=256))
    plan = run_and_check(src, dst, PlanConfig(bucket_bytes=256, relay=True))
    assert check_relay_rule(plan, len(src)) == plan.stats.relay_copies > 0
    assert plan.stats.source_max_send_bytes * 2 == direct.stats.source_max_send_bytes
    # Each source block is cut into several messages; its relays are cut the same way and
    # go one round after their piece, while later pieces are still on the wire.
    sends = [m for s in plan.slots() for m in plan.program(s).sends]
    relay_rounds = [m.round for m in sends if any(c.src_tensor >= len(src) for c in m.copies)]
    direct_rounds = [m.round for m in sends if all(c.src_tensor < len(src) for c in m.copies)]
    assert min(relay_rounds) == 1 < max(direct_rounds)


@FEW
@given(
    tp=st.sampled_from([1, 2, 4]),
    dp=st.integers(1, 2),
    bucket=st.sampled_from([96, 256, 1 << 20]),
    order=st.booleans(),
)
def test_relay_chain_feeds_the_later_pool_from_the_first(tp, dp, bucket, order):
    """With relay_chain, the sources send every block to the first registered pool, whose
    ranks forward it (to the later pool, and to its own other replicas); the trainer still
    sends each byte once and everything lands bit for bit."""
    shape = (64, 12)
    src = tp_side("train", 2, 1, 2, shape, 0, 0)
    a = tp_side("pool-a", tp, dp, 1, shape, 0, 10)
    b = tp_side("pool-b", tp, dp, 1, shape, 0, 30)
    first, later = (a, b) if order else (b, a)
    spread = run_and_check(src, first + later, PlanConfig(bucket_bytes=bucket, relay=True))
    cfg = PlanConfig(bucket_bytes=bucket, relay=True, relay_chain=True)
    plan = run_and_check(src, first + later, cfg)
    assert check_relay_rule(plan, len(src)) == plan.stats.relay_copies > 0
    assert plan.stats.source_max_send_bytes == spread.stats.source_max_send_bytes
    first_slots = {s.slot for s in first}
    later_slots = {s.slot for s in later}
    for slot in plan.slots():
        for m in plan.program(slot).sends:
            relay = any(c.src_tensor >= len(src) for c in m.copies)
            if relay:
                assert slot in first_slots, f"slot {slot} of the later pool relays"
            elif m.dst_slot in later_slots:  # a direct copy into the later pool
                raise AssertionError(f"source slot {slot} sends to the later pool")
    assert plan.digest != spread.digest


@FEW
@given(
    tp_s=st.sampled_from([1, 2]),
    dp_s=st.sampled_from([1, 3]),
    tp_d=st.sampled_from([1, 2, 3]),
    dp_d=st.sampled_from([1, 4]),
    pools=st.sampled_from([2, 3]),
    relay=st.booleans(),
    bucket=st.sampled_from([64, 1 << 20]),
)
def test_identical_pools_stamped_bit_for_bit(tp_s, dp_s, tp_d, dp_d, pools, relay, bucket):
    """Pools of one layout (each on a slot of its own) planned once and stamped: every
    pool lands bit for bit, relays keep their rule, without relays the bytes are those of
    the whole side planned at once."""
    shape = (72, 10)
    src = tp_side("train", tp_s, dp_s, 1, shape, 0, 0)
    src += tp_side("train", tp_s, dp_s, 1, (72,), 0, 0, name="bias")
    dst = []
    for p in range(pools):
        side = tp_side(f"inf{p}", tp_d, dp_d, 1, shape, 0, 0)
        side += tp_side(f"inf{p}", tp_d, dp_d, 1, (72,), 0, 0, name="bias")
        dst += [dataclasses.replace(s, slot=100 + p) for s in side]
    config = PlanConfig(bucket_bytes=bucket, relay=relay, stamp_min_specs=0)
    plan = run_and_check(src, dst, config)
    whole = run_and_check(src, dst, dataclasses.replace(config, stamp_pools=False))
    assert whole.stats.pools_stamped == 0
    assert plan.stats.pools_stamped in ((0, pools) if relay else (pools,))
    relays = sum(1 for s in plan.slots() for c in plan.program(s).local if c.src_tensor >= len(src))
    assert check_relay_rule(plan, len(src)) == plan.stats.relay_copies + relays
    s, w = plan.stats, whole.stats
    # (relays change which copies are local, and so the alignment counted)
    assert relay or (s.total_bytes, s.max_recv_bytes) == (w.total_bytes, w.max_recv_bytes)
    # pools this small are planned whole unless told otherwise
    assert build_plan("m", 1, src, dst, PlanConfig(relay=relay)).stats.pools_stamped == 0
