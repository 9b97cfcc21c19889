"""Columnar slot programs: round trip, replay of shipped programs, rejection of bad bytes."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.plan.layouts import Shard, dtensor_layout, make_spec
from refitd.plan.links import PATHS, LinkPolicy, SlotSite
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import (
    PROGRAM_FORMAT_VERSION,
    ProgramError,
    decode_program,
    encode_program,
)
from refitd.plan.program.build import _range_max

from .oracle import run_and_check
from .test_layouts_plan import tp_side

FEW = settings(max_examples=12, deadline=None)


def _plan(tp_s=2, tp_d=3, dp_d=2, relay=True, bucket=256, links="collective"):
    """Slots 0.. hold the sources, 20.. the destinations; for `links`, even slots sit on
    one host and odd ones on another, every agent offering mapped."""
    src = tp_side("train", tp_s, 1, 1, (48, 8), 0, 0)
    src += tp_side("train", tp_s, 1, 1, (48,), 0, 0, name="bias")
    dst = tp_side("inf", tp_d, dp_d, 1, (48, 8), 0, 20)
    dst += tp_side("inf", tp_d, dp_d, 1, (48,), 0, 20, name="bias")
    slots = sorted({s.slot for s in src + dst})
    sites = [SlotSite(s, f"host{s % 2}", "cpu", ("mapped",)) for s in slots]
    policy = LinkPolicy.of(links, sites)
    return src, dst, PlanConfig(bucket_bytes=bucket, relay=relay, links=policy)


@FEW
@given(
    tp_s=st.sampled_from([1, 2, 4]),
    tp_d=st.sampled_from([1, 2, 3]),
    dp_d=st.sampled_from([1, 2, 3]),
    relay=st.booleans(),
    bucket=st.sampled_from([64, 256, 1 << 20]),
    links=st.sampled_from(["collective", "auto", "mapped"]),
)
def test_programs_round_trip_and_replay(tp_s, tp_d, dp_d, relay, bucket, links):
    """Every program survives its encoding unchanged (paths of messages included), the
    one-pass builder gives the same programs as the per-slot one, and the oracle replays
    the decoded programs bit for bit (run_and_check ships every program through bytes);
    both ends of a message agree on its path, which its link decides."""
    src, dst, cfg = _plan(tp_s, tp_d, dp_d, relay, bucket, links)
    plan = run_and_check(src, dst, cfg)
    every = plan.programs()
    ends: dict[int, set[str]] = {}
    for p in every.values():
        for m in (*p.sends, *p.recvs):
            ends.setdefault(m.id, set()).add(m.path)
            same_host = m.src_slot % 2 == m.dst_slot % 2
            assert m.path == ("mapped" if links != "collective" and same_host else "collective")
    assert all(len(v) == 1 for v in ends.values())
    assert set(PATHS[c] for c in plan.message_columns()["path"]) <= {"collective", "mapped"}
    assert sorted(every) == plan.slots()
    for slot, p in every.items():
        assert p == plan.program(slot)
        back = decode_program(encode_program(p), slot)
        assert back == p
        assert back.sends == p.sends and back.recvs == p.recvs and back.local == p.local
        for i, t in back.tensors.items():
            spec = plan.tensors[i]
            assert (t.pool, t.rank, t.slot, t.dtype, t.local_shape) == (
                spec.pool,
                spec.rank,
                spec.slot,
                spec.dtype,
                spec.local_shape,
            )


def _err(data: bytes, slot: int) -> str:
    with pytest.raises(ProgramError) as e:
        decode_program(data, slot)
    msg = str(e.value)
    assert f"slot program for slot {slot}: field '" in msg, msg
    return msg


@FEW
@given(data=st.data())
def test_truncated_and_corrupted_programs_are_rejected(data):
    src, dst, cfg = _plan()
    plan = build_plan("m", 1, src, dst, cfg)
    slot = data.draw(st.sampled_from(plan.slots()))
    raw = encode_program(plan.program(slot))
    cut = data.draw(st.integers(0, len(raw) - 1))
    _err(raw[:cut], slot)
    pos = data.draw(st.integers(0, len(raw) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(raw)
    bad[pos] ^= flip
    _err(bytes(bad), slot)


def test_version_mismatch_and_wrong_slot_name_the_field():
    src, dst, cfg = _plan()
    plan = build_plan("m", 1, src, dst, cfg)
    raw = bytearray(encode_program(plan.program(0)))
    assert "field 'slot'" in _err(bytes(raw), 21)
    raw[4:6] = (PROGRAM_FORMAT_VERSION + 1).to_bytes(2, "little")
    msg = _err(bytes(raw), 0)
    assert "field 'version'" in msg and f"reads {PROGRAM_FORMAT_VERSION}" in msg


def test_inconsistent_columns_are_rejected_by_field():
    """Columns with valid checksums but wrong contents: the semantic checks name the field."""
    src, dst, cfg = _plan(relay=False)
    plan = build_plan("m", 1, src, dst, cfg)
    p = plan.program(0)
    assert len(p.copies) and len(p.send)

    def bad(**changes):
        cols = dataclasses.replace(p.copies, **changes)
        return encode_program(dataclasses.replace(p, copies=cols, wire_dtypes=None))

    off = p.copies.src_off.copy()
    off[0, 0] += 10_000
    assert "field 'copies.src_off'" in _err(bad(src_off=off), 0)
    idx = p.copies.src.copy()
    idx[0] = 10_000
    assert re.search(r"field 'copies.src'.*tensor 10000", _err(bad(src=idx), 0))
    wire = p.copies.wire.copy()
    wire[0] = 9
    assert "field 'copies.wire'" in _err(bad(wire=wire), 0)
    nb = p.send.nbytes.copy()
    nb[0] += 16
    sends = dataclasses.replace(p.send, nbytes=nb)
    msg = _err(encode_program(dataclasses.replace(p, send=sends, wire_dtypes=None)), 0)
    assert "field 'send.nbytes'" in msg


def test_slot_with_an_empty_shard_and_no_copies():
    """A rank whose shard is empty (torch.chunk of 3 rows over 4 ranks) holds a tensor with
    zero copies: its slot's program is empty, ships and decodes."""
    shape = (3, 8)
    src = [
        make_spec(
            model="m",
            pool="t",
            rank=0,
            slot=0,
            name="w",
            global_shape=shape,
            dtype="float32",
            layout=dtensor_layout(shape, (1,), (0,), [Shard(0)]),
        )
    ]
    dst = [
        make_spec(
            model="m",
            pool="i",
            rank=r,
            slot=10 + r,
            name="w",
            global_shape=shape,
            dtype="float32",
            layout=dtensor_layout(shape, (4,), (r,), [Shard(0)]),
        )
        for r in range(4)
    ]
    plan = run_and_check(src, dst, PlanConfig())
    p = plan.program(13)
    assert len(p.copies) == 0 and len(p.send) == len(p.recv) == 0
    assert decode_program(encode_program(p), 13) == p
    # the slot's one tensor is an empty shard: nothing to copy, no memory to map
    (empty,) = [t for t in plan.tensors if t.slot == 13]
    assert empty.local_shape == (0, 8)
    assert len(p.tensors) == 0


