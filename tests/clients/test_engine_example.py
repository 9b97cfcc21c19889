"""The engine example: a serving loop keeps answering while refits land, and no answer is
ever computed from a mix of two versions; the vLLM-style extension registers a worker."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from clients.engine_example import RefitdWorker, RefitdWorkerExtension, TinyEngine
from refitd.client import TrainerClient
from refitd.demo.run import Daemon

pytestmark = pytest.mark.slow

N = 16


def _fill(weights: dict[str, torch.Tensor], version: int) -> None:
    for t in weights.values():
        t.fill_(version)


def _expected(version: int | None) -> float:
    v = version or 0
    return float(N * v * N * v)  # two layers of constant-v matrices applied to ones


def test_engine_pauses_around_updates_and_never_mixes_versions(daemon: Daemon) -> None:
    src = {n: torch.zeros(N, N, dtype=torch.bfloat16) for n in ("l0", "l1")}
    dst = {n: torch.zeros(N, N, dtype=torch.bfloat16) for n in ("l0", "l1")}
    engine = TinyEngine(dst).start()
    worker = RefitdWorker(daemon.address, "engine", "infer", 0, 1, "cpu:1",
                          pause=engine.pause, resume=engine.resume)  # fmt: skip
    trainer = TrainerClient(daemon.address, "engine", rank=0, pool_size=1, device="cpu:0")
    answers = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            answers.append(engine.submit(torch.ones(N)).result(timeout=30))

    load = threading.Thread(target=client, daemon=True)
    try:
        trainer.register(src)
        worker.register(dst)
        load.start()
        for v in (1, 2, 3):
            _fill(src, v)
            assert trainer.refit(v, wait="committed", timeout=60).state == "committed"
            time.sleep(0.2)  # let the engine serve the new version for a while
        deadline = time.monotonic() + 10
        while worker.served_version != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.served_version == 3
    finally:
        stop.set()
        load.join(30)
        engine.stop()
        worker.close()
        trainer.close()
    torn = [(a.version, a.output[0].item()) for a in answers
            if not torch.all(a.output == _expected(a.version))]  # fmt: skip
    assert torn == []
    assert {a.version for a in answers} >= {1, 2, 3}


def test_vllm_style_extension_registers_the_workers_model(daemon: Daemon) -> None:
    class Worker(RefitdWorkerExtension):  # what vLLM builds with worker_extension_cls
        def __init__(self, model: torch.nn.Module) -> None:
            self.model_runner = SimpleNamespace(model=model)
            self.rank = 0
            self.device = torch.device("cpu")

    model = torch.nn.Linear(8, 4, bias=False, dtype=torch.bfloat16)
    worker = Worker(model)
    src = {"weight": torch.randn(4, 8).to(torch.bfloat16)}
    trainer = TrainerClient(daemon.address, "vllm-ext", rank=0, pool_size=1, device="cpu:0")
    try:
        trainer.register(src)
        assert worker.refitd_register(daemon.address, "vllm-ext", "infer", 1)
        assert trainer.refit(1, wait="committed", timeout=60).state == "committed"
        assert torch.equal(model.weight, src["weight"])
        deadline = time.monotonic() + 10
        while worker.refitd_served_version() != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.refitd_served_version() == 1
    finally:
        worker.refitd_close()
        trainer.close()
