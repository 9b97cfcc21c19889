"""Paths of links through the transfer slots' own handlers: every path bit for bit over
randomised layouts (staged pools, snapshots, relays, casts, verification), quantized
landings alike on mapped and collective links, and descriptors that are mismatched or stale
refused naming the peer slot and the message."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _slots import Slots, checksum_mismatch
from _transport_layouts import expected, fill_sources, globals_for, make_model
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.memory.arena import SharedTensorArena
from refitd.plan.layouts import make_spec, megatron_layout
from refitd.plan.links import LinkPolicy, SlotSite
from refitd.plan.plan import Plan
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.wire import (
    MXFP8,
    NVFP4,
    PLAIN,
    mxfp8_scale_shape,
    nvfp4_data_shape,
    nvfp4_scale_shape,
)
from refitd.transfer.links import landing_sizes
from refitd.transport.base import ConnectInfo
from refitd.transport.gloo import epoch_prefix
from refitd.transport.mooncake_env import mooncake_unavailable_reason
from refitd.transport.paths import Descriptor, Exposed, descriptor_key

RDMA_REASON = mooncake_unavailable_reason()
needs_rdma = pytest.mark.skipif(RDMA_REASON is not None, reason=f"rdma path: {RDMA_REASON}")
# the rdma path (Mooncake over TCP on loopback) where its engine imports
PATHS = ["collective", "mapped", "auto"] + ([] if RDMA_REASON else ["rdma"])
ONE_SIDED_PATHS = ("mapped",) if RDMA_REASON else ("mapped", "rdma")
OFFERS = ONE_SIDED_PATHS if RDMA_REASON else (*ONE_SIDED_PATHS, "rdma-auto")


def _policy(mode: str, slots: list[int], hosts: int = 1) -> LinkPolicy:
    return LinkPolicy.of(mode, [SlotSite(s, f"h{s % hosts}", "cpu", OFFERS) for s in slots])


@settings(max_examples=8, deadline=None)
@given(
    src_parts=st.integers(1, 3),
    dst_parts=st.integers(1, 3),
    links=st.sampled_from(PATHS),
    staged=st.booleans(),
    snapshot=st.booleans(),
    replicas=st.booleans(),
    data=st.data(),
)
def test_every_path_lands_bit_for_bit(src_parts, dst_parts, links, staged, snapshot, replicas,
                                      data) -> None:  # fmt: skip
    """auto: slots of even and odd numbers on two hosts (mapped links on each, rdma links
    between them where Mooncake imports, else collective, in one plan); a second
    destination pool of replicas fed by relays; casts to float32."""
    slot = st.integers(0, 3)
    src_slots = [data.draw(slot) for _ in range(src_parts)]
    dst_slots = [data.draw(slot) for _ in range(dst_parts)]
    _lands_bit_for_bit(src_slots, dst_slots, links, staged, snapshot, replicas)


@needs_rdma
def test_rdma_lands_staged_snapshot_relays_and_casts_bit_for_bit() -> None:
    _lands_bit_for_bit([0, 1], [2, 3, 1], "rdma", True, True, True)


def _lands_bit_for_bit(src_slots: list[int], dst_slots: list[int], links: str, staged: bool,
                       snapshot: bool, replicas: bool) -> None:  # fmt: skip
    src_parts, dst_parts = len(src_slots), len(dst_slots)
    src, dst = make_model(src_parts, dst_parts, src_slots, dst_slots, {"qkv": "float32"})
    if replicas:
        dst += [dataclasses.replace(d, pool="infer2", slot=3 - d.slot) for d in dst]
    slots = sorted({s.slot for s in src + dst})
    cfg = PlanConfig(256, allow_dtype_cast=True, relay=replicas,
                     links=_policy(links, slots, 2 if links == "auto" else 1))  # fmt: skip
    plan = build_plan("m", 1, src, dst, cfg)
    g = globals_for(src_parts * 7 + dst_parts)
    tensors = fill_sources(src, g) + [
        torch.zeros(d.local_shape, dtype=getattr(torch, d.dtype)) for d in dst
    ]
    n = len(src)
    h = Slots(slots)
    try:
        h.register(src + dst, tensors)
        h.connect()
        stage = tuple(range(n, n + len(dst))) if staged else ()
        h.load(plan, staged=stage, snapshot=tuple(range(n)) if snapshot else ())
        for refit_id in (11, 12):  # the second replays the prepared executors
            for t in tensors[n:]:
                t.zero_()
            results = h.execute(plan, refit_id)
            assert checksum_mismatch(plan, results) is None
            if staged:
                assert all(not t.any() for t in tensors[n:])  # live memory untouched
                h.apply(plan, refit_id, {d.slot for d in dst})
            for i, d in enumerate(dst):
                assert torch.equal(tensors[n + i], expected(d, g)), (d.pool, d.name, d.rank)
    finally:
        h.close()


def _quantized_sides(storage: str, quantize_on_sender: bool, links: str):
    """bf16 sources (MXFP8: tp=2 on slots 0, 1; NVFP4, landed whole: one rank on slot 0)
    -> one quantized destination on slot 2, all on one host."""
    shape = (64, 128)
    tp = 2 if storage == MXFP8 else 1
    src = [
        make_spec(model="m", pool="t", rank=r, slot=r, name="w", global_shape=shape,
                  dtype="bfloat16", layout=megatron_layout(shape, tp_rank=r, tp_size=tp,
                                                           partition_dim=1))
        for r in range(tp)
    ]  # fmt: skip
    dst = [make_spec(model="m", pool="i", rank=0, slot=2, name="w", global_shape=shape,
                     dtype="bfloat16", layout=megatron_layout(shape), storage=storage)]  # fmt: skip
    cfg = PlanConfig(1 << 20, sender_quantization=quantize_on_sender,
                     links=_policy(links, [0, 1, 2]))  # fmt: skip
    return src, dst, build_plan("m", 1, src, dst, cfg)


def _quantized_buffers(storage: str) -> dict[str, torch.Tensor]:
    shape = (64, 128)
    if storage == MXFP8:
        return {"data": torch.zeros(shape, dtype=torch.uint8),
                "scales": torch.zeros(mxfp8_scale_shape(shape), dtype=torch.uint8)}  # fmt: skip
    return {
        "data": torch.zeros(nvfp4_data_shape(shape), dtype=torch.uint8),
        "scales": torch.zeros(nvfp4_scale_shape(shape), dtype=torch.uint8),
        "global_scale": torch.zeros(1, dtype=torch.float32),
    }


@pytest.mark.parametrize("storage", [MXFP8, NVFP4])
@pytest.mark.parametrize("quantize_on_sender", [False, True])
def test_quantized_landings_are_the_same_on_every_path(
    storage: str, quantize_on_sender: bool
) -> None:
    """A copy that lands through a codec (quantized on the wire, or on landing) is encoded
    and decoded by the sender of a mapped or rdma link (an rdma sender lands it in its
    mirror and writes the quantized bytes): bit for bit what the collective link's receiver
    lands, and equal to the reference quantizer's."""
    from refitd import formats

    g = torch.randn(64, 128).to(torch.bfloat16)
    landed = {}
    for links in ["collective", *ONE_SIDED_PATHS]:
        src, dst, plan = _quantized_sides(storage, quantize_on_sender, links)
        assert plan.link_summary().get(links, {}).get("messages")
        sources = [g[:, :64].clone(), g[:, 64:].clone()] if len(src) == 2 else [g.clone()]
        bufs = _quantized_buffers(storage)
        h = Slots(sorted({s.slot for s in src + dst}))
        try:
            h.register(src + dst, [*sources, bufs["data"]])
            extra = h.arenas[2].register({k: v for k, v in bufs.items() if k != "data"})
            n = len(src)
            h.handles[n] = dataclasses.replace(
                h.handles[n], scales=extra["scales"], global_scale=extra.get("global_scale")
            )
            h.connect()
            h.load(plan, chunk=1024)
            results = h.execute(plan, 21)
            assert checksum_mismatch(plan, results) is None
            landed[links] = [v.clone() for v in bufs.values()]
        finally:
            h.close()
    want = formats.mxfp8_quantize(g) if storage == MXFP8 else formats.nvfp4_quantize(g)
    for got in landed.values():
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b.view(a.dtype)), storage


