"""LoRA layouts against vLLM 0.33's own LoRA layers (built on CPU per TP rank): for Llama
and Qwen3 at TP 1, 2 and 4 (4 is above their 2 KV heads) every layout tensor lives in a
stacked buffer of the shape vLLM allocates, and the layout's boxes, read from the global
PEFT A and B, give exactly what vLLM's `set_lora` writes into an adapter slot. The
Megatron trainer shards cover the global tensors once per TP group."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from _hf_models import LLAMA, QWEN3, config
from _lora_models import random_adapter, set_adapter, stacked_buffers, vllm_lora_layers

from clients.engine_layouts import EngineParallel
from clients.engine_layouts.lora import (
    lora_buffer_shapes,
    lora_engine_layout,
    lora_slot_views,
    megatron_lora_shards,
)
from clients.hf_names import LlamaDims
from refitd.plan.errors import PlanError

RANK, MAX_RANK, MAX_LORAS = 8, 16, 3


def _from_boxes(layout, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layout tensor filled from the global tensors its pieces name."""
    out = {}
    for t in layout.tensors:
        x = torch.zeros(t.local_shape, dtype=torch.bfloat16)
        for p in t.pieces:
            src = adapter[p.canonical].narrow(p.dim, p.start, p.length)
            x.narrow(p.dim, p.local, p.length).copy_(src)
        out[t.name] = x
    return out


@pytest.mark.parametrize("kind", [LLAMA, QWEN3])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_matches_vllm_buffers(kind: str, tp: int) -> None:
    d = LlamaDims.from_hf_config(config(kind))
    adapter = random_adapter(d, RANK, seed=tp)
    for r in range(tp):
        layers = vllm_lora_layers(d, tp, r, MAX_LORAS, MAX_RANK)
        set_adapter(layers, 1, adapter)
        buffers = stacked_buffers(layers)
        layout = lora_engine_layout(d, EngineParallel(tp, r), RANK)
        shapes = lora_buffer_shapes(layout, MAX_LORAS, MAX_RANK)
        assert shapes == {n: tuple(b.shape) for n, b in buffers.items()}
        views = lora_slot_views(buffers, layout, 1)
        want = _from_boxes(layout, adapter)
        for name, view in views.items():
            assert torch.equal(view, want[name]), (kind, tp, r, name)
        # vLLM's set_lora leaves the rest of the slot (rank padding) and other slots zero.
        for name, buf in buffers.items():
            assert int(buf[0].count_nonzero()) == 0 and int(buf[2].count_nonzero()) == 0
            assert buf[1].count_nonzero() == views[name].count_nonzero(), name


def test_megatron_shards_cover_globals() -> None:
    d = LlamaDims.from_hf_config(config(LLAMA))
    adapter = random_adapter(d, RANK, seed=7)
    shards = [megatron_lora_shards(adapter, 2, r) for r in range(2)]
    for name, full in adapter.items():
        a, b = shards[0][name], shards[1][name]
        if a.tensor_model_parallel:
            assert torch.equal(torch.cat([a, b], a.partition_dim), full), name
        else:
            assert torch.equal(a, full) and torch.equal(b, full), name
    q = "model.layers.0.self_attn.q_proj"
    assert shards[0][f"{q}.lora_B.weight"].partition_dim == 0
    assert not shards[0][f"{q}.lora_A.weight"].tensor_model_parallel
    assert shards[0]["model.layers.0.mlp.down_proj.lora_A.weight"].partition_dim == 1


def test_bad_slot_and_rank_are_named() -> None:
    d = LlamaDims.from_hf_config(config(LLAMA))
    layout = lora_engine_layout(d, EngineParallel(1, 0), RANK)
    with pytest.raises(PlanError, match="max rank 4"):
        lora_buffer_shapes(layout, MAX_LORAS, 4)
    buffers = {
        n: torch.zeros(s, dtype=torch.bfloat16)
        for n, s in lora_buffer_shapes(layout, MAX_LORAS, MAX_RANK).items()
    }
    with pytest.raises(PlanError, match="no adapter slot 3"):
        lora_slot_views(buffers, layout, 3)
