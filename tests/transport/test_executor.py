"""Executor over real Gloo (ranks in threads of this process) and local copies."""

from __future__ import annotations

import datetime
import math
import threading

import pytest
import torch
import torch.distributed as dist
from _transport_layouts import expected, fill_sources, globals_for, make_model
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.executor.chunks import (
    DIRECT_MIN,
    RDMA_CHUNK,
    WIRE_CHUNK,
    CopyInfo,
    chunk_messages,
    flat_range_views,
)
from refitd.executor.run import DirectResolver, Executor, ExecutorConfig
from refitd.executor.segments import ResolvedTensor
from refitd.executor.shares import LinkShares, Share
from refitd.memory.errors import StorageMovedError
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import Copy, Message, ProgramError, ProgramTensor, program_from_objects
from refitd.slot_protocol import ExecReport
from refitd.transport.base import ConnectInfo
from refitd.transport.gloo import GlooTransport
from refitd.transport.local import LocalTransport


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    data=st.data(),
)
def test_flat_range_views_cover_the_range_in_order(shape: list[int], data: st.DataObject) -> None:
    base = torch.arange(math.prod(2 * s for s in shape)).reshape([2 * s for s in shape])
    t = base[tuple(slice(0, s * 2, 2) for s in shape)]  # non-contiguous
    n = t.numel()
    e0 = data.draw(st.integers(0, n - 1))
    e1 = data.draw(st.integers(e0 + 1, n))
    views = flat_range_views(t, e0, e1)
    got = torch.cat([v.reshape(-1) for v in views])
    assert torch.equal(got, t.reshape(-1)[e0:e1])
    assert all(v.data_ptr() >= base.data_ptr() for v in views)  # views, not copies


def _chunks(copies, nbytes, wire_chunk, staged_chunk=None, lands=None, direct_min=1 << 40):
    """Chunks of one message 0 -> 1 of bf16 1-D copies between two tensors of 100."""
    m = Message(7, 0, 0, 1, copies, nbytes)
    specs = {
        0: ProgramTensor("a", 0, 0, "bfloat16", "plain", (100,)),
        1: ProgramTensor("b", 0, 1, "bfloat16", "plain", (100,)),
    }
    p = program_from_objects("d", 0, specs, (m,), (), ())
    info = CopyInfo.of(p, direct_min)
    if lands is not None:
        info.lands_direct[:] = lands
    return chunk_messages(p.send, info, wire_chunk, staged_chunk)


def test_chunks_split_large_segments_and_group_small_ones() -> None:
    small = Copy(0, (0,), 1, (0,), (10,))  # 20 bytes -> 32 on the wire
    big = Copy(0, (0,), 1, (0,), (100,))  # 200 bytes
    copies = (small, small, big, small)
    n = 32 + 32 + 208 + 32
    chunks = _chunks(copies, n, wire_chunk=64)
    assert [c.nbytes for c in chunks] == [52, 64, 64, 64, 8, 20]
    assert [len(c.rows) for c in chunks] == [2, 1, 1, 1, 1, 1]
    # segments that are staged on landing are cut finer; direct ones keep wire_chunk
    staged = _chunks(copies, n, 64, 32, lands=[True, True, False, True])
    assert [c.nbytes for c in staged] == [20, 20, 32, 32, 32, 32, 32, 32, 8, 20]
    direct = _chunks(copies, n, 64, 32, lands=True)
    assert [c.nbytes for c in direct] == [20, 20, 64, 64, 64, 8, 20]
    # a contiguous copy of at least direct_min bytes gets a chunk of its own
    own = _chunks(copies, n, 1024, 1024, direct_min=200)
    assert [c.nbytes for c in own] == [52, 200, 20]
    with pytest.raises(ProgramError, match=r"send\.nbytes"):
        _chunks(copies, 5, 64)


