"""Staged destinations in real transfer processes: the refit fills staging, apply copies it."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from _transport_layouts import expected, fill_sources, globals_for, make_model

from refitd.memory.arena import SharedTensorArena
from refitd.node.process_handle import TransferProcessError, TransferProcessHandle
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import encode_program
from refitd.slot_protocol import Apply, Connect, Execute, Load, Unload

pytestmark = pytest.mark.slow


def test_staging_fills_then_apply_lands_bit_for_bit() -> None:
    handles = [TransferProcessHandle(slot) for slot in range(2)]
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    arena = SharedTensorArena(prefix="refitd-test-staged")
    try:
        pending = [
            h.send(Connect(1, "127.0.0.1", store.port, h.slot, 2, "gloo", 20.0)) for h in handles
        ]
        for p in pending:
            p.result()
        # source TP=2 on slots 0,1; destination TP=3 on slots 1,0,1 (messages and local copies)
        src, dst = make_model(2, 3, [0, 1], [1, 0, 1])
        tensors = [torch.zeros(s.local_shape, dtype=getattr(torch, s.dtype)) for s in src + dst]
        mem = arena.register({f"t{i}": t for i, t in enumerate(tensors)})
        staged = set(range(len(src), len(src) + len(dst)))
        plan = build_plan("m", 1, src, dst, PlanConfig(bucket_bytes=2048))

        def load(digest: str, program_of) -> None:
            for h in handles:
                p = program_of(h.slot)
                load = Load(
                    digest,
                    encode_program(p),
                    {i: mem[f"t{i}"].to_bytes() for i in p.tensors},
                    staging_bytes=2048,
                    wire_chunk=512,
                    staged=tuple(sorted(staged & set(p.tensors))),
                    model="m",
                )
                h.send(load).result()

        def refit(refit_id: int) -> None:
            runs = [h.send(Execute(plan.digest, 1, refit_id, 20.0)) for h in handles]
            for r in runs:
                r.result()

        def live_dst() -> list[torch.Tensor]:
            return [t.clone() for t in tensors[len(src) :]]

        load(plan.digest, plan.program)
        for refit_id, seed in ((1, 5), (2, 6)):
            g = globals_for(seed)
            before = live_dst()
            for t, v in zip(tensors, fill_sources(src, g), strict=False):
                t.copy_(v)
            refit(refit_id)
            # Only staging was written: the live destinations hold the previous version.
            assert all(torch.equal(a, b) for a, b in zip(before, live_dst(), strict=True))
            with pytest.raises(TransferProcessError, match="staging buffers hold refit"):
                handles[0].send(Apply(plan.digest, refit_id + 100, 10.0)).result()
            # A reload of the same plan (after a reconnect) keeps the filled staging.
            load(plan.digest, plan.program)
            applies = [h.send(Apply(plan.digest, refit_id, 10.0)) for h in handles]
            copied = sum(a.result().bytes for a in applies)
            assert copied == sum(t.numel() * t.element_size() for t in tensors[len(src) :])
            for i, d in enumerate(dst):
                assert torch.equal(tensors[len(src) + i], expected(d, g)), (d.name, d.rank)
        # A newer plan of the model frees the staging of the older one (another layout
        # identity: here another bucket size; a new epoch alone keeps the digest).
        newer = build_plan("m", 2, src, dst, PlanConfig(bucket_bytes=4096))
        assert newer.digest != plan.digest
        load(newer.digest, newer.program)
        assert not handles[0].send(Unload(plan.digest)).result().unloaded
        assert handles[0].send(Unload(newer.digest)).result().unloaded
    finally:
        arena.close()
        for h in handles:
            h.close()
