"""The vLLM backend's engine-side sequence on one GPU: two engine ranks (TP 2, vLLM layout)
whose parameters live on cuda:0 register through CUDA IPC handles, and start -> update ->
finish lands an HF-named trainer's version (its tensors on the same GPU) bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _backend_workers import on_all, require_vllm, vllm_engines
from _engine_models import EngineModel, loaded_buffers
from _hf_models import LLAMA, config, model

from clients.engine_layouts import EngineParallel, engine_layout_for
from refitd.client import TrainerClient
from refitd.demo.run import Daemon

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=1, extra_args=["--devices", "cuda:0", "--pause-timeout-s", "20"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


def test_engine_sequence_lands_a_version_through_cuda_ipc(gpu_daemon: Daemon) -> None:
    require_vllm()
    cfg = config(LLAMA)
    lays = [
        engine_layout_for(cfg, EngineParallel(2, r), "vllm", source_naming="hf") for r in (0, 1)
    ]
    shapes = [{t.name: t.local_shape for t in lay.tensors} for lay in lays]
    eng = EngineModel(model(LLAMA, 0), 2, 1, "vllm", lambda r: shapes[r])
    eng.ranks = [{n: t.cuda() for n, t in held.items()} for held in eng.ranks]
    engines = vllm_engines(cfg, eng.ranks, torch.device("cuda:0"))
    ref = model(LLAMA, 61)
    src = {n: t.detach().cuda() for n, t in ref.state_dict().items()}
    trainer = TrainerClient(gpu_daemon.address, "vllm-gpu", rank=0, pool_size=1, device="cuda:0")
    try:
        trainer.register(src)
        for e in engines:
            e.init_transfer_engine(
                e.parse_init_info({"controller": gpu_daemon.address, "model": "vllm-gpu"})
            )
        on_all([e.start_weight_update for e in engines])
        done = on_all([
            lambda: on_all([lambda e=e: e.update_weights({"version": 1}) for e in engines]),
            lambda: trainer.refit(1, wait="committed", timeout=120),
        ])  # fmt: skip
        assert done[1].state == "committed"
        on_all([lambda e=e: e.finish_weight_update("1") for e in engines])
        assert [e.served_version for e in engines] == [1, 1]
        want = ref.state_dict()
        cpu = EngineModel(model(LLAMA, 0), 2, 1, "vllm", lambda r: shapes[r])
        cpu.ranks = [{n: t.cpu() for n, t in held.items()} for held in eng.ranks]
        bad = [(r, n) for r in (0, 1) for n, t in loaded_buffers(cpu, r, want).items()
               if not torch.equal(cpu.ranks[r][n], t)]  # fmt: skip
        assert bad == []
        assert all(t.is_cuda for held in eng.ranks for t in held.values())
    finally:
        trainer.close()
        for e in engines:
            e.shutdown()
