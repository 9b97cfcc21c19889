"""Transfer processes (spawned) refitting shared-memory tensors of this process over Gloo."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _transport_layouts import (
    expected,
    fill_sources,
    global_tensor,
    globals_for,
    local_from_global,
    make_model,
    megatron_side,
)

from refitd.memory.arena import SharedTensorArena
from refitd.memory.errors import StorageMovedError
from refitd.node.process_handle import TransferProcessError, TransferProcessHandle
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import encode_program
from refitd.slot_protocol import Connect, ExecReport, Execute, Load, Ping

pytestmark = pytest.mark.slow
SLOTS = 3


@pytest.fixture(scope="module")
def procs():
    handles = [TransferProcessHandle(slot) for slot in range(SLOTS)]
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    yield handles, store
    for h in handles:
        h.close()


def _connect(handles, store, epoch, world, timeout=20.0):
    pending = [
        h.send(Connect(epoch, "127.0.0.1", store.port, h.slot, world, "gloo", timeout))
        for h in handles
    ]
    errors = []
    for p in pending:
        try:
            p.result()
        except TransferProcessError as e:
            errors.append(e)
    return errors


def _refit(handles, digest, timeout=30.0):
    pending = [h.send(Execute(digest, 1, 1, timeout)) for h in handles]
    out = []
    for p in pending:
        try:
            out.append(p.result().report)
        except (TransferProcessError, StorageMovedError) as e:
            out.append(e)
    return out


def test_refit_between_layouts_then_moved_storage_then_absent_peer(procs) -> None:
    handles, store = procs
    assert _connect(handles, store, epoch=1, world=SLOTS) == []
    # source TP=2 on slots 0,1; destination TP=3 on slots 2,0,1 (uneven, other split dims)
    src, dst = make_model(2, 3, [0, 1], [2, 0, 1], {"col": "float32"})
    g = globals_for(11)
    arena = SharedTensorArena(prefix="refitd-test")
    try:
        tensors = fill_sources(src, g)
        tensors += [torch.zeros(d.local_shape, dtype=getattr(torch, d.dtype)) for d in dst]
        objs = list(tensors)
        mem = arena.register({f"t{i}": t for i, t in enumerate(tensors)})
        assert all(o is t for o, t in zip(objs, tensors, strict=True))
        plan = build_plan("m", 1, src, dst, PlanConfig(bucket_bytes=2048, allow_dtype_cast=True))
        for h in handles:
            p = plan.program(h.slot)
            load = Load(
                plan.digest,
                encode_program(p),
                {i: mem[f"t{i}"].to_bytes() for i in p.tensors},
                staging_bytes=2048,
                wire_chunk=512,
            )
            h.send(load).result()
        for seed in (11, 12):  # the second refit replays the cached program on new weights
            g = globals_for(seed)
            for t, v in zip(tensors, fill_sources(src, g), strict=False):
                t.copy_(v)
            reports = _refit(handles, plan.digest)
            assert all(isinstance(r, ExecReport) for r in reports), reports
            for i, d in enumerate(dst):
                assert torch.equal(tensors[len(src) + i], expected(d, g)), (d.name, d.rank)
        assert all(r.staging_peak_bytes <= 2048 for r in reports)
        assert sum(m.zero_copy_chunks for r in reports for m in r.messages) > 0
        assert sum(m.staged_chunks for r in reports for m in r.messages) > 0

        # a worker's storage moves: the slot holding it refuses, naming the tensor
        moved = len(src) + 1  # destination "col" rank 1, on slot 0
        with torch.no_grad():
            tensors[moved].set_(torch.zeros_like(tensors[moved]))
        assert arena.check_unmoved() == [f"t{moved}"]
        t0 = time.monotonic()
        reports = _refit(handles, plan.digest, timeout=3.0)
        assert isinstance(reports[0], StorageMovedError) and f"t{moved}" in str(reports[0])
        assert all(isinstance(r, Exception) for r in reports[1:])  # peers time out, no hang
        assert time.monotonic() - t0 < 20
    finally:
        arena.close()

    # a new epoch where one rank never shows up: every connect fails within its timeout
    t0 = time.monotonic()
    errors = _connect(handles, store, epoch=2, world=SLOTS + 1, timeout=3.0)
    assert len(errors) == SLOTS
    assert time.monotonic() - t0 < 20


# (name, global shape, TP dim): dim 0 splits are contiguous (zero-copy), dim 1 are staged
RELAY_MODEL = [("w", (96, 40), 0), ("r", (30, 64), 1), ("b", (72,), 0)]


@pytest.mark.parametrize(
    "case",
    [
        # one source slot feeds four destination replicas on slots 1, 2: they relay remotely
        ("remote", [("train", 1, 1, [0]), ("a", 2, 1, [1, 2]), ("b", 2, 2, [2, 1, 1, 2])]),
        # two replicas on slot 2: one receives, the other is filled by local relay copies
        ("local", [("train", 2, 1, [0, 1]), ("a", 1, 2, [2, 2])]),
        # two pools of one layout: planned once, stamped onto the other, relays within each
        ("stamped", [("train", 1, 1, [0]), ("a", 2, 4, [1] * 8), ("b", 2, 4, [2] * 8)]),
    ],
)
def test_relay_plans_bit_for_bit(procs, case) -> None:
    handles, store = procs
    kind, sides = case
    assert _connect(handles, store, epoch=10 + len(kind), world=SLOTS) == []
    (src_pool, tp, dp, slots), *dst_sides = sides
    src = megatron_side(src_pool, tp, dp, RELAY_MODEL, slots)
    dst = [
        s
        for pool, tp, dp, slots in dst_sides
        for s in megatron_side(pool, tp, dp, RELAY_MODEL, slots)
    ]
    plan = build_plan(
        "m", 1, src, dst, PlanConfig(bucket_bytes=1024, relay=True, stamp_min_specs=0)
    )
    programs = {h.slot: plan.program(h.slot) for h in handles}
    local_relays = sum(c.src_tensor >= len(src) for p in programs.values() for c in p.local)
    if kind == "remote":
        assert plan.stats.relay_copies > 0
    else:
        assert local_relays > 0
    assert plan.stats.pools_stamped == (2 if kind == "stamped" else 0)
    arena = SharedTensorArena(prefix="refitd-test")
    try:
        tensors = [torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in (*src, *dst)]
        mem = arena.register({f"t{i}": t for i, t in enumerate(tensors)})
        for h in handles:
            p = programs[h.slot]
            load = Load(
                plan.digest,
                encode_program(p),
                {i: mem[f"t{i}"].to_bytes() for i in p.tensors},
                staging_bytes=1024,
                wire_chunk=256,
            )
            h.send(load).result()
        for seed in (21, 22):  # new weights each refit: a stale relay would show
            g = {name: global_tensor(name, shape, seed) for name, shape, _ in RELAY_MODEL}
            for i, s in enumerate(src):
                tensors[i].copy_(local_from_global(s, g[s.name]))
            reports = _refit(handles, plan.digest)
            assert all(isinstance(r, ExecReport) for r in reports), reports
            for j, d in enumerate(dst):
                got = tensors[len(src) + j]
                assert torch.equal(got, local_from_global(d, g[d.name])), (d.pool, d.rank, d.name)
        staged = sum(m.staged_chunks for r in reports for m in r.messages)
        assert staged > 0 and all(r.staging_peak_bytes <= 1024 for r in reports)
    finally:
        arena.close()


def test_a_command_goes_while_another_waits_for_its_report(procs) -> None:
    """While a thread waits for a running refit's report, a command to the same transfer
    process goes and its answer comes back at once: the waiter's poll of the pipe holds
    nothing the sender needs (a second model's refit starts without waiting on the first's)."""
    handles, store = procs
    assert _connect(handles, store, epoch=30, world=SLOTS) == []
    src, dst = make_model(2, 3, [0, 1], [2, 0, 1], {"col": "float32"})
    arena = SharedTensorArena(prefix="refitd-test")
    try:
        g = globals_for(31)
        tensors = fill_sources(src, g)
        tensors += [torch.zeros(d.local_shape, dtype=getattr(torch, d.dtype)) for d in dst]
        mem = arena.register({f"t{i}": t for i, t in enumerate(tensors)})
        plan = build_plan("m", 1, src, dst, PlanConfig(allow_dtype_cast=True))
        for h in handles:
            p = plan.program(h.slot)
            h.send(
                Load(
                    plan.digest, encode_program(p), {i: mem[f"t{i}"].to_bytes() for i in p.tensors}
                )
            ).result()
        first = handles[0].send(Execute(plan.digest, 1, 1, 30.0))  # blocks: its peers wait
        got: list[object] = []
        waiter = threading.Thread(target=lambda: got.append(first.result()), daemon=True)
        waiter.start()
        seconds = []
        for _ in range(20):
            t0 = time.monotonic()
            handles[0].send(Ping()).result(timeout_s=10.0)
            seconds.append(time.monotonic() - t0)
        rest = [h.send(Execute(plan.digest, 1, 1, 30.0)) for h in handles[1:]]
        assert all(isinstance(p.result().report, ExecReport) for p in rest)
        waiter.join(30.0)
        assert got and isinstance(got[0].report, ExecReport)  # type: ignore[attr-defined]
        for i, d in enumerate(dst):
            assert torch.equal(tensors[len(src) + i], expected(d, g)), (d.name, d.rank)
        assert sum(seconds) < 0.3, seconds  # 20 pings
    finally:
        arena.close()
