"""Helpers of the vLLM backend and SGLang loader tests: what is installed, engine ranks as
modules, and the trainer processes (a Megatron tp=2 trainer driven by commands, an FSDP2
trainer on vLLM's trainer API hosting the engine ranks it feeds)."""

from __future__ import annotations

import os
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

# vLLM reads a local config.json only; nothing may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
INSTALL = "`make install` installs it (scripts/install_engines.sh, requirements/engines.txt)"


def require_vllm() -> None:
    """Skip, naming what is missing, unless vLLM 0.33.0's weight-transfer classes import."""
    _require("vllm", VLLM_VERSION, "vllm.distributed.weight_transfer", "vllm.config")


def require_sglang() -> None:
    """Skip, naming what is missing, unless SGLang 0.5.23's request classes import. Without
    torchvision (PyPI has only CUDA builds of it for Linux, which fail beside a CPU torch),
    SGLang's module-level torchvision imports get _torchvision_stand_in's stand-ins."""
    import contextlib
    import importlib.util

    from _torchvision_stand_in import torchvision_stand_in

    absent = importlib.util.find_spec("torchvision") is None
    with torchvision_stand_in() if absent else contextlib.nullcontext():
        _require("sglang", SGLANG_VERSION, "sglang.srt.managers.io_struct", "sglang.srt.utils")


def _require(dist: str, version: str, *modules: str) -> None:
    import importlib
    import importlib.metadata as md

    try:
        found = md.version(dist)
    except md.PackageNotFoundError:
        pytest.skip(f"{dist}=={version} is not installed; {INSTALL}", allow_module_level=True)
    if found != version:
        pytest.skip(
            f"{dist} {found} is installed, these tests need {dist}=={version}; {INSTALL}",
            allow_module_level=True,
        )
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            pytest.skip(
                f"{dist}=={version} is installed but {module} does not import here: "
                f"{exc!r}; {INSTALL}",
                allow_module_level=True,
            )


