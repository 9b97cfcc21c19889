"""A worker extension that an engine's workers mix in to take refits from refitd.

vLLM: `LLM(..., worker_extension_cls="clients.engine_example.extension.RefitdWorkerExtension")`
adds these methods to every worker; the driver calls them with `llm.collective_rpc(...)`.
SGLang: call `RefitdWorker` from the model runner (see README.md). Each worker registers
its own weights (CUDA IPC handles on GPU, shared memory on CPU) and pauses its engine
around every update, so the weights are written in place while nothing reads them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from clients.engine_layouts import (
    EngineLayout,
    EngineParallel,
    engine_layout_for,
    register_engine,
)
from refitd.client import InferenceClient


class RefitdWorker:
    """One inference worker's link to refitd: registration and the pause/resume hooks."""

    subscribe_timeout_s = 30.0

    def __init__(
        self,
        controller: str,
        model: str,
        pool: str,
        rank: int,
        pool_size: int,
        device: str,
        pause: Callable[[int], None],
        resume: Callable[[int], None],
    ) -> None:
        self.client = InferenceClient(
            controller, model, pool, rank=rank, pool_size=pool_size, device=device,
            pause=pause, resume=resume, incomplete=lambda v, why: pause(v),
        )  # fmt: skip

    def register(self, tensors: torch.nn.Module | dict[str, Any]) -> str:
        """Register the weights (a module, or name -> tensor / Placed) and follow events."""
        self.client.register(tensors)
        return self._follow()

    def register_engine(
        self,
        params: Mapping[str, torch.Tensor],
        layout: EngineLayout,
        storage: Mapping[str, str] | None = None,
        scales: Mapping[str, torch.Tensor] | None = None,
    ) -> str:
        """Register an engine rank's own parameters (vLLM / SGLang names: fused qkv_proj,
        gate_up_proj, w13/w2, padded vocabulary) through its engine layout
        (clients.engine_layouts), and follow events."""
        register_engine(self.client, params, layout, storage, scales)
        return self._follow()

    def _follow(self) -> str:
        hello = threading.Event()
        self.client.on_update(lambda event: hello.set() if event.kind == "hello" else None)
        if not hello.wait(self.subscribe_timeout_s):  # refits need this worker subscribed
            raise TimeoutError(f"no subscription to refitd within {self.subscribe_timeout_s} s")
        return self.client.worker_id

    @property
    def served_version(self) -> int | None:
        return self.client.served_version

    def close(self) -> None:
        self.client.close()


class RefitdWorkerExtension:
    """Methods for vLLM's worker_extension_cls (mixed into each GPU worker).

    Uses the worker's `model_runner.model`, `rank` and `device`; `pause`/`resume` default to
    hooks that only record the state (vLLM's scheduler is paused from the driver, see
    README.md); an engine with a per-worker way to stop reading weights passes it in.
    """

    model_runner: Any
    rank: int
    device: Any
    _refitd: RefitdWorker | None = None

    def refitd_register(
        self,
        controller: str,
        model: str,
        pool: str,
        pool_size: int,
        weights: Any = None,
        engine: str = "",
        ep_size: int = 1,
        hf_config: Any = None,
        source_naming: str = "megatron",
    ) -> str:
        """Register this worker's weights. engine="vllm" (or "sglang"): the model runner's
        own parameters through the engine layout of `hf_config` (default: the runner's
        model_config.hf_config) for TP = pool_size, this worker's rank, EP = ep_size,
        reading a trainer named as `source_naming` says ("megatron", or "hf" for a
        transformers model under FSDP2 / DDP); engine="": `weights` (or the module) as
        they are (HF names / Placed)."""
        module = weights if weights is not None else self.model_runner.model
        device = f"{torch.device(self.device).type}:{torch.device(self.device).index or 0}"
        self._refitd = RefitdWorker(
            controller, model, pool, self.rank, pool_size, device,
            pause=lambda v: None, resume=lambda v: None,
        )  # fmt: skip
        if not engine:
            return self._refitd.register(module)
        cfg = hf_config if hf_config is not None else self.model_runner.model_config.hf_config
        parallel = EngineParallel(pool_size, self.rank, ep_size)
        layout = engine_layout_for(cfg, parallel, engine, source_naming=source_naming)
        return self._refitd.register_engine(dict(module.named_parameters()), layout)

    def refitd_served_version(self) -> int | None:
        return self._refitd.served_version if self._refitd else None

    def refitd_close(self) -> None:
        if self._refitd is not None:
            self._refitd.close()
            self._refitd = None