def test_a_message_on_the_rdma_path_is_cut_at_rdma_chunk() -> None:
    """Its destination sees each chunk land (and may forward it) before the next."""
    n = 3 * (1 << 20) + 8  # bf16 elements: 6 MiB and 16 bytes, one contiguous copy
    copy = Copy(0, (0,), 1, (0,), (n,))
    specs = {
        0: ProgramTensor("a", 0, 0, "bfloat16", "plain", (n,)),
        1: ProgramTensor("b", 0, 1, "bfloat16", "plain", (n,)),
    }
    for path, want in (("collective", [2 * n]), ("rdma", [RDMA_CHUNK] * 3 + [16])):
        p = program_from_objects(
            "d", 0, specs, (Message(7, 0, 0, 1, (copy,), 2 * n, path),), (), ()
        )
        chunks = chunk_messages(p.send, CopyInfo.of(p, DIRECT_MIN), WIRE_CHUNK)
        assert [c.nbytes for c in chunks] == want, path


def _programs(src, dst, bucket_bytes=64 << 20):
    plan = build_plan("m", 1, src, dst, PlanConfig(bucket_bytes, allow_dtype_cast=True))
    return {slot: plan.program(slot) for slot in plan.slots()}


def _resolvers(specs_by_slot, tensors, names=None):
    """Resolvers over each slot's own tensors, named pool/rank/name (names by plan index;
    programs carry no names)."""
    return {
        slot: DirectResolver(
            {
                i: ResolvedTensor(f"{s.pool}/{s.rank}/{names[i] if names else i}", tensors[i])
                for i, s in p.tensors.items()
            }
        )
        for slot, p in specs_by_slot.items()
    }


def _tensors(src, dst, globals_):
    tensors = fill_sources(src, globals_)
    tensors += [torch.zeros(d.local_shape, dtype=getattr(torch, d.dtype)) for d in dst]
    return tensors


def test_local_copies_cast_and_release_sources() -> None:
    src, dst = make_model(2, 3, [0, 0], [0, 0, 0], {"row": "float32"})
    g = globals_for(1)
    tensors = _tensors(src, dst, g)
    (program,) = _programs(src, dst).values()
    released = []
    ex = Executor(program, _resolvers({0: program}, tensors)[0], LocalTransport())
    report = ex.run(10.0, lambda: released.append(True))
    assert released == [True] and report.local_bytes > 0 and not report.messages
    for i, d in enumerate(dst):
        assert torch.equal(tensors[len(src) + i], expected(d, g)), d.name


def _run_ranks(programs, resolvers, config, world, timeout=30.0, piece=0):
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )
    results: dict[int, ExecReport | BaseException] = {}

    def rank(r: int) -> None:
        t = GlooTransport()
        try:
            t.connect(ConnectInfo(0, "127.0.0.1", store.port, r, world, 20.0))
            ex = Executor(programs[r], resolvers[r], t, config=config)
            share = Share(LinkShares(), 0, 1.0, piece)
            results[r] = ex.run(timeout, share=share)
            results[r] = ex.run(timeout, share=share)  # a replay of the cached program
        except BaseException as e:
            results[r] = e
        finally:
            t.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout * 3)
    return results


def test_gloo_refit_zero_copy_and_staged_within_staging_cap() -> None:
    src, dst = make_model(2, 3, [0, 1], [1, 0, 1], {"qkv": "float32"})
    g = globals_for(2)
    tensors = _tensors(src, dst, g)
    programs = _programs(src, dst, bucket_bytes=1024)
    config = ExecutorConfig(staging_bytes=4 * 256, wire_chunk=256)
    results = _run_ranks(programs, _resolvers(programs, tensors), config, 2)
    for r, res in results.items():
        assert isinstance(res, ExecReport), f"rank {r}: {res!r}"
        assert res.staging_peak_bytes <= config.staging_bytes
    for i, d in enumerate(dst):
        assert torch.equal(tensors[len(src) + i], expected(d, g)), (d.name, d.rank)
    msgs = [m for res in results.values() for m in res.messages]
    assert sum(m.zero_copy_chunks for m in msgs) > 0
    assert sum(m.staged_chunks for m in msgs) > 0
    total = sum(res.sent_bytes for res in results.values())
    assert total > config.staging_bytes  # the cap was smaller than what moved


