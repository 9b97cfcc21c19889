"""Delta-path cases run on a chosen device (CPU, or CUDA in the _gpu tests): a cluster of two
source and two destination ranks of the small test layout over real Gloo (ranks in threads
of this process), versions from FP32 masters stepping by +-lr (BF16 published); and one
MXFP8 copy staged and landed through host memory."""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist
from _transport_layouts import expected, make_model, shard

from refitd import formats
from refitd.demo.versions import VersionGenerator
from refitd.executor.delta import host
from refitd.executor.delta.access import ProgramAccess
from refitd.executor.delta.exchange import DeltaBase, DeltaReport, exchange_deltas
from refitd.executor.segments import ResolvedTensor, dest_region
from refitd.formats.delta import apply_parts, encode_parts, region_streams, segment_streams
from refitd.plan.layout import Box, TensorSpec
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.wire import MXFP8, PLAIN
from refitd.transport.base import ConnectInfo
from refitd.transport.gloo import GlooTransport

WORLD = 4  # sources on slots 0, 1; destinations on slots 2, 3


class Cluster:
    """Two source and two destination ranks of the test layout, one transport each, and a
    global FP32 master per tensor stepping by +-lr (BF16 versions); every rank's tensors
    on `device`."""

    def __init__(self, lr: float, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.src, self.dst = make_model(2, 2, [0, 1], [2, 3])
        plan = build_plan("m", 1, self.src, self.dst, PlanConfig(1 << 20))
        self.programs = {s: plan.program(s) for s in plan.slots()}
        self.gens = {
            s.name: VersionGenerator(_numel(s.global_shape), lr, i)
            for i, s in enumerate(self.src)
            if s.rank == 0
        }
        self.globals = {
            n: g.current(torch.empty(g.numel, dtype=torch.bfloat16)).view(_shape(self.src, n))
            for n, g in self.gens.items()
        }
        dev = self.device
        self.tensors = [shard(self.globals[s.name], s).to(dev, copy=True) for s in self.src]
        self.tensors += [
            torch.zeros(d.local_shape, dtype=torch.bfloat16, device=dev) for d in self.dst
        ]
        self.access = {
            slot: ProgramAccess(
                p,
                lambda i: ResolvedTensor(str(i), self.tensors[i]),
                lambda s: s,
            )
            for slot, p in self.programs.items()
        }
        self.bases = {slot: DeltaBase() for slot in (0, 1)}
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=30),
        )  # fmt: skip
        self.transports = [GlooTransport() for _ in range(WORLD)]
        ts = [
            threading.Thread(
                target=t.connect, args=(ConnectInfo(0, "127.0.0.1", self.store.port, r, WORLD, 20),)
            )
            for r, t in enumerate(self.transports)
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)

    def step(self, version: int) -> None:
        """The trainer's next version, written into the source tensors in place."""
        for n, g in self.gens.items():
            g.step(self.globals[n].view(-1))
        for i, s in enumerate(self.src):
            self.tensors[i].copy_(shard(self.globals[s.name], s))

    def refit(
        self, version: int, allowed: dict[int, set[int]] | None = None, verify: bool = False
    ) -> dict[int, DeltaReport]:
        """Every message through the delta path: `allowed` message ids as deltas (all when
        None), the rest dense; the sources' pending segments captured first."""
        every = {m for a in self.access.values() for m in a.sends}
        results: dict[int, DeltaReport | BaseException] = {}

        def rank(r: int) -> None:
            a = self.access[r]
            try:
                base = self.bases.get(r, DeltaBase())
                sends = a.messages("send", a.sends)
                ok = every if allowed is None else allowed.get(r, set())
                results[r] = exchange_deltas(
                    self.transports[r], sends, a.messages("recv", a.recvs), a, base, version,
                    allowed=frozenset(ok), max_density=0.4,
                    deadline=time.monotonic() + 30, verify=verify,
                )  # fmt: skip
            except BaseException as e:
                results[r] = e

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for r, res in results.items():
            assert isinstance(res, DeltaReport), f"rank {r}: {res!r}"
        return results  # type: ignore[return-value]

    def check(self) -> None:
        for i, d in enumerate(self.dst):
            got = self.tensors[len(self.src) + i].cpu()
            want = expected(d, self.globals)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (d.name, d.rank)

    def close(self) -> None:
        for t in self.transports:
            t.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shape(src: list, name: str) -> tuple[int, ...]:
    return next(s.global_shape for s in src if s.name == name)


def _spec(pool: str, slot: int, shape: tuple[int, int], storage: str) -> TensorSpec:
    box = Box((0, 0), shape, (0, 0))
    return TensorSpec("m", pool, 0, slot, "w", "w", shape, "bfloat16", shape, (box,), storage)


def mxfp8_staging_case(device: torch.device) -> None:
    """A sender-quantized MXFP8 copy (parts padded) between tensors on `device`: the staged
    segment of each version is the sender's direct encoding, and the delta between them,
    landed through host copies of an MXFP8 destination holding the first version, leaves
    the second one's quantization (the wire's streams and the CPU reference, bit for bit)."""
    shape = (7, 100)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    plan = build_plan(
        "m", 1, [_spec("train", 0, shape, PLAIN)], [_spec("infer", 1, shape, MXFP8)],
        PlanConfig(sender_quantization=True),
    )  # fmt: skip
    src = full.to(device)
    data, scales = (torch.zeros_like(t, device=device) for t in formats.mxfp8_quantize(full))
    tensors = {
        0: ResolvedTensor("train/0/w", src),
        1: ResolvedTensor("infer/0/w", data, scales, MXFP8),
    }
    send = ProgramAccess(plan.program(0), tensors.__getitem__, lambda s: s)
    recv = ProgramAccess(plan.program(1), tensors.__getitem__, lambda s: s)
    ((sm,), (rm,)) = (list(send.sends.values()), list(recv.recvs.values()))
    (row,), (rrow,) = sm.rows, rm.rows
    assert send.wire(row) == MXFP8

    def streams(seg: torch.Tensor) -> list[torch.Tensor]:
        return segment_streams(MXFP8, shape, "bfloat16", seg)

    before = host.HostSources(send, sm.rows, device, "version 1").segment(row).clone()
    assert before.device.type == "cpu"
    t, off = recv.dst(rrow)
    region = region_streams(dest_region(t, off, shape))
    for r, part in zip(region, streams(before), strict=True):
        r.copy_(part.view(r.shape))  # version 1 landed (as a dense refit lands it)
    full[2, 3:40] += 1.0
    full[6, 99] = -0.0
    src.copy_(full)
    after = host.HostSources(send, sm.rows, device, "version 2").segment(row)
    direct = torch.zeros(send.seg_nbytes(row), dtype=torch.uint8, device=device)
    send.encode(row, direct)
    assert torch.equal(after, direct.cpu()) and not torch.equal(before, after)
    delta, _ = encode_parts(streams(before), streams(after))
    stats = host.through_host(region, lambda s: apply_parts(delta, s, name=t.name), t.name)
    assert 0 < stats.changed < stats.elements
    for r, part in zip(region, streams(after), strict=True):
        assert torch.equal(r.cpu().reshape(-1), part)
    want = formats.mxfp8_quantize(full)
    assert torch.equal(data.cpu(), want[0]) and torch.equal(scales.cpu(), want[1])
