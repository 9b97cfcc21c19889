"""Host staging of the delta path (refitd.executor.delta.host), which device slots use, run
here with CPU tensors standing for the device side: the same code, the same bytes. Delta
refits over real Gloo with every message staged land bit for bit and verify; a sender's
staged MXFP8 segments equal its direct encoding and a delta landed through host copies of
an MXFP8 destination reproduces the quantized version; staging without pinned memory (or
from a device it cannot stage) is a clear error."""

from __future__ import annotations

import pytest
import torch
from _delta_cluster import Cluster, mxfp8_staging_case

import refitd.executor.delta.exchange as dx
from refitd.executor.delta import host
from refitd.executor.delta.exchange import KIND_DELTA, KIND_DENSE

CPU = torch.device("cpu")


def test_staged_delta_refits_land_bit_for_bit_and_verify(monkeypatch) -> None:
    """Every message of three delta refits staged as a device slot's would be (the
    exchange's staging taken for CPU tensors): sources read from the staged copies,
    deltas applied to host copies of the destinations and copied back."""
    staged: list[str] = []
    real_sources, real_through = dx.HostSources, dx.through_host

    def sources(access, rows, device, what):  # the real class, counted
        staged.append("send")
        return real_sources(access, rows, device, what)

    def through(streams, apply, what):
        staged.append("land")
        return real_through(streams, apply, what)

    monkeypatch.setattr(dx, "on_device_memory", lambda device: True)
    monkeypatch.setattr(dx, "HostSources", sources)
    monkeypatch.setattr(dx, "through_host", through)
    c = Cluster(lr=1e-5)
    try:
        reps = c.refit(0, allowed={}, verify=True)  # no base yet: dense, staged both ways
        c.check()
        assert all(m["kind"] == KIND_DENSE for r in (0, 1) for m in reps[r].sent.values())
        assert staged.count("send") == sum(len(reps[r].sent) for r in (0, 1)) > 0
        for v in (1, 2, 3):
            for slot, b in c.bases.items():
                assert b.promote(v - 1, c.access[slot])
            c.step(v)
            staged.clear()
            reps = c.refit(v, verify=True)
            c.check()
            sent = {mid: m for r in (0, 1) for mid, m in reps[r].sent.items()}
            assert sent and all(m["kind"] == KIND_DELTA for m in sent.values()), v
            got = {mid: m for r in (2, 3) for mid, m in reps[r].received.items()}
            assert got.keys() == sent.keys()
            assert all(m["kind"] == KIND_DELTA for m in got.values())
            sums = {mid: s for r in (0, 1) for mid, s in reps[r].send_sums.items()}
            assert sums == {mid: s for r in (2, 3) for mid, s in reps[r].recv_sums.items()}
            copies = sum(
                len(c.access[r].recvs[mid].rows) for r in (2, 3) for mid in reps[r].received
            )
            assert staged.count("send") == len(sent) and staged.count("land") == copies
    finally:
        c.close()


def test_staged_mxfp8_segments_and_landing_bit_for_bit() -> None:
    """A sender-quantized MXFP8 copy (parts padded), staged and landed through host copies
    (_delta_cluster.mxfp8_staging_case)."""
    mxfp8_staging_case(CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory is available here")
def test_staging_without_pinned_memory_fails_clearly() -> None:
    what = "send of delta message 3 with rank 2"
    with pytest.raises(host.HostStagingError, match=r"message 3 .*needs pinned host memory"):
        host.host_empty((64,), torch.uint8, torch.device("cuda", 0), what)
    with pytest.raises(host.HostStagingError, match=r"stages only CUDA devices, not meta"):
        host.host_empty((64,), torch.uint8, torch.device("meta"), what)