class _Pair:
    """Slot 0 (sources) -> slot 1 (destinations) on one host, every message on `path`."""

    def __init__(self, path: str = "mapped") -> None:
        self.src, self.dst = make_model(1, 1, [0], [1])
        self.plan = build_plan("m", 1, self.src, self.dst, PlanConfig(256, links=_policy(
            path, [0, 1])))  # fmt: skip
        self.g = globals_for(5)
        self.tensors = fill_sources(self.src, self.g) + [
            torch.zeros(d.local_shape, dtype=torch.bfloat16) for d in self.dst
        ]
        self.h = Slots([0, 1])
        self.h.register(self.src + self.dst, self.tensors)
        self.h.connect()
        self.h.load(self.plan)
        info = ConnectInfo(1, "127.0.0.1", self.h.store.port, 0, 2, 10.0)
        self.store = dist.PrefixStore(epoch_prefix(info), self.h.store)
        self.key = descriptor_key(path, self.plan.digest, 1)
        self.mid = int(self.plan.program(1).recv.id[0])
        self.attempt = 30

    def descriptor(self) -> Descriptor:
        return Descriptor.from_bytes(self.store.get(self.key), "test")

    def put(self, d: Descriptor) -> None:
        self.store.set(self.key, d.to_bytes())

    def refused(self, *words: str) -> str:
        """The sender refuses (the receiver, never written, gives up at its deadline)."""
        self.attempt += 1
        with pytest.raises(RuntimeError) as e:
            self.h.execute(self.plan, self.attempt, timeout_s=2.0)
        msg = str(e.value)
        for w in (f"slot 0: message {self.mid} to slot 1", *words):
            assert w in msg, msg
        assert "0 of 1 chunks written when the wait ended" in msg, msg
        return msg

    def landed(self) -> bool:
        n = len(self.src)
        return all(torch.equal(self.tensors[n + i], expected(d, self.g))
                   for i, d in enumerate(self.dst))  # fmt: skip


