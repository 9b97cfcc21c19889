"""A `refitd` engine outside vLLM's own worker (the tests, `refitd bench backend`): the
worker's configuration for a model given by its transformers config (no checkpoint, no
GPU). `clients.engine_layouts.engine_module` makes the module a TP rank holds."""

from __future__ import annotations

from pathlib import Path

from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig

from clients.vllm_backend.plugin import BACKEND


def worker_config(
    hf_config: object, directory: str | Path, tp_size: int = 1, rank: int = 0
) -> VllmConfig:
    """The VllmConfig of TP rank `rank` of `tp_size` serving `hf_config` (saved as
    config.json in `directory`, where vLLM's ModelConfig reads it), weight transfer
    `refitd`, on the CPU."""
    hf_config.save_pretrained(str(directory))  # type: ignore[attr-defined]
    model = ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype="bfloat16")
    return VllmConfig(
        model_config=model,
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size, rank=rank),
        device_config=DeviceConfig(device="cpu"),
        weight_transfer_config=WeightTransferConfig(backend=BACKEND),
    )
