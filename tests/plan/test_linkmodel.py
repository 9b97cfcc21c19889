"""The link model (refitd.bench.simulate.linkmodel) on cases whose times follow by hand,
and on plans."""

from __future__ import annotations

import numpy as np
import pytest

from refitd.bench.simulate.linkmodel import (
    ExecMode,
    MessageTable,
    Sharing,
    Topology,
    fair_rates,
    lower_bound,
    messages_from_plan,
    simulate,
)
from refitd.plan.layout import TensorSpec
from refitd.plan.layouts import megatron_layout
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import Copy

GB = 10**9
HUGE = 1 << 50  # one chunk per message
# 16 slots on two hosts of 8; each NIC 1 GB/s per direction, NVLink 4 GB/s
TOPO = Topology.gpu_hosts(16, 8, nic_gbit=8.0, nvlink_gbyte=4.0)
ALL = list(ExecMode)


def run(msgs: MessageTable, mode: ExecMode, topo: Topology = TOPO) -> float:
    return simulate(msgs, topo, mode, chunk_bytes=HUGE).makespan


@pytest.mark.parametrize("mode", ALL)
def test_one_flow_runs_at_the_nic_rate(mode: ExecMode) -> None:
    assert run(MessageTable.of([0], [8], [0], [3 * GB]), mode) == pytest.approx(3.0)


@pytest.mark.parametrize("mode", ALL)
def test_two_flows_into_one_nic_take_twice_as_long(mode: ExecMode) -> None:
    one = run(MessageTable.of([0], [8], [0], [GB]), mode)
    two = MessageTable.of([0, 1], [8, 8], [0, 0], [GB, GB])
    assert run(two, mode) == pytest.approx(2 * one)
    # different receivers: no sharing, and the NIC is full duplex (8 sends while receiving)
    apart = MessageTable.of([0, 1, 8], [8, 9, 0], [0, 0, 0], [GB, GB, GB])
    assert run(apart, ExecMode.POSTED) == pytest.approx(one)


def test_fair_shares_are_max_min() -> None:
    # flows (out, in): f0 (a, x), f1 (a, y), f2 (b, y); a holds 1, x 1, y 3, b 3:
    # a is the bottleneck of f0 and f1 (0.5 each), f2 takes what y and b leave (2.5)
    cap = np.array([1.0, 1.0, 3.0, 3.0])  # a, x, y, b
    rates = fair_rates(np.array([0, 0, 3]), np.array([1, 2, 2]), cap)
    np.testing.assert_allclose(rates, [0.5, 0.5, 2.5])


def test_a_shared_host_nic_is_shared_fairly() -> None:
    # two slots on host 0 behind one NIC send to two hosts: each gets half the NIC
    topo = Topology.host_nics(np.array([0, 0, 1, 2]), nic_gbit=8.0)
    m = MessageTable.of([0, 1], [2, 3], [0, 0], [GB, GB])
    assert run(m, ExecMode.POSTED, topo) == pytest.approx(2.0)
    assert lower_bound(m, topo).seconds == pytest.approx(2.0)


def test_rounds_serialise_on_a_stream() -> None:
    # slot 0 sends to 8 in round 0 and to 9 in round 1: one stream moves one at a time
    m = MessageTable.of([0, 0], [8, 9], [0, 1], [GB, GB])
    assert run(m, ExecMode.STREAM) == pytest.approx(2.0)
    assert run(m, ExecMode.GROUP) == pytest.approx(2.0)
    # a stream does not send and receive at once: 0 -> 8, then 1 -> 8 and 8 -> 2 (round 1)
    chain = MessageTable.of([0, 1, 8], [8, 8, 2], [0, 1, 1], [GB, GB, GB])
    assert run(chain, ExecMode.STREAM) == pytest.approx(3.0)
    assert run(chain, ExecMode.POSTED) == pytest.approx(2.0)
    # posted (Gloo): all at once, NIC of slot 0 shared by its two sends
    assert run(m, ExecMode.POSTED) == pytest.approx(2.0)
    assert run(MessageTable.of([0, 1], [8, 9], [0, 1], [GB, GB]), ExecMode.POSTED) == (
        pytest.approx(1.0)
    )


def test_group_mode_moves_a_steps_chunks_together() -> None:
    # round 0: 0 -> 8 and 1 -> 9 (2 GB each), round 1: 8 -> 0; group waits for its step
    m = MessageTable.of([0, 1, 8], [8, 9, 0], [0, 0, 1], [2 * GB, 2 * GB, GB])
    assert run(m, ExecMode.GROUP) == pytest.approx(3.0)
    assert run(m, ExecMode.POSTED) == pytest.approx(2.0)


def test_relay_waits_for_the_receives_of_smaller_rounds() -> None:
    # 0 -> 8 in round 0, then 8 relays it to 1 in round 1: the relay cannot overlap
    m = MessageTable.of([0, 8], [8, 1], [0, 1], [GB, GB], relay=[False, True])
    assert run(m, ExecMode.POSTED) == pytest.approx(2.0)
    # without the relay flag (direct data), both move at once
    assert run(MessageTable.of([0, 8], [8, 1], [0, 1], [GB, GB]), ExecMode.POSTED) == (
        pytest.approx(1.0)
    )


