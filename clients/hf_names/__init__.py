"""Megatron -> Hugging Face naming: name maps (Llama/Qwen2, DeepSeek-V3/Kimi-K2) and the
inference-side registration of an HF model against a Megatron trainer.

    name_map = name_map_for(hf_model.config)
    engine = InferenceClient(controller, "gpt", pool="infer", ...)
    register_hf(engine, hf_model, name_map)
"""

from clients.hf_names.destination import (
    apply_name_map,
    hf_checkpoint_tensors,
    register_hf,
    source_extents,
)
from clients.hf_names.maps import (
    DeepseekV3Dims,
    LlamaDims,
    deepseek_mtp_name_map,
    deepseek_v3_name_map,
    llama_name_map,
    name_map_for,
)

__all__ = [
    "DeepseekV3Dims",
    "LlamaDims",
    "apply_name_map",
    "deepseek_mtp_name_map",
    "deepseek_v3_name_map",
    "hf_checkpoint_tensors",
    "llama_name_map",
    "name_map_for",
    "register_hf",
    "source_extents",
]
