"""Delta refits between GPU slots: every rank's tensors on cuda:0, four ranks over real Gloo
in threads of this process. The senders stage their live segments through pinned host
memory and encode against their host bases; the receivers apply the deltas to host copies
of their destinations and copy them back. A dense first version and three delta versions
land bit for bit, and the checksums of the reconstructed destinations agree. An MXFP8 copy
(quantized on the device) stages and lands through host memory bit for bit."""

from __future__ import annotations

import pytest
import torch
from _delta_cluster import Cluster, mxfp8_staging_case

from refitd.executor.delta.exchange import KIND_DELTA, KIND_DENSE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_gpu_slots_take_the_delta_path_bit_for_bit() -> None:
    c = Cluster(lr=1e-5, device="cuda:0")
    try:
        assert all(t.is_cuda for t in c.tensors)
        reps = c.refit(0, allowed={}, verify=True)  # no base yet: dense
        c.check()
        assert all(m["kind"] == KIND_DENSE for r in (0, 1) for m in reps[r].sent.values())
        for v in (1, 2, 3):
            for slot, b in c.bases.items():
                assert b.promote(v - 1, c.access[slot]) and b.version == v - 1
            c.step(v)
            reps = c.refit(v, verify=True)
            c.check()
            sent = {mid: m for r in (0, 1) for mid, m in reps[r].sent.items()}
            got = {mid: m for r in (2, 3) for mid, m in reps[r].received.items()}
            assert sent and got.keys() == sent.keys(), v
            assert all(m["kind"] == KIND_DELTA for m in [*sent.values(), *got.values()]), v
            density = sum(m["changed"] for m in sent.values()) / sum(
                m["elements"] for m in sent.values()
            )
            assert 0 < density < 0.4, v
            assert sum(m["nbytes"] for m in sent.values()) < sum(
                m["dense_nbytes"] for m in sent.values()
            )
            sums = {mid: s for r in (0, 1) for mid, s in reps[r].send_sums.items()}
            assert sums == {mid: s for r in (2, 3) for mid, s in reps[r].recv_sums.items()}, v
        assert all(b.base and all(not t.is_cuda for t in b.base.values())
                   for b in c.bases.values())  # fmt: skip
    finally:
        c.close()


def test_gpu_mxfp8_copy_stages_and_lands_bit_for_bit() -> None:
    mxfp8_staging_case(torch.device("cuda", 0))