def test_mismatched_descriptors_are_refused_naming_the_peer_and_message() -> None:
    p = _Pair()
    try:
        good = p.descriptor()
        p.put(dataclasses.replace(good, slot=0))
        p.refused("mismatched descriptor", "(path, epoch, plan, slot)")
        p.put(dataclasses.replace(good, messages=()))
        p.refused("mismatched descriptor", "no doorbell entry")
        # a tensor of another dtype behind the plan's destination handle
        arena = SharedTensorArena(prefix="refitd-test")
        try:
            import msgpack

            body = msgpack.unpackb(good.body, raw=False, strict_map_key=False)
            index = next(iter(body["tensors"]))
            local = p.dst[int(index) - len(p.src)].local_shape
            wrong = arena.register({"f": torch.zeros(local, dtype=torch.float32)})["f"]
            body["tensors"][index][0] = wrong.to_bytes()
            p.put(dataclasses.replace(good, body=msgpack.packb(body, use_bin_type=True)))
            p.refused("mismatched descriptor", "torch.float32", "the plan writes torch.bfloat16")
        finally:
            arena.close()
        p.put(good)
        p.h.execute(p.plan, 32)
        assert p.landed()
    finally:
        p.h.close()


@pytest.mark.parametrize(
    ("path", "refusal"),
    [("mapped", "stale descriptor"),
     pytest.param("rdma", "descriptor refused", marks=needs_rdma)],
)  # fmt: skip
def test_a_stale_descriptor_is_refused_and_a_fresh_one_is_attached(path, refusal) -> None:
    """The destination loads the plan again with new memory (its worker registered again):
    its old doorbell retires (rdma: its old registration and engines go), and a sender
    given the old descriptor refuses it; with the descriptor the destination published it
    lands."""
    p = _Pair(path)
    try:
        p.h.execute(p.plan, 41)
        old = p.descriptor()
        n = len(p.src)
        fresh = [torch.zeros_like(p.tensors[n + i]) for i in range(len(p.dst))]
        arena = SharedTensorArena(prefix="refitd-test")
        for i, t in enumerate(fresh):
            p.h.handles[n + i] = arena.register({f"t{i}": t})[f"t{i}"]
        p.tensors[n:] = fresh
        try:
            p.h.load(p.plan, slots=[1])
            current = p.descriptor()
            assert current.generation != old.generation
            p.put(old)
            p.refused(refusal)
            p.put(current)
            p.h.execute(p.plan, 43)
            assert p.landed()
        finally:
            p.h.close()
            arena.close()
    except BaseException:
        p.h.close()
        raise


def test_a_descriptor_larger_than_a_store_value_travels_in_parts() -> None:
    """torch's TCPStore refuses values over 8 MiB (a destination of 100,000 tensors has a
    larger descriptor): it is published in parts and read back whole; republished, the
    reader gets the new one."""
    import datetime
    import os

    from refitd.transport.paths import Links

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))  # fmt: skip
    info = ConnectInfo(epoch=3, store_host="127.0.0.1", store_port=store.port, rank=0,
                       world_size=1, timeout_s=20)  # fmt: skip
    links = Links(info, lambda i: store, lambda kind: None)  # type: ignore[arg-type, return-value]
    body = os.urandom(19 << 20)
    d = Descriptor("mapped", 3, "abc", 1, 7, tuple(range(1000)), body)
    links.publish(d)
    assert len(store.get(descriptor_key("mapped", "abc", 1))) < 1024  # the header only
    got = links.fetch("mapped", "abc", 1, "test")
    assert (got.body, got.messages, got.generation) == (body, d.messages, 7)
    newer = dataclasses.replace(d, generation=8, body=os.urandom(9 << 20))
    links.publish(newer)
    got = links.fetch("mapped", "abc", 1, "test")
    assert (got.body, got.generation) == (newer.body, 8)


