"""One-sided receives complete as they land and relay chunks go once their own feeds
landed (real Mooncake engines over TCP on loopback, the transfer slots' own handlers): a
slot that has not started yet writes nothing, yet every byte that does not come from it
is forwarded meanwhile, whatever was posted before it."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from _slots import Slots, checksum_mismatch
from _transport_layouts import expected, fill_sources, globals_for, make_model, shard, spec

from refitd.plan.links import LinkPolicy, SlotSite
from refitd.plan.planner import PlanConfig, build_plan
from refitd.slot_protocol import Execute
from refitd.transport.mooncake_env import mooncake_unavailable_reason

REASON = mooncake_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"rdma path: {REASON}")
SHAPES = {"w": (64, 32), "v": (48, 32)}  # split by rows: every region is contiguous


def _late_slot_refit(plan, src, dst, g, late: int, forwarded) -> None:
    """Refit with slot `late` started only once `forwarded()` holds (or 15 s passed); the
    refit then lands bit for bit, and `forwarded` held before the late slot started."""
    tensors = fill_sources(src, g) + [torch.zeros(d.local_shape, dtype=torch.bfloat16)
                                      for d in dst]  # fmt: skip
    n, slots = len(src), sorted({s.slot for s in src + dst})
    h = Slots(slots)
    results: dict[int, object] = {}

    def run(slot: int) -> None:
        try:
            cmd = Execute(plan.digest, 1, 41, 60.0, verify=True)
            results[slot] = h.state[slot].execute(cmd, lambda: None)
        except BaseException as e:  # reported below
            results[slot] = e

    threads = {s: threading.Thread(target=run, args=(s,), daemon=True) for s in slots}
    try:
        h.register(src + dst, tensors)
        h.connect()
        h.load(plan, chunk=256)
        for s in slots:
            if s != late:
                threads[s].start()
        local = {(d.slot, d.name): tensors[n + k] for k, d in enumerate(dst)}
        until = time.monotonic() + 15.0
        while not forwarded(local) and time.monotonic() < until:
            time.sleep(0.005)  # polls the destinations' memory (the condition), bounded above
        early = forwarded(local)
        threads[late].start()
        for t in threads.values():
            t.join(90.0)
        assert not any(t.is_alive() for t in threads.values()), "a slot hung"
        bad = {s: r for s, r in results.items() if isinstance(r, BaseException)}
        assert not bad, bad
        assert early, f"bytes not from slot {late} waited for it"
        assert checksum_mismatch(plan, results) is None
        for k, d in enumerate(dst):
            assert torch.equal(tensors[n + k], expected(d, g)), (d.pool, d.name)
    finally:
        for t in threads.values():
            if t.is_alive():
                t.join(90.0)
        h.close()


def _holds_rank0(src, g, pool_slot: int):
    """Whether a tp=1 replica (its tensors are the global ones) holds all of trainer rank
    0's half."""

    def check(local) -> bool:
        return all(torch.equal(shard(local[(pool_slot, s.name)], s), shard(g[s.name], s))
                   for s in src if s.slot == 0)  # fmt: skip

    return check


def test_a_late_relay_holds_back_only_what_it_feeds() -> None:
    """tp=2 trainer (slots 0, 1) -> two tp=1 replicas (slots 2, 3): 2 takes rank 0's half, 3
    rank 1's, each relays its half to the other in the next round (1 KiB buckets); their
    receives interleave trainer chunks and the other pool's relay chunks. Slot 3 late:
    slot 2 forwards all of rank 0's half meanwhile (into 3's registered memory)."""
    src = [spec("train", n, sh, 0, 2, r, r, "bfloat16") for n, sh in SHAPES.items()
           for r in range(2)]  # fmt: skip
    dst = [spec("infer", n, sh, 0, 1, 0, 2, "bfloat16") for n, sh in SHAPES.items()]
    dst += [dataclasses.replace(d, pool="infer2", slot=3) for d in dst]
    gen = torch.Generator().manual_seed(28)
    g = {n: torch.randn(sh, generator=gen).to(torch.bfloat16) for n, sh in SHAPES.items()}
    _late_slot_refit(_plan(src, dst, 1024), src, dst, g, 3, _holds_rank0(src, g, 3))


def test_relays_fed_by_a_late_rank_let_the_others_pass() -> None:
    """The replicas relay alternately what rank 0 and rank 1 sent (row and column splits,
    strided regions landing packed): rank 1 late, every relay of rank 0's bytes goes."""
    src, dst = make_model(2, 1, [0, 1], [2])
    dst += [dataclasses.replace(d, pool="infer2", slot=3) for d in dst]
    g = globals_for(21)
    _late_slot_refit(_plan(src, dst, 256), src, dst, g, 1, _holds_rank0(src, g, 3))


def _plan(src, dst, bucket: int):
    sites = [SlotSite(s, "h0", "cpu", ("rdma",)) for s in range(4)]
    return build_plan("m", 1, src, dst, PlanConfig(bucket, relay=True,
                                                   links=LinkPolicy.of("rdma", sites)))  # fmt: skip


def test_pieces_to_a_destination_on_the_senders_host_go_joined() -> None:
    """tp=2 -> tp=1 on one host: each rank's 4 MiB halves (one contiguous, one strided that
    lands packed) leave as joined writes (fewer send chunks than the destination's
    receives), and the destination, counting its own chunks, lands them bit for bit."""
    shapes = {"w": ((2048, 2048), 0), "v": ((2048, 2048), 1)}  # bf16, 4 MiB per rank
    src = [spec("train", n, sh, d, 2, r, r, "bfloat16") for n, (sh, d) in shapes.items()
           for r in range(2)]  # fmt: skip
    dst = [spec("infer", n, sh, 0, 1, 0, 2, "bfloat16") for n, (sh, _) in shapes.items()]
    gen = torch.Generator().manual_seed(7)
    g = {n: torch.randn(sh, generator=gen).to(torch.bfloat16) for n, (sh, _) in shapes.items()}
    plan = _plan(src, dst, 64 << 20)
    tensors = fill_sources(src, g) + [torch.zeros(d.local_shape, dtype=torch.bfloat16)
                                      for d in dst]  # fmt: skip
    h = Slots(sorted({s.slot for s in src + dst}))
    try:
        h.register(src + dst, tensors)
        h.connect()
        h.load(plan, chunk=None)
        results = h.execute(plan, 5)
        assert checksum_mismatch(plan, results) is None
        for k, d in enumerate(dst):
            assert torch.equal(tensors[len(src) + k], expected(d, g)), d.name
        recv = len(h.state[2].executor(plan.digest).prepared.recv_chunks)
        sent = sum(len(h.state[s].executor(plan.digest).prepared.send_chunks) for s in (0, 1))
        assert sent < recv, (sent, recv)
    finally:
        h.close()
