"""One-sided receives complete as they land (real Mooncake engines over TCP on loopback,
the transfer slots' own handlers). Two tp=1 replica pools each take one trainer rank's
half and relay it to the other, round after round; the pools' receives interleave trainer
chunks and the other pool's relay chunks. A pool that has not started yet writes no relay
chunk, yet the other pool forwards every byte of its trainer rank meanwhile: a receive that
lands late holds back only the relays it feeds, never the chunks posted after it."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from _slots import Slots, checksum_mismatch
from _transport_layouts import expected, fill_sources, shard, spec

from refitd.plan.links import LinkPolicy, SlotSite
from refitd.plan.planner import PlanConfig, build_plan
from refitd.slot_protocol import Execute
from refitd.transport.mooncake_env import mooncake_unavailable_reason

REASON = mooncake_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"rdma path: {REASON}")
SHAPES = {"w": (64, 32), "v": (48, 32)}  # split by rows: every region is contiguous


def test_a_late_relay_holds_back_only_what_it_feeds() -> None:
    import torch

    # trainer tp=2 (slots 0, 1) -> two tp=1 replicas (slots 2, 3): 2 takes rank 0's half,
    # 3 rank 1's, each relays its half to the other in the next round (1 KiB buckets)
    src = [spec("train", n, sh, 0, 2, r, r, "bfloat16") for n, sh in SHAPES.items()
           for r in range(2)]  # fmt: skip
    dst = [spec("infer", n, sh, 0, 1, 0, 2, "bfloat16") for n, sh in SHAPES.items()]
    dst += [dataclasses.replace(d, pool="infer2", slot=3) for d in dst]
    sites = [SlotSite(s, "h0", "cpu", ("rdma",)) for s in range(4)]
    plan = build_plan("m", 1, src, dst, PlanConfig(1024, relay=True,
                                                   links=LinkPolicy.of("rdma", sites)))  # fmt: skip
    gen = torch.Generator().manual_seed(28)
    g = {n: torch.randn(sh, generator=gen).to(torch.bfloat16) for n, sh in SHAPES.items()}
    tensors = fill_sources(src, g) + [torch.zeros(d.local_shape, dtype=torch.bfloat16)
                                      for d in dst]  # fmt: skip
    n = len(src)
    late = {d.name: tensors[n + k] for k, d in enumerate(dst) if d.slot == 3}

    def rank0_forwarded() -> bool:
        """Slot 3 (tp=1: its tensors are the global ones) holds all of rank 0's half,
        which only slot 2's relays write there."""
        return all(torch.equal(shard(late[s.name], s), shard(g[s.name], s))
                   for s in src if s.slot == 0)  # fmt: skip

    h = Slots(range(4))
    results: dict[int, object] = {}

    def run(slot: int) -> None:
        try:
            cmd = Execute(plan.digest, 1, 41, 60.0, verify=True)
            results[slot] = h.state[slot].execute(cmd, lambda: None)
        except BaseException as e:  # reported below
            results[slot] = e

    threads = {s: threading.Thread(target=run, args=(s,), daemon=True) for s in range(4)}
    try:
        h.register(src + dst, tensors)
        h.connect()
        h.load(plan, chunk=256)
        for s in (0, 1, 2):  # slot 3 writes no relay chunk yet
            threads[s].start()
        until = time.monotonic() + 15.0
        while not rank0_forwarded() and time.monotonic() < until:
            time.sleep(0.005)  # polls slot 3's memory (the condition), bounded above
        forwarded = rank0_forwarded()
        threads[3].start()
        for t in threads.values():
            t.join(90.0)
        assert not any(t.is_alive() for t in threads.values()), "a slot hung"
        bad = {s: r for s, r in results.items() if isinstance(r, BaseException)}
        assert not bad, bad
        assert forwarded, "slot 2 held rank 0's bytes back until slot 3's relays landed"
        assert checksum_mismatch(plan, results) is None
        for k, d in enumerate(dst):
            assert torch.equal(tensors[n + k], expected(d, g)), (d.pool, d.name)
    finally:
        for t in threads.values():
            if t.is_alive():
                t.join(90.0)
        h.close()