def vllm_engines(
    cfg: object, ranks: list[dict[str, torch.Tensor]], device: torch.device | None = None
) -> list[Any]:
    """vLLM's factory builds a `refitd` engine for each TP rank's tensors (each rank's
    dict then holds the module's own parameters, which registration moves in place)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from clients.engine_layouts import engine_module
    from clients.vllm_backend import register
    from clients.vllm_backend.offline import worker_config

    register()
    engines = []
    for r, held in enumerate(ranks):
        module = engine_module(held)
        ranks[r] = dict(module.named_parameters())
        vc = worker_config(cfg, tempfile.mkdtemp(prefix="refitd-vllm-"), len(ranks), r)
        engines.append(
            WeightTransferEngineFactory.create_engine(
                vc.weight_transfer_config, vc, device or torch.device("cpu"), module
            )
        )
    return engines


def on_all(fns: list[Callable[[], Any]], timeout_s: float = 240.0) -> list[Any]:
    """Run the calls at once, one thread each (as vLLM's workers run one RPC), and return
    their results; re-raises the first failure."""
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"worker calls still running after {timeout_s:.0f} s")
    if errors:
        raise errors[0]
    return out


class LocalWorkers:
    """vLLM's VLLMWeightSyncClient protocol over engines in this process: each call runs on
    every engine at once, and finish records the weight version as vLLM's LLM does."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines
        self.weight_version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        on_all(
            [lambda e=e: e.init_transfer_engine(e.parse_init_info(init_info)) for e in self.engines]
        )

    def start_weight_update(self) -> None:
        on_all([e.start_weight_update for e in self.engines])

    def update_weights(self, update_info: dict[str, Any]) -> None:
        on_all([lambda e=e: e.update_weights(update_info) for e in self.engines])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        on_all([e.finish_weight_update for e in self.engines])
        if weight_version is not None:
            self.weight_version = weight_version


class NotTheSender:
    """The client a non-sender trainer rank holds: vLLM's engines never call it there."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a non-sender trainer rank called client.{name}")


def megatron_rank(
    rank: int, controller: str, model_name: str, kind: str, seeds: dict[int, int],
    commands: Any, results: Any,
) -> None:  # fmt: skip
    """Megatron rank r of tp=2 (pp=1) of `kind`; on ("refit", v) its tensors take the
    weights of model(kind, seeds[v]) in place and it refits v; ("stop",) ends it."""
    from _hf_models import megatron_weights, model

    from clients.megatron_adapter import ParallelState, register_megatron
    from clients.megatron_adapter.toy import build_rank_module
    from refitd.client import TrainerClient

    trainer = None
    try:
        state = ParallelState(tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1)

        def rank_module(seed: int) -> torch.nn.Module:
            ref = model(kind, seed)
            return build_rank_module(
                megatron_weights(kind, ref), ref.config.num_hidden_layers, state, 0
            )

        module = rank_module(seeds[min(seeds)])
        trainer = TrainerClient(
            controller, model_name, rank=rank, pool_size=2, device=f"cpu:{rank}"
        )
        register_megatron(trainer, module, state)
        results.put((rank, "registered", None))
        while True:
            cmd = commands.get(timeout=300)
            if cmd[0] == "stop":
                return
            v = cmd[1]
            with torch.no_grad():
                new = dict(rank_module(seeds[v]).named_parameters())
                for n, p in module.named_parameters():
                    p.copy_(new[n])
            results.put((rank, v, trainer.refit(v, wait="committed", timeout=120).state))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if trainer is not None:
            trainer.close()


def fsdp_vllm_rank(
    rank: int, port: int, controller: str, model_name: str, kind: str, seeds: tuple[int, int],
    results: Any,
) -> None:  # fmt: skip
    """FSDP2 rank of 2 (Gloo) of model(kind, seeds[0]) on vLLM's trainer API with the
    `refitd` backend; rank 0 (the sender) hosts the two vLLM engine ranks it feeds. Sends
    v1, then takes model(kind, seeds[1])'s weights in place and sends v2; rank 0 reports
    each engine tensor against what vLLM's loaders make of each version's weights."""
    import torch.distributed as dist
    from _engine_models import EngineModel
    from _hf_models import config, model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from clients.engine_layouts import EngineParallel, engine_layout_for
    from clients.vllm_backend.trainer import RefitdTrainerInitInfo

    engine_trainer = None
    engines: list[Any] = []
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        mesh = init_device_mesh("cpu", (2,))
        m = model(kind, seeds[0])
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        client: Any = NotTheSender()
        eng = None
        if rank == 0:
            cfg = config(kind)
            lays = [
                engine_layout_for(cfg, EngineParallel(2, r), "vllm", source_naming="hf")
                for r in (0, 1)
            ]
            shapes = [{t.name: t.local_shape for t in lay.tensors} for lay in lays]
            eng = EngineModel(model(kind, 0), 2, 1, "vllm", lambda r: shapes[r])
            engines = vllm_engines(cfg, eng.ranks)
            client = LocalWorkers(engines)
        info = RefitdTrainerInitInfo(
            controller, model_name, rank=rank, pool_size=2, device=f"cpu:{rank}"
        )
        engine_trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=ModuleSource(m)
        )
        for v, seed in enumerate(seeds, start=1):
            if v > 1:  # an optimizer step: new values in the DTensors' own shards
                with torch.no_grad():
                    new = dict(model(kind, seed).named_parameters())
                    for n, p in m.named_parameters():
                        local = distribute_tensor(new[n], mesh, p.placements, src_data_rank=None)
                        p.to_local().copy_(local.to_local())
            result = engine_trainer.send_weights()
            report: Any = (result.version, result.state)
            if rank == 0:
                from _engine_models import loaded_buffers

                want = model(kind, seed).state_dict()
                bad = [(r, n) for r in (0, 1) for n, t in loaded_buffers(eng, r, want).items()
                       if not torch.equal(eng.ranks[r][n], t)]  # fmt: skip
                served = [e.served_version for e in engines]
                report = (*report, bad, served, client.weight_version)
            results.put((rank, v, report))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if engine_trainer is not None:
            engine_trainer.shutdown()
        for e in engines:
            e.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