def test_gloo_refit_in_pieces_lands_bit_for_bit() -> None:
    """Chunks cut in pieces (as on a link several models share): each piece a matched send
    and receive, zero-copy and staged chunks alike; every byte lands where it belongs."""
    src, dst = make_model(2, 3, [0, 1], [1, 0, 1], {"qkv": "float32"})
    g = globals_for(4)
    tensors = _tensors(src, dst, g)
    programs = _programs(src, dst, bucket_bytes=1024)
    config = ExecutorConfig(staging_bytes=4 * 256, wire_chunk=256)
    sizes = [
        c.nbytes
        for p in programs.values()
        for c in chunk_messages(p.send, CopyInfo.of(p, config.direct_min), config.wire_chunk)
    ]
    assert max(sizes) >= 3 * 64  # chunks of several pieces
    results = _run_ranks(programs, _resolvers(programs, tensors), config, 2, piece=64)
    for r, res in results.items():
        assert isinstance(res, ExecReport), f"rank {r}: {res!r}"
    for i, d in enumerate(dst):
        assert torch.equal(tensors[len(src) + i], expected(d, g)), (d.name, d.rank)
    msgs = [m for res in results.values() for m in res.messages]
    assert sum(m.zero_copy_chunks for m in msgs) > 0 and sum(m.staged_chunks for m in msgs) > 0
    assert sum(res.sent_bytes for res in results.values()) == sum(
        res.recv_bytes for res in results.values()
    )


def test_moved_storage_is_refused_before_any_byte_moves() -> None:
    src, dst = make_model(1, 1, [0], [0])
    tensors = _tensors(src, dst, globals_for(3))
    (program,) = _programs(src, dst).values()
    resolver = _resolvers({0: program}, tensors, [s.name for s in src + dst])[0]
    with torch.no_grad():
        tensors[len(src)].set_(torch.zeros_like(tensors[len(src)]))
    before = tensors[len(src)].clone()
    ex = Executor(program, resolver, LocalTransport())
    with pytest.raises(StorageMovedError, match="infer/0/col"):
        ex.run(5.0)
    assert torch.equal(tensors[len(src)], before)


def test_adjacent_small_tensors_move_as_one_zero_copy_run() -> None:
    """Many small tensors laid back to back in one buffer on each side (as in an arena):
    a chunk of many copies is one run of memory at both ends, so it goes without staging;
    the same tensors in separate buffers are staged, packed in bulk. Both land bit for bit."""
    from refitd.plan.layouts import make_spec, megatron_layout

    n, shape = 48, (4, 32)  # 256 B bf16 tensors: no alignment padding between segments

    def side(pool: str, slot: int) -> list:
        return [
            make_spec(
                model="m", pool=pool, rank=0, slot=slot, name=f"w{k}", global_shape=shape,
                dtype="bfloat16", layout=megatron_layout(shape),
            )
            for k in range(n)
        ]  # fmt: skip

    src, dst = side("train", 0), side("infer", 1)
    programs = _programs(src, dst)
    g = torch.arange(n * 128, dtype=torch.float32).reshape(n, *shape).to(torch.bfloat16)
    for adjacent in (True, False):
        if adjacent:
            arena = [torch.zeros(n, *shape, dtype=torch.bfloat16) for _ in range(2)]
            tensors = [arena[0][k] for k in range(n)] + [arena[1][k] for k in range(n)]
        else:
            tensors = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2 * n)]
        for k in range(n):
            tensors[k].copy_(g[k])
        results = _run_ranks(programs, _resolvers(programs, tensors), ExecutorConfig(), 2)
        msgs = [m for res in results.values() for m in res.messages]
        assert all(isinstance(r, ExecReport) for r in results.values()), results
        assert all(torch.equal(tensors[n + k], g[k]) for k in range(n))
        zc = sum(m.zero_copy_chunks for m in msgs)
        staged = sum(m.staged_chunks for m in msgs)
        if adjacent:
            assert zc > 0 and staged == 0, (zc, staged)
            assert all(r.staging_peak_bytes == 0 for r in results.values())
        else:
            assert zc == 0 and staged > 0, (zc, staged)
