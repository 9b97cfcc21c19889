"""The MTP draft layout against vLLM 0.33's own draft model code: every draft tensor's name
is what vLLM's `DeepSeekMTP` loader makes of the HF names of its pieces (its spec-layer
rewrite, then its stacked-parameter fusions or its FusedMoE expert-params mapping), and the
vocabulary tensors have the shapes vLLM's own VocabParallelEmbedding / SharedHead allocate
on each TP rank."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from _draft_models import dims, layouts
from _hf_models import DSV3, config
from _lora_models import _tp

from clients.engine_layouts import EngineParallel
from clients.engine_layouts.draft import deepseek_mtp_engine_layout
from refitd.plan.errors import PlanError

# vLLM's DeepSeekMTP.load_weights fuses these checkpoint names into one parameter each
STACKED = (
    ("gate_up_proj", "gate_proj"),
    ("gate_up_proj", "up_proj"),
    ("fused_qkv_a_proj", "q_a_proj"),
    ("fused_qkv_a_proj", "kv_a_proj_with_mqa"),
)


def vllm_name(hf: str, layer: int, experts: int) -> str:
    """The draft parameter vLLM's loader puts the HF checkpoint tensor `hf` in: its
    stacked-parameter fusions, else its FusedMoE expert-params mapping."""
    import torch
    from vllm.model_executor.layers.fused_moe.layer import fused_moe_make_expert_params_mapping
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    name = DeepSeekMTP._rewrite_spec_layer_name(None, layer, hf)  # uses no instance state
    for param, weight in STACKED:
        if weight in name and ".mlp.experts." not in name:
            return name.replace(weight, param)
    mapping = fused_moe_make_expert_params_mapping(
        torch.nn.Module(), "gate_proj", "down_proj", "up_proj", experts
    )
    for param, weight, _, _ in mapping:
        if weight in name:
            return name.replace(weight, param)
    return name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_draft_names_are_what_vllm_loads_them_as(tp: int) -> None:
    d = dims()
    for lay in layouts(tp, draft=True, d=d):
        assert lay.source_naming == "hf"
    checkpoint = deepseek_mtp_engine_layout(d, EngineParallel(tp, 0), source_naming="hf-checkpoint")
    seen = 0
    for t in checkpoint.tensors:
        for p in t.pieces:
            hf = p.canonical
            if hf == "model.embed_tokens.weight":  # the model's embedding, shared
                hf = f"model.layers.{d.layers}.embed_tokens.weight"
            assert t.name == vllm_name(hf, d.layers, d.experts), hf
            seen += 1
    assert seen >= 20 + 3 * d.experts  # and gate, up, down of every routed expert


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocabulary_shapes_are_vllms(tp: int) -> None:
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models.deepseek_mtp import SharedHead

    cfg, d = config(DSV3), dims()
    k = d.layers
    for r, lay in enumerate(layouts(tp, draft=True, d=d)):
        with _tp(tp, r), set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
            head = SharedHead(cfg, prefix=f"model.layers.{k}")
            embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        shapes = {t.name: t.local_shape for t in lay.tensors}
        assert shapes["model.embed_tokens.weight"] == tuple(embed.weight.shape)
        assert shapes[f"model.layers.{k}.shared_head.head.weight"] == tuple(head.head.weight.shape)
        assert shapes[f"model.layers.{k}.shared_head.norm.weight"] == tuple(head.norm.weight.shape)


def test_draft_layout_refuses_what_it_cannot_lay_out() -> None:
    d = dims()
    with pytest.raises(ValueError, match="'megatron'"):
        deepseek_mtp_engine_layout(d, EngineParallel(1, 0), source_naming="megatron")
    with pytest.raises(ValueError, match="sglang"):
        deepseek_mtp_engine_layout(d, EngineParallel(1, 0), engine="sglang")
    with pytest.raises(PlanError, match="no MTP layers"):
        deepseek_mtp_engine_layout(replace(d, mtp_layers=0), EngineParallel())
