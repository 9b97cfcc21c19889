"""Routed-expert names of the engine layouts against each engine's own expert mapping.

vLLM 0.33 and SGLang 0.5.23 load a checkpoint's per-expert tensor
(`...mlp.experts.{e}.gate_proj.weight`) through their FusedMoE expert-params mapping:
(param prefix, checkpoint prefix, expert, shard) entries; the loader swaps the checkpoint
prefix for the param prefix and hands the expert and shard (w1 gate, w3 up, w2 down) to
the parameter's loader. Every routed-expert piece of a layout must land, so mapped, in the
layout's parameter name, under the shard its position says, and (vLLM) in the expert slice
vLLM's own expert map gives that expert on the rank's EP rank."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable

import pytest

pytest.importorskip("transformers")

from _hf_models import DSV3, MOE_KINDS, config

from clients.engine_layouts import EngineParallel, engine_layout_for
from clients.engine_layouts.layouts import EngineLayout

Mapping = list[tuple[str, str, int, str]]
PARALLEL = ((1, 1), (2, 2), (4, 2), (4, 4))  # (tp, ep)
SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def vllm_mapping(experts: int) -> Mapping:
    pytest.importorskip("vllm")
    import torch
    from vllm.model_executor.layers.fused_moe.layer import fused_moe_make_expert_params_mapping

    return fused_moe_make_expert_params_mapping(
        torch.nn.Module(), "gate_proj", "down_proj", "up_proj", experts
    )


def sglang_mapping(experts: int) -> Mapping:
    pytest.importorskip("sglang")
    from _torchvision_stand_in import torchvision_stand_in

    absent = importlib.util.find_spec("torchvision") is None
    with torchvision_stand_in() if absent else contextlib.nullcontext():
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", experts)


def vllm_local_expert(ep: int, ep_rank: int, experts: int) -> Callable[[int], int]:
    """vLLM's own global -> local expert index on an EP rank (linear placement)."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    _, expert_map, _ = determine_expert_map(ep, ep_rank, experts)
    return (lambda e: e) if expert_map is None else (lambda e: int(expert_map[e]))


def check_experts(lay: EngineLayout, mapping: Mapping, local: Callable[[int], int] | None) -> int:
    """Every routed-expert piece of `lay` (per-expert checkpoint canonicals) as the
    engine's loader maps it; returns how many pieces were checked."""
    seen = 0
    for t in lay.tensors:
        if t.index is None:
            continue
        for pc in t.pieces:
            hits = [
                (pc.canonical.replace(w, p), e, s) for p, w, e, s in mapping if w in pc.canonical
            ]
            assert len(hits) == 1, (pc.canonical, hits)
            name, expert, shard = hits[0]
            assert name == t.name, (pc.canonical, t.name)
            assert shard == SHARD[pc.canonical.split(".")[-2]], pc.canonical
            half = t.local_shape[0] // 2  # w13: the gate rows, then the up rows
            assert pc.local == (half if shard == "w3" else 0), pc.canonical
            if local is not None:
                assert t.index == local(expert), (pc.canonical, t.key)
            seen += 1
    return seen


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_routed_expert_names_are_the_engines_own(engine: str, kind: str) -> None:
    cfg = config(kind)
    experts = cfg.n_routed_experts if kind == DSV3 else cfg.num_experts
    mapping = vllm_mapping(experts) if engine == "vllm" else sglang_mapping(experts)
    moe_layers = cfg.num_hidden_layers - (cfg.first_k_dense_replace if kind == DSV3 else 0)
    for tp, ep in PARALLEL:
        for r in range(tp):
            p = EngineParallel(tp, r, ep)
            lay = engine_layout_for(cfg, p, engine, source_naming="hf-checkpoint")
            local = vllm_local_expert(ep, p.ep_rank, experts) if engine == "vllm" else None
            # per MoE layer and local expert: gate, up (w13) and down (w2)
            assert check_experts(lay, mapping, local) == moe_layers * experts // ep * 3
