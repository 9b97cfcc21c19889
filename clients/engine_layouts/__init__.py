"""Inference-engine layouts (vLLM / SGLang): fused qkv_proj and gate_up_proj per TP rank
(KV heads replicated when TP exceeds them), FusedMoE w13/w2 split by EP, padded vocabulary,
MLA's fused latent projection; registered against a Megatron- or HF-named trainer without
gathering (`source_naming`: "megatron", "hf" for a transformers model under FSDP2 / DDP,
"hf-checkpoint").

    layout = engine_layout_for(
        hf_config, EngineParallel(tp_size=4, tp_rank=rank), "vllm", source_naming="hf"
    )
    client = InferenceClient(controller, "policy", "infer", rank=rank, pool_size=4, ...)
    register_engine(client, dict(model.named_parameters()), layout)
"""

from clients.engine_layouts.layouts import (
    ENGINES,
    SOURCE_NAMINGS,
    VOCAB_PADDING,
    EngineLayout,
    EngineParallel,
    EngineTensor,
    Piece,
    deepseek_v3_engine_layout,
    engine_layout_for,
    fused_qkv_a_name,
    llama_engine_layout,
    padded_vocab,
)
from clients.engine_layouts.register import engine_module, engine_placements, register_engine

__all__ = [
    "ENGINES",
    "SOURCE_NAMINGS",
    "VOCAB_PADDING",
    "EngineLayout",
    "EngineParallel",
    "EngineTensor",
    "Piece",
    "deepseek_v3_engine_layout",
    "engine_layout_for",
    "engine_module",
    "engine_placements",
    "fused_qkv_a_name",
    "llama_engine_layout",
    "padded_vocab",
    "register_engine",
]