def test_relay_waits_only_for_the_receives_feeding_it() -> None:
    # slot 8 receives A (0 -> 8, 1 GB) and B (1 -> 8, 2 GB) in round 0, sharing its NIC;
    # A ends at 2 s, B at 3 s. The relay 8 -> 2 forwards A only: as the executor, it waits
    # for the receives up to A (posting order: round, chunk, id) and ends at 3 s; without
    # its feeds known it waits for every receive of a smaller round and ends at 4 s.
    cols = ([0, 1, 8], [8, 8, 2], [0, 0, 1], [GB, 2 * GB, GB], [False, False, True])
    assert run(MessageTable.of(*cols, feeds=([2], [0])), ExecMode.POSTED) == pytest.approx(3.0)
    assert run(MessageTable.of(*cols), ExecMode.POSTED) == pytest.approx(4.0)
    # fed by B, the later receive: the prefix holds both
    assert run(MessageTable.of(*cols, feeds=([2], [1])), ExecMode.POSTED) == pytest.approx(4.0)


def test_uneven_sharing_serves_one_receiver_first() -> None:
    # slots 0 and 1 share host 0's NIC; A 0 -> 8 and B 1 -> 9 (1 GB each), then 8 relays
    # A to 9 (round 1). Fair: A and B share the NIC and end at 2 s, the relay at 3 s.
    # Uneven: A (the lower receiver) runs alone and ends at 1 s, then B at 2 s; the relay
    # is fed at 1 s but 9's NIC serves B first (ties: chunk order), so it ends at 3 s.
    topo = Topology.host_nics(np.r_[0, 0, np.arange(8) + 1], nic_gbit=8.0)
    cols = ([0, 1, 8], [8, 9, 9], [0, 0, 1], [GB, GB, GB], [False, False, True])
    m = MessageTable.of(*cols, feeds=([2], [0]))
    fair = simulate(m, topo, ExecMode.POSTED, chunk_bytes=HUGE)
    uneven = simulate(m, topo, ExecMode.POSTED, chunk_bytes=HUGE, sharing=Sharing.UNEVEN)
    assert fair.finish.tolist() == pytest.approx([2.0, 2.0, 3.0])
    assert uneven.finish.tolist() == pytest.approx([1.0, 2.0, 3.0])


def test_nvlink_inside_a_host_nic_across() -> None:
    inside = MessageTable.of([0], [1], [0], [4 * GB])
    across = MessageTable.of([0], [8], [0], [4 * GB])
    assert run(inside, ExecMode.STREAM) == pytest.approx(1.0)
    assert run(across, ExecMode.STREAM) == pytest.approx(4.0)
    b = lower_bound(MessageTable.of([0, 0], [1, 8], [0, 0], [4 * GB, 4 * GB]), TOPO)
    assert b.nvlink_send_max == 4 * GB and b.nic_send_max == 4 * GB
    assert b.seconds == pytest.approx(4.0) and b.resource == "nic 0 send"


def test_bound_is_the_busiest_resource() -> None:
    # slot 8 receives 3 GB over its NIC; slot 0 sends 2 GB; slot 9 receives 8 GB by NVLink
    m = MessageTable.of([0, 0, 1, 10], [8, 9, 8, 9], [0, 0, 0, 0], [GB, GB, 2 * GB, 8 * GB])
    b = lower_bound(m, TOPO)
    assert b.nic_recv_max == 3 * GB and b.nic_send_max == 2 * GB
    assert b.nvlink_recv_max == 8 * GB
    assert b.seconds == pytest.approx(3.0) and b.resource == "nic 8 recv"
    for mode in ALL:
        assert run(m, mode) >= b.seconds * (1 - 1e-9)


def test_chunks_interleave_in_the_executors_order() -> None:
    # two 2-chunk messages from slot 0 in one round: chunk 0 of both, then chunk 1 of both;
    # receiver 9's chunks thus end at 2 and 4, receiver 8's at 1 and 3
    m = MessageTable.of([0, 0], [8, 9], [0, 0], [2 * GB, 2 * GB])
    r = simulate(m, TOPO, ExecMode.STREAM, chunk_bytes=GB)
    np.testing.assert_allclose(r.finish, [1.0, 2.0, 3.0, 4.0])


def test_stream_one_pass_equals_the_event_loop() -> None:
    rng = np.random.default_rng(7)
    n = 300
    s = rng.integers(0, 16, n)
    d = (s + rng.integers(1, 16, n)) % 16
    m = MessageTable.of(s, d, rng.integers(0, 12, n), rng.integers(1, 4 * 10**8, n))
    fast = simulate(m, TOPO, ExecMode.STREAM, chunk_bytes=1 << 27)
    slow = simulate(m, TOPO, ExecMode.STREAM, chunk_bytes=1 << 27, fast=False)
    np.testing.assert_allclose(fast.finish, slow.finish, rtol=1e-9)
    assert slow.events > 1


