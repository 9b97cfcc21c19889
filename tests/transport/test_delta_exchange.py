"""Delta messages over real Gloo (ranks in threads of this process): five successive delta
refits land bit for bit, a destination that missed a version gets dense, a delta applied to
the wrong base is caught by the checksums of the reconstructed destination, and the sender's
base only advances on promote."""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist
from _transport_layouts import expected, make_model, shard

from refitd.demo.versions import VersionGenerator
from refitd.executor.delta.access import ProgramAccess
from refitd.executor.delta.exchange import (
    KIND_DELTA,
    KIND_DENSE,
    UNKNOWN,
    DeltaBase,
    DeltaReport,
    exchange_deltas,
)
from refitd.executor.segments import ResolvedTensor
from refitd.plan.planner import PlanConfig, build_plan
from refitd.transport.base import ConnectInfo
from refitd.transport.gloo import GlooTransport

WORLD = 4  # sources on slots 0, 1; destinations on slots 2, 3


class Cluster:
    """Two source and two destination ranks of the test layout, one transport each, and a
    global FP32 master per tensor stepping by +-lr (BF16 versions)."""

    def __init__(self, lr: float) -> None:
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
        self.tensors = [shard(self.globals[s.name], s).clone() for s in self.src]
        self.tensors += [torch.zeros(d.local_shape, dtype=torch.bfloat16) for d in self.dst]
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
            got = self.tensors[len(self.src) + i]
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


def test_five_successive_delta_refits_bit_for_bit() -> None:
    c = Cluster(lr=1e-5)
    try:
        c.refit(0, allowed={})  # version 0: everything dense
        c.check()
        for v in range(1, 6):
            for slot, b in c.bases.items():
                assert b.promote(v - 1, c.access[slot])  # v - 1 committed everywhere
            c.step(v)
            reps = c.refit(v)
            c.check()
            sent = [m for r in (0, 1) for m in reps[r].sent.values()]
            assert all(m["kind"] == KIND_DELTA for m in sent)
            density = sum(m["changed"] for m in sent) / sum(m["elements"] for m in sent)
            assert 0 < density < 0.4
            assert sum(m["nbytes"] for m in sent) < sum(m["dense_nbytes"] for m in sent)
    finally:
        c.close()


def test_missed_version_gets_dense_and_wrong_base_is_caught() -> None:
    c = Cluster(lr=1e-5)
    try:
        c.refit(0, allowed={})
        for slot, b in c.bases.items():
            assert b.promote(0, c.access[slot])
        # slot 3 restarts: its memory no longer holds version 0
        for i, d in enumerate(c.dst):
            if d.slot == 3:
                c.tensors[len(c.src) + i].fill_(0)
        to3 = {r: {m.mid for m in c.access[r].sends.values() if m.peer == 3} for r in (0, 1)}
        c.step(1)
        # a delta to slot 3 anyway (what the controller must never allow) lands wrong, and
        # the checksums of the reconstructed destination say so
        reps = c.refit(1, allowed=None, verify=True)
        bad = {m for r in (0, 1) for m in to3[r]}
        for mid in bad:
            send = next(reps[r].send_sums[mid] for r in (0, 1) if mid in reps[r].send_sums)
            assert reps[3].recv_sums[mid] != send
        for mid, s in reps[2].recv_sums.items():
            assert s == next(reps[r].send_sums[mid] for r in (0, 1) if mid in reps[r].send_sums)
        # the retry (same version): slot 3's messages dense, the others delta
        allowed = {r: {m for m in c.access[r].sends} - to3[r] for r in (0, 1)}
        reps = c.refit(1, allowed=allowed, verify=True)
        c.check()
        for r in (0, 1):
            for mid, m in reps[r].sent.items():
                assert m["kind"] == (KIND_DENSE if mid in to3[r] else KIND_DELTA)
                assert reps[r].send_sums[mid] == reps[2 + (mid in bad)].recv_sums[mid]
    finally:
        c.close()


def test_base_advances_only_on_promote() -> None:
    """A version that was sent but not promoted (a failed refit) leaves the base where it
    was; the next delta is against the old base and lands on destinations that hold it."""
    c = Cluster(lr=1e-6)
    try:
        c.refit(0, allowed={})
        for slot, b in c.bases.items():
            assert b.promote(0, c.access[slot]) and b.version == 0
        before = [t.clone() for t in c.tensors[len(c.src) :]]
        c.step(1)
        c.refit(1)  # version 1 is sent, then (say) fails to commit: destinations roll back
        for t, old in zip(c.tensors[len(c.src) :], before, strict=True):
            t.copy_(old)
        assert all(b.version == 0 for b in c.bases.values())
        c.step(2)
        reps = c.refit(2)  # deltas from version 0
        c.check()
        assert all(m["kind"] == KIND_DELTA for r in (0, 1) for m in reps[r].sent.values())
        for slot, b in c.bases.items():
            assert not b.promote(1, c.access[slot]) and b.version == UNKNOWN
    finally:
        c.close()


def test_clearly_dense_message_skips_the_full_encode(monkeypatch) -> None:
    """A message whose sampled density is well above the threshold goes dense without a
    full delta encode (no encode buffer is made for it), reports the estimated density,
    and lands bit for bit; at a low density the full encode still runs and sends deltas."""
    import refitd.executor.delta.exchange as dx

    monkeypatch.setattr(dx, "SAMPLE_MIN_BYTES", 0)  # every message of the small test model
    monkeypatch.setattr(dx, "SAMPLE_STRIDE", 1)
    c = Cluster(lr=1e-3)
    try:
        c.refit(0, allowed={})
        for slot, b in c.bases.items():
            assert b.promote(0, c.access[slot])
        c.step(1)
        reps = c.refit(1)
        c.check()
        sent = [(r, mid, m) for r in (0, 1) for mid, m in reps[r].sent.items()]
        assert sent and all(m["kind"] == KIND_DENSE for _, _, m in sent)
        assert all(m["changed"] / m["elements"] > 0.5 for _, _, m in sent)
        assert all(mid not in c.bases[r].sinks for r, mid, _ in sent)
    finally:
        c.close()
