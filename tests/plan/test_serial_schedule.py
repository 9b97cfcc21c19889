"""PlanConfig(schedule="serial"): rounds from a one-transfer-per-slot list schedule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refitd.bench.simulate.linkmodel import (
    ExecMode,
    Topology,
    lower_bound,
    messages_from_plan,
    simulate,
)
from refitd.plan import buckets as bk
from refitd.plan.errors import PlanError
from refitd.plan.planner import PlanConfig

from .oracle import run_and_check
from .test_relays import FEW, _expert_side, check_relay_rule


def test_serial_rounds_by_hand() -> None:
    # pairs: A 0->2 (messages 4, 2 bytes), B 1->2 (4), C 0->3 (2, 2); the largest ready
    # pair goes first: A at 0; then B and C both wait for A's ends and start at 6
    rounds = bk.serial_rounds(
        np.array([0, 1, 0]),
        np.array([2, 2, 3]),
        np.array([0, 0, 1, 2, 2]),
        np.array([4, 2, 4, 2, 2]),
        4,
    )
    # starts 0, 4 | 6 | 6, 8 -> ranks
    assert rounds.tolist() == [0, 1, 2, 2, 3]


def test_unknown_schedule_is_refused_and_schedule_is_in_the_digest() -> None:
    from refitd.plan.planner import plan_digest

    with pytest.raises(PlanError, match="unknown schedule 'fast'"):
        PlanConfig(schedule="fast")
    src = _expert_side("train", (1,), 2, 1, 4, (4, 6), 0)
    dst = _expert_side("inf", (1,), 2, 2, 4, (4, 6), 100)
    assert plan_digest("m", src, dst, PlanConfig()) != plan_digest(
        "m", src, dst, PlanConfig(schedule="serial")
    )


@FEW
@given(
    stages=st.sampled_from([(2, 1), (3, 2, 2), (1,)]),
    ep_s=st.sampled_from([2, 4]),
    ep_d=st.sampled_from([2, 4]),
    edp_d=st.sampled_from([1, 2, 4]),
    bucket=st.sampled_from([48, 1 << 20]),
    relay=st.booleans(),
)
def test_serial_plans_land_bit_for_bit(stages, ep_s, ep_d, edp_d, bucket, relay):
    experts, shape = 8, (4, 6)
    src = _expert_side("train", stages, ep_s, 1, experts, shape, 0)
    dst = _expert_side("inf", (sum(stages),), ep_d, edp_d, experts, shape, 100)
    cfg = PlanConfig(bucket_bytes=bucket, relay=relay, schedule="serial")
    plan = run_and_check(src, dst, cfg)
    check_relay_rule(plan, len(src))
    m = messages_from_plan(plan)
    direct = ~m.relay
    # every slot meets at most one direct message per round, sending or receiving
    key = np.r_[m.src[direct] << 32 | m.round[direct], m.dst[direct] << 32 | m.round[direct]]
    assert np.unique(key).size == key.size
    if relay:
        return
    # a slot-serial executor (NCCL stream) runs exactly the list schedule: its makespan is
    # the schedule's length (bytes of the busiest chain) over the link rate
    topo = Topology.gpu_hosts(200, nic_gbit=8.0)  # 1 GB/s; sources and pools on other hosts
    pair = np.unique(m.src << 32 | m.dst, return_inverse=True)[1]
    ps = np.zeros(pair.max() + 1, np.int64)
    pd = np.zeros_like(ps)
    ps[pair], pd[pair] = m.src, m.dst
    nb = np.bincount(pair, weights=m.nbytes).astype(np.int64)
    start = np.array(bk._list_schedule(ps.tolist(), pd.tolist(), nb.tolist(), 200))
    t = simulate(m, topo, ExecMode.STREAM).makespan
    assert t == pytest.approx((start + nb).max() / 1e9, rel=1e-9)
    assert t >= lower_bound(m, topo).seconds * (1 - 1e-9)