def _specs(pool: str, tp: int, slot0: int, rows: int = 256) -> list[TensorSpec]:
    out = []
    for r in range(tp):
        for k, dim in enumerate((0, 1)):
            shape = (rows, 128)
            lay = megatron_layout(shape, tp_rank=r, tp_size=tp, partition_dim=dim)
            name = f"w{k}"
            out.append(
                TensorSpec(
                    "m",
                    pool,
                    r,
                    slot0 + r,
                    name,
                    name,
                    shape,
                    "bfloat16",
                    lay.local_shape,
                    lay.boxes,
                )
            )
    return out


def test_adapter_matches_the_slot_programs() -> None:
    # two destination pools (replicas) so relays appear
    src = _specs("trainer", 2, 0)
    dst = _specs("a", 4, 2) + _specs("b", 4, 6)
    plan = build_plan("m", 0, src, dst, PlanConfig(bucket_bytes=4096, relay=True))
    msgs = messages_from_plan(plan)
    rows = []
    for slot in plan.slots():
        p = plan.program(slot)
        dest = {c.dst_tensor for m in p.recvs for c in m.copies}
        for m in p.sends:
            rows.append(
                (
                    m.id,
                    m.src_slot,
                    m.dst_slot,
                    m.round,
                    m.nbytes,
                    any(c.src_tensor in dest for c in m.copies),
                )
            )
    rows.sort()
    assert len(rows) == msgs.src.size
    got = list(zip(msgs.id, msgs.src, msgs.dst, msgs.round, msgs.nbytes, msgs.relay, strict=True))
    assert [tuple(int(x) for x in r) for r in got] == [tuple(int(x) for x in r) for r in rows]


def _regions_overlap(a: Copy, b: Copy) -> bool:
    """a's source region meets b's destination region (same tensor)."""
    return a.src_tensor == b.dst_tensor and all(
        ao < bo + bn and bo < ao + an
        for ao, an, bo, bn in zip(a.src_offset, a.shape, b.dst_offset, b.shape, strict=True)
    )


def test_relay_feeds_are_the_received_messages_a_relay_reads() -> None:
    src = _specs("trainer", 2, 0)
    dst = _specs("a", 4, 2) + _specs("b", 4, 6)
    plan = build_plan("m", 0, src, dst, PlanConfig(bucket_bytes=4096, relay=True))
    want = set()
    for slot in plan.slots():
        p = plan.program(slot)
        for r in p.sends:
            for m in p.recvs:
                if any(_regions_overlap(a, b) for a in r.copies for b in m.copies):
                    want.add((r.id, m.id))
    relay, feed = plan.relay_feeds()
    assert want and set(zip(relay.tolist(), feed.tolist(), strict=True)) == want
    msgs = messages_from_plan(plan)
    assert set(msgs.feeds[0].tolist()) == set(np.flatnonzero(msgs.relay).tolist())
    assert (msgs.round[feed] < msgs.round[relay]).all()


def test_kimi_k2_plan_simulates_above_its_bound() -> None:
    from refitd.bench.presets import Parallel, build_specs, preset

    model = preset("kimi-k2")
    src = build_specs(model, Parallel.parse("tp=8,pp=8,ep=32", 256), "kimi-k2", "trainer", 0)
    dst = build_specs(model, Parallel.parse("tp=8,ep=32", 128), "kimi-k2", "inference", 256)
    plan = build_plan("kimi-k2", 0, src, dst, PlanConfig(relay=True))
    msgs = messages_from_plan(plan)
    assert msgs.relay.any() and int(msgs.nbytes.sum()) == plan.stats.remote_bytes
    topo = Topology.gpu_hosts(384)
    bound = lower_bound(msgs, topo)
    # every destination GPU receives its shards through its own NIC
    assert bound.nic_recv_max == plan.stats.max_recv_bytes
    r = simulate(msgs, topo, ExecMode.STREAM)
    assert r.makespan >= bound.seconds
    assert r.slot_busy_end.max() == r.makespan


def test_bench_simulate_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from refitd.cli.main import main

    # bench cluster's hosts: every byte leaves the trainer host's one link once
    argv = ["bench", "simulate", "--topology", "cluster", "--mb", "4", "--bucket-mib", "1"]
    assert main([*argv, "--modes", "stream,posted"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    doc = out["bf16"]
    rate = 1e9 / 8 * out["efficiency"]
    assert doc["bound_s"] == pytest.approx(doc["wire_bytes"] / rate, rel=1e-3)
    assert doc["bound_resource"] == "nic 0 send"
    for mode in ("stream", "posted"):
        assert doc[mode]["makespan_s"] >= doc["bound_s"] * (1 - 1e-3)
    # a small preset on GPUs, both wires: MXFP8 puts about half the bytes on the wire
    argv = ["bench", "simulate", "--model", "llama3-8b", "--src", "tp=8", "--src-world", "8"]
    assert main([*argv, "--dst", "tp=4", "--dst-world", "4", "--schedule", "serial"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bf16, mx = out["bf16"], out["mxfp8"]
    assert 0.45 < mx["wire_bytes"] / bf16["wire_bytes"] < 0.6
    for doc in (bf16, mx):
        assert doc["stream"]["ratio_to_bound"] >= 1 - 1e-3