def test_slot_maxima_of_flat_columns_with_empty_ranges():
    """Per-slot maxima of 1-D and [N, d] program columns (slot ranges of rows, some
    empty): an empty range gives the (maximum of the) row at its start, 0 past the end,
    as np.maximum.reduceat does; the travelling dtypes in the headers come from these."""
    rng = np.random.default_rng(3)
    counts = np.array([2, 0, 3, 0, 0, 1, 0])
    lo = np.cumsum(counts) - counts
    for a in (rng.integers(0, 1 << 40, 6), rng.integers(0, 1 << 40, (6, 3))):
        rows = a if a.ndim == 1 else a.max(axis=1)
        want = [
            rows[s : s + n].max() if n else (rows[s] if s < rows.size else 0)
            for s, n in zip(lo.tolist(), counts.tolist(), strict=True)
        ]
        assert _range_max(a, lo).tolist() == want


def _pools_with_an_empty_shard(by_slot: bool, empty: bool):
    """Trainer tp=2 x dp=2 (slots 0-3) into two inference pools tp=3 (slots 20-22, 30-32);
    with `empty`, a (2, 8) tensor chunked over pool A's 3 ranks leaves rank 2 an empty
    shard. by_slot: each side's specs registered slot by slot (as workers register), else
    tensor by tensor (slots interleaved)."""
    src = tp_side("train", 2, 2, 1, (48, 8), 0, 0) + tp_side("train", 2, 2, 1, (48,), 0, 0, "b")
    dst = []
    for pool, base in (("infA", 20), ("infB", 30)):
        dst += tp_side(pool, 3, 1, 1, (48, 8), 0, base) + tp_side(
            pool, 3, 1, 1, (48,), 0, base, "b"
        )
    if empty:
        shape = (2, 8)
        whole = dtensor_layout(shape, (1,), (0,), [Shard(0)])
        one = {"model": "m", "name": "e", "global_shape": shape, "dtype": "float32"}
        src.append(make_spec(pool="train", rank=0, slot=0, layout=whole, **one))
        dst += [
            make_spec(
                pool="infA",
                rank=r,
                slot=20 + r,
                layout=dtensor_layout(shape, (3,), (r,), [Shard(0)]),
                **one,
            )
            for r in range(3)
        ]
    if by_slot:
        src.sort(key=lambda s: s.slot)
        dst.sort(key=lambda s: s.slot)
    return src, dst


