"""Delta refits from and to a GPU slot end to end: `refitd serve --delta-refits
--verify-checksums` with slots cuda:0 and cpu:1 (transfer processes over Gloo, one GPU).
A trainer on the GPU slot feeds an engine on the CPU slot (the sender stages through
pinned host memory), and a trainer on the CPU slot an engine on the GPU slot (the receiver
applies deltas to host copies of its destination regions); in both, the first version
goes dense and three delta versions land bit for bit, verified, sent as deltas."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from refitd.demo.run import Daemon

from .test_delta_e2e import DELTA_PATH_ARGS, Trainer, _infer, _records, _same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU, CPU = "cuda:0", "cpu:1"


@pytest.fixture(scope="module")
def gpu_delta_daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=1, extra_args=["--devices", f"{GPU},{CPU}", *DELTA_PATH_ARGS])
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.mark.parametrize("sender", ["gpu", "cpu"])
def test_delta_refits_from_and_to_a_gpu_slot(gpu_delta_daemon: Daemon, sender: str) -> None:
    d = gpu_delta_daemon
    model = f"gpudelta-{sender}"
    trainer_on, engine_on = (GPU, CPU) if sender == "gpu" else (CPU, GPU)
    tr = Trainer(d.address, model, lr=1e-6, device=trainer_on)
    dst = tr.fresh(engine_on)
    assert all(t.is_cuda == (engine_on == GPU) for t in dst.values())
    infer = _infer(d, model, "engine", engine_on, dst)
    try:
        for v in range(1, 5):
            if v > 1:
                tr.step()
            tr.refit(v)
            assert _same(dst, tr.src) == [], v
        rec = _records(d, model)
        assert rec[1]["delta"]["delta_messages"] == 0  # no base yet: dense
        for v in (2, 3, 4):
            x = rec[v]["delta"]
            assert x["sent_as_delta"] > 0 and x["sent_dense"] == 0, x
            assert 0 < x["density"] < 0.2, x
            assert x["wire_bytes"] < 0.3 * x["dense_wire_bytes"], x
            assert rec[v]["verified"] is True
    finally:
        infer.close()
        tr.client.close()
