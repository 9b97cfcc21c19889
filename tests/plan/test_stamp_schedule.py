"""Stamped pools bucketed and scheduled once: the first pool's messages on every pool."""

from __future__ import annotations

import dataclasses

import numpy as np

from refitd.plan.planner import PlanConfig

from .oracle import run_and_check
from .test_layouts_plan import tp_side
from .test_relays import check_relay_rule


def _side(pool: str, tp: int, dp: int, base: int) -> list:
    """Four tensors sharded tp ways along dim 0, dp replicas, slots from `base`."""
    return [s for i in range(4) for s in tp_side(pool, tp, dp, 1, (96, 16), 0, base, f"w{i}")]


def test_stamped_schedule_moves_what_the_whole_plan_moves():
    """Three pools of tp=2 x dp=4 from tp=4 x dp=2 with relays and 256-byte buckets
    (copies cut into pieces, relays forwarding pieces): every pool lands bit for bit,
    every relay reads what smaller rounds wrote on its slot, each pair has one message a
    round, and each pool receives the bytes the whole plan sends it, in the first pool's
    messages."""
    src = _side("train", 4, 2, 0)
    dst = [s for p in range(3) for s in _side(f"inf{p}", 2, 4, 100 + 10 * p)]
    config = PlanConfig(bucket_bytes=256, relay=True, stamp_min_specs=0)
    plan = run_and_check(src, dst, config)
    whole = run_and_check(src, dst, dataclasses.replace(config, stamp_pools=False))
    assert (plan.stats.pools_stamped, whole.stats.pools_stamped) == (3, 0)
    assert plan.stats.relay_copies > 0
    check_relay_rule(plan, len(src))
    assert plan.stats.total_bytes == whole.stats.total_bytes
    received = [plan.recv_bytes(), whole.recv_bytes()]
    for p in range(3):
        slots = range(100 + 10 * p, 108 + 10 * p)
        assert sum(received[0].get(s, 0) for s in slots) == sum(
            received[1].get(s, 0) for s in slots
        )
    sizes = []
    for p in range(3):
        progs = [plan.program(100 + 10 * p + r) for r in range(8)]
        sizes.append(sorted(int(b) for g in progs for b in g.recv.nbytes))
    assert sizes[0] == sizes[1] == sizes[2]
    for slot in range(8):  # a source sends on its `fanout` lanes, whatever the pools
        per_round = np.bincount(plan.program(slot).send.round)
        assert per_round.max() <= config.fanout, f"source slot {slot}: {per_round}"
    assert plan.stats.rounds < 2 * whole.stats.rounds  # pools merged on the lanes
