"""Snapshot release in real transfer processes over Gloo: the source slot copies what it
reads, releases the trainer before any byte is sent, and sends the snapshot.

The source slot's sends need the destination slot, which starts executing only after the
trainer got its release and overwrote its weights: without a snapshot the release could
not come first (sends block on the peer), and a snapshot taken wrongly would send the
overwritten bytes.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from _transport_layouts import expected, fill_sources, globals_for, make_model

from refitd.memory.arena import SharedTensorArena
from refitd.node.process_handle import TransferProcessHandle
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import encode_program
from refitd.slot_protocol import Connect, Execute, Load, SnapshotInfo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair():
    handles = [TransferProcessHandle(slot) for slot in (0, 1)]
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    pend = [h.send(Connect(1, "127.0.0.1", store.port, h.slot, 2, "gloo", 30.0)) for h in handles]
    for p in pend:
        p.result()
    yield handles
    for h in handles:
        h.close()


def _setup(handles, arena, cap: int, digest_seed: int):
    # sources: one rank on slot 0; destinations TP=2 on slots 1 (sends) and 0 (local copies)
    src, dst = make_model(1, 2, [0], [1, 0], {"col": "float32"})
    tensors = fill_sources(src, globals_for(digest_seed))
    tensors += [torch.zeros(d.local_shape, dtype=getattr(torch, d.dtype)) for d in dst]
    mem = arena.register({f"t{i}": t for i, t in enumerate(tensors)})
    plan = build_plan("snap", digest_seed, src, dst, PlanConfig(allow_dtype_cast=True))
    replies = {}
    for h in handles:
        prog = plan.program(h.slot)
        load = Load(
            plan.digest,
            encode_program(prog),
            {i: mem[f"t{i}"].to_bytes() for i in prog.tensors},
            snapshot=tuple(range(len(src))),
            snapshot_bytes=cap,
        )
        replies[h.slot] = h.send(load).result()
    return src, dst, tensors, plan, replies


def _refit_overwriting_after_release(handles, src, tensors, plan, refit_id: int, seed: int):
    """Start the source slot alone; on its release overwrite the sources with `seed`'s
    weights, then start the destination slot. Returns the source slot's report."""
    released = threading.Event()
    p0 = handles[0].send(Execute(plan.digest, refit_id, refit_id, 60.0))
    got: dict = {}

    def wait0() -> None:
        got["r"] = p0.result(lambda m: released.set())

    t = threading.Thread(target=wait0)
    t.start()
    assert released.wait(30), "the source slot did not release before its peer started"
    for dst_t, v in zip(tensors, fill_sources(src, globals_for(seed)), strict=False):
        dst_t.copy_(v)  # the trainer's next step writes its weights
    r1 = handles[1].send(Execute(plan.digest, refit_id, refit_id, 60.0)).result()
    t.join(70)
    return got["r"], r1


def test_snapshot_sends_the_version_asked_for_while_the_trainer_writes(pair) -> None:
    handles = pair
    arena = SharedTensorArena(prefix="refitd-snaptest")
    try:
        src, dst, tensors, plan, replies = _setup(handles, arena, 1 << 30, 21)
        assert replies[0].snapshot.fallback == ""
        assert replies[0].snapshot.bytes >= sum(t.nbytes for t in tensors[: len(src)])
        for refit_id, (version_seed, next_seed) in enumerate([(21, 22), (23, 24)], start=1):
            for t, v in zip(tensors, fill_sources(src, globals_for(version_seed)), strict=False):
                t.copy_(v)
            r0, r1 = _refit_overwriting_after_release(
                handles, src, tensors, plan, refit_id, next_seed
            )
            assert r0.snapshot.bytes > 0 and r0.report.sent_bytes > 0 and r0.report.local_bytes > 0
            assert r1.report.recv_bytes == r0.report.sent_bytes
            g = globals_for(version_seed)
            for i, d in enumerate(dst):
                assert torch.equal(tensors[len(src) + i], expected(d, g)), (d.name, d.rank)
    finally:
        arena.close()


def test_snapshot_over_the_cap_reads_live_memory_and_says_why(pair) -> None:
    handles = pair
    arena = SharedTensorArena(prefix="refitd-snaptest")
    try:
        src, dst, tensors, plan, replies = _setup(handles, arena, 256, 31)
        why = replies[0].snapshot.fallback
        assert "exceeds snapshot_bytes 256" in why, replies[0]
        pend = [h.send(Execute(plan.digest, 1, 1, 60.0)) for h in handles]
        reports = [p.result() for p in pend]
        assert reports[0].snapshot == SnapshotInfo(0, why)
        g = globals_for(31)
        for i, d in enumerate(dst):
            assert torch.equal(tensors[len(src) + i], expected(d, g)), (d.name, d.rank)
    finally:
        arena.close()
