"""NVFP4 storage through a real `refitd serve`: an inference pool registers persistent NVFP4
buffers (packed data, E4M3 scales, FP32 global scale) with the client library, a trainer
rank holding whole tensors refits twice, and every shard equals refitd.formats' NVFP4 of
its rows of the global tensor, bit for bit, in buffers that never moved. Run with the
receiver quantizing (raw wire) and with `--sender-quantization` (NVFP4 wire)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
import torch

from refitd.client import InferenceClient, Placed, TrainerClient, VersionEvent
from refitd.demo.run import Daemon
from refitd.formats import nvfp4_quantize
from refitd.plan.wire import nvfp4_data_shape, nvfp4_scale_shape

pytestmark = pytest.mark.slow

SHAPES = {"w": (64, 96), "o": (32, 160)}  # "o" stays plain BF16
TP = 2  # inference ranks, each holding half of the rows


def global_weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + version)
    return {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in SHAPES.items()}


@pytest.fixture(scope="module", params=[False, True], ids=["receiver", "sender"])
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    extra = ["--pause-timeout-s", "20"] + (["--sender-quantization"] if request.param else [])
    d = Daemon(cpu_slots=3, extra_args=extra)
    d.start()
    try:
        yield d
    finally:
        d.stop()


class Commits:
    """The COMMIT versions an inference client saw, waited on as a condition."""

    def __init__(self, client: InferenceClient) -> None:
        self._cond = threading.Condition()
        self.versions: list[int] = []
        client.on_update(self._on)

    def _on(self, event: VersionEvent) -> None:
        with self._cond:
            if event.kind == "commit":
                self.versions.append(event.version)
            self._cond.notify_all()

    def wait(self, version: int, timeout_s: float = 60.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: version in self.versions, timeout_s), version


def _nvfp4_buffers(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(nvfp4_data_shape(shape), dtype=torch.uint8),
        torch.zeros(nvfp4_scale_shape(shape), dtype=torch.uint8),
        torch.zeros(1),
    )


def test_nvfp4_pool_refits_bit_for_bit(daemon: Daemon) -> None:
    weights = global_weights(1)
    held = {n: t.clone() for n, t in weights.items()}
    trainer = TrainerClient(daemon.address, "nvfp4", rank=0, pool_size=1, device="cpu:0")
    infers, buffers, plain = [], [], []
    try:
        trainer.register(held)
        for r in range(TP):
            rows = SHAPES["w"][0] // TP
            local = (rows, SHAPES["w"][1])
            data, scales, gscale = _nvfp4_buffers(local)
            o_rows = SHAPES["o"][0] // TP
            o = torch.zeros(o_rows, SHAPES["o"][1], dtype=torch.bfloat16)
            client = InferenceClient(
                daemon.address, "nvfp4", "infer", rank=r, pool_size=TP, device=f"cpu:{r + 1}"
            )
            client.register(
                {
                    "w": Placed(
                        data,
                        SHAPES["w"],
                        [((r * rows, 0), local, (0, 0))],
                        storage="nvfp4",
                        scales=scales,
                        global_scale=gscale,
                        dtype="bfloat16",
                    ),
                    "o": Placed(o, SHAPES["o"], [((r * o_rows, 0), tuple(o.shape), (0, 0))]),
                }
            )
            infers.append(client)
            buffers.append((data, scales, gscale))
            plain.append(o)
        commits = [Commits(c) for c in infers]
        ptrs = [[b.data_ptr() for b in bufs] for bufs in buffers]
        for version in (1, 2):
            weights = global_weights(version)
            for n, t in weights.items():
                held[n].copy_(t)  # in place, as an optimizer step does
            result = trainer.refit(version, wait="committed", timeout=60)
            assert result.state == "committed", result
            for c in commits:
                c.wait(version)
            for r in range(TP):
                rows = SHAPES["w"][0] // TP
                want = nvfp4_quantize(weights["w"][r * rows : (r + 1) * rows])
                for got, expect in zip(buffers[r], want, strict=True):
                    assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8)), r
                o_rows = SHAPES["o"][0] // TP
                assert torch.equal(plain[r], weights["o"][r * o_rows : (r + 1) * o_rows])
        assert ptrs == [[b.data_ptr() for b in bufs] for bufs in buffers]
        wire = "nvfp4" if "--sender-quantization" in daemon.extra_args else "raw"
        with httpx.Client(base_url=daemon.status_url.rstrip("/"), timeout=30) as http:
            params = {"model": "nvfp4", "tensor": "w", "pool": "infer", "rank": 1}
            [shard] = http.get("/v1/explain", params=params).json()["shards"]
        assert shard["storage"] == "nvfp4" and [f["wire"] for f in shard["feeds"]] == [wire]
    finally:
        for c in infers:
            c.close()
        trainer.close()