@needs_rdma
def test_rdma_memory_the_destination_never_registered_is_refused() -> None:
    """A descriptor naming a destination tensor outside what the slot registered (its
    registration is checked, not trusted): refused naming the peer slot and message before
    any byte is written; the published descriptor then lands."""
    import msgpack

    p = _Pair("rdma")
    try:
        good = p.descriptor()
        body = msgpack.unpackb(good.body, raw=False, strict_map_key=False)
        index = next(iter(body["tensors"]))
        elsewhere = torch.zeros(4096, dtype=torch.bfloat16)  # memory no one registered
        body["tensors"][index][1][0][0] = elsewhere.data_ptr()
        p.put(dataclasses.replace(good, body=msgpack.packb(body, use_bin_type=True)))
        p.refused(f"its tensor {index}", "outside the memory slot 1 registered")
        p.put(good)
        p.h.execute(p.plan, 32)
        assert p.landed()
    finally:
        p.h.close()


def _row_parallel_plan() -> tuple[tuple[int, int], list, list, Plan]:
    """tp=2 -> two tp=1 replicas (slots 2 and 0) of a row-parallel bf16 weight, rdma links,
    relays on: each source's region in a destination is a 512-byte run per row."""
    shape = (64, 512)  # bf16 rows of 512 bytes per source rank: far below a landing run
    src = [make_spec(model="m", pool="t", rank=r, slot=r, name="w", global_shape=shape,
                     dtype="bfloat16", layout=megatron_layout(shape, tp_rank=r, tp_size=2,
                                                              partition_dim=1))
           for r in range(2)]  # fmt: skip
    dst = [make_spec(model="m", pool=pool, rank=0, slot=slot, name="w", global_shape=shape,
                     dtype="bfloat16", layout=megatron_layout(shape))
           for pool, slot in (("i", 2), ("j", 0))]  # fmt: skip
    plan = build_plan("m", 1, src, dst, PlanConfig(1 << 20, relay=True,
                                                   links=_policy("rdma", [0, 1, 2])))  # fmt: skip
    return shape, src, dst, plan


def test_landing_areas_stay_within_their_cap() -> None:
    """Messages of short rows land packed while their landing areas fit the slot's cap
    (rdma_landing_bytes); past it they land row by row."""
    shape, _, _, plan = _row_parallel_plan()
    p = plan.program(2)
    exposed = {i: Exposed(torch.zeros(shape, dtype=torch.bfloat16), None, PLAIN, b"")
               for i in p.table.index.tolist()}  # fmt: skip
    rows = list(range(len(p.recv)))
    sizes = {int(m): int(n) for m, n in zip(p.recv.id, p.recv.nbytes, strict=True)}
    assert len(sizes) == 2 and landing_sizes(p, rows, exposed, 1 << 30) == sizes
    assert landing_sizes(p, rows, exposed, 0) == {}
    first = min(sizes.values())
    assert len(landing_sizes(p, rows, exposed, first)) == 1


@needs_rdma
def test_rdma_strided_destinations_land_packed_and_scatter_bit_for_bit() -> None:
    """tp=2 -> tp=1 of a row-parallel weight: each source's region in the destination is a
    short run per row, so a destination exposes a landing area for those messages (one
    write per chunk rather than one per row) and scatters every chunk into place before
    its checksums and its relay read it (slot 2 forwards slot 1's half to the replica on
    slot 0, which lands packed too): bit for bit, twice."""
    import msgpack

    shape, src, dst, plan = _row_parallel_plan()
    g = torch.randn(shape).to(torch.bfloat16)
    tensors = [g[:, r * 256 : (r + 1) * 256].clone() for r in range(2)]
    tensors += [torch.zeros(shape, dtype=torch.bfloat16) for _ in dst]
    h = Slots([0, 1, 2])
    try:
        h.register(src + dst, tensors)
        h.connect()
        h.load(plan, chunk=4096)  # several chunks per message: each at its own offset
        info = ConnectInfo(1, "127.0.0.1", h.store.port, 0, 3, 10.0)
        store = dist.PrefixStore(epoch_prefix(info), h.store)
        for slot in (2, 0):
            raw = store.get(descriptor_key("rdma", plan.digest, slot))
            body = msgpack.unpackb(Descriptor.from_bytes(raw, "test").body, raw=False,
                                   strict_map_key=False)  # fmt: skip
            received = {int(m) for m in plan.program(slot).recv.id.tolist()}
            assert received and {int(m) for m in body.get("landing", {})} == received
        for refit_id in (51, 52):
            for t in tensors[2:]:
                t.zero_()
            assert checksum_mismatch(plan, h.execute(plan, refit_id)) is None
            for t in tensors[2:]:
                assert torch.equal(t, g)
    finally:
        h.close()