@pytest.mark.parametrize(("by_slot", "empty"), [(True, False), (False, False), (True, True)])
def test_program_tables_and_readers_match_the_registrations(by_slot, empty):
    """Each slot's program holds exactly its slot's non-empty tensors in plan order (with
    their worker), source_slots_of names exactly the slots whose programs send or copy
    locally from that worker's tensors (relays, which read destination tensors, aside),
    and holders/source_workers name the registered workers, whatever the order the
    tensors were registered in."""
    src, dst = _pools_with_an_empty_shard(by_slot, empty)
    plan = run_and_check(src, dst, PlanConfig(bucket_bytes=256, relay=True))
    n_src = plan.source_count
    readers: dict[tuple[str, int], set[int]] = {}
    for slot, p in plan.programs().items():
        want = [i for i, s in enumerate(plan.tensors) if s.slot == slot and all(s.local_shape)]
        assert p.table.index.tolist() == want
        for i, t in p.tensors.items():
            assert (t.pool, t.rank) == (plan.tensors[i].pool, plan.tensors[i].rank)
        own = [r for a, b in zip(p.send.start, p.send.end, strict=True) for r in range(a, b)]
        own += range(p.local_start, len(p.copies))
        for i in p.copies.src[own].tolist():
            if i < n_src:
                readers.setdefault((plan.tensors[i].pool, plan.tensors[i].rank), set()).add(slot)
    assert readers and plan.source_workers() >= set(readers)
    assert plan.source_workers() == {(s.pool, s.rank) for s in src}
    held: dict[int, set[tuple[str, int]]] = {}
    for s in plan.tensors:
        held.setdefault(s.slot, set()).add((s.pool, s.rank))
    assert plan.holders() == {slot: tuple(sorted(w)) for slot, w in held.items()}
    for worker in plan.source_workers():
        assert plan.source_slots_of(*worker) == sorted(readers.get(worker, ()))


def _empty_slot_before_a_source():
    """A (3, 512) tensor on source slot 6, chunked over four inference ranks on slots 1,
    11, 12 and 5: rank 3 (slot 5) holds an empty shard and no copies, between slot 1,
    which receives, and slot 6, whose copies' shapes need two bytes."""
    shape = (3, 512)
    one = {"model": "m", "name": "w", "global_shape": shape, "dtype": "float32"}
    whole = dtensor_layout(shape, (1,), (0,), [Shard(0)])
    src = [make_spec(pool="t", rank=0, slot=6, layout=whole, **one)]
    dst = [
        make_spec(
            pool="i", rank=r, slot=s, layout=dtensor_layout(shape, (4,), (r,), [Shard(0)]), **one
        )
        for r, s in enumerate((1, 11, 12, 5))
    ]
    return src, dst, PlanConfig()


@pytest.mark.parametrize("layout", ["pools", "empty_slot"])
def test_programs_built_a_chunk_at_a_time_equal_those_built_at_once(layout):
    """The program index takes its copy columns a chunk of slots at a time: programs built
    in chunks of one slot, asked for in any order or in one pass, encode to the same
    bytes as those built in one chunk (travelling dtypes included: a slot without copies
    reads them from the next slot's first row, in its chunk)."""
    src, dst, cfg = _plan(2, 3, 3, True, 64) if layout == "pools" else _empty_slot_before_a_source()
    whole = build_plan("m", 0, src, dst, cfg).program_index(chunk_rows=1 << 40)
    plan = build_plan("m", 0, src, dst, cfg)
    chunked = plan.program_index(chunk_rows=1)
    slots = plan.slots()
    for slot in [*slots, *reversed(slots)]:
        assert encode_program(chunked.program(slot)) == encode_program(whole.program(slot))
    passed = build_plan("m", 0, src, dst, cfg).program_index(chunk_rows=1).programs()
    assert [encode_program(p) for p in passed] == [encode_program(whole.program(s)) for s in slots]
    if layout == "empty_slot":
        empty = chunked.program(5)
        assert len(empty.copies) == 0 and empty.wire_dtypes["copies.shape"] == "<u2"
