"""Snapshot of GPU sources: in device memory when it fits, else pinned host memory; the
executor's local copies read the snapshot while the live sources are overwritten."""

from __future__ import annotations

import pytest
import torch
from _transport_layouts import expected, fill_sources, globals_for, make_model

from refitd.executor.run import DirectResolver, Executor
from refitd.executor.segments import ResolvedTensor
from refitd.plan.planner import PlanConfig, build_plan
from refitd.transfer import snapshot as snapshot_mod
from refitd.transfer.snapshot import SnapshotResolver, prepare_snapshot

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("where", ["device", "pinned_host"])
def test_gpu_snapshot_lands_the_captured_version(where: str, monkeypatch) -> None:
    if where == "pinned_host":  # no room on the device: the snapshot goes to pinned memory
        monkeypatch.setattr(snapshot_mod, "DEVICE_MARGIN", 1 << 60)
    dev = torch.device("cuda", 0)
    src, dst = make_model(1, 2, [0], [0, 0], {"col": "float32"})
    tensors = [t.to(dev) for t in fill_sources(src, globals_for(41))]
    tensors += [torch.zeros(d.local_shape, dtype=getattr(torch, d.dtype), device=dev) for d in dst]
    plan = build_plan("gpu-snap", 1, src, dst, PlanConfig(allow_dtype_cast=True))
    program = plan.program(0)
    specs = [*src, *dst]
    base = DirectResolver({i: ResolvedTensor(specs[i].name, tensors[i]) for i in range(len(specs))})
    snap = prepare_snapshot(program, base, range(len(src)), 1 << 30)
    assert snap.active and snap.where == where, snap.fallback
    ex = Executor(program, SnapshotResolver(base, snap), None, device=dev)
    snap.capture()
    for t, v in zip(tensors, fill_sources(src, globals_for(42)), strict=False):
        t.copy_(v)  # the trainer writes its next step after the release
    ex.run(60.0)
    torch.cuda.synchronize()
    g = globals_for(41)
    for i, d in enumerate(dst):
        assert torch.equal(tensors[len(src) + i].cpu(), expected(d, g)), (d.name, d.rank)
