"""vLLM 0.33's own LoRA layers built on CPU for one TP rank of a small Llama / Qwen3: the
stacked adapter buffers they allocate and what their `set_lora` writes into an adapter
slot from the global PEFT A and B (the oracle of the LoRA layout and refit tests).

vLLM's linear layers ask its TP group for their coordinates; a stand-in group object
answering (world_size, rank_in_group) is installed while they are built, nothing else."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from clients.engine_layouts.lora import ENGINE_MODULE, adapter_targets
from clients.hf_names import LlamaDims

SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@contextmanager
def _tp(tp: int, rank: int) -> Iterator[None]:
    import vllm.distributed.parallel_state as ps

    before = ps._TP
    ps._TP = SimpleNamespace(world_size=tp, rank_in_group=rank)
    try:
        yield
    finally:
        ps._TP = before


def vllm_lora_layers(
    d: LlamaDims, tp: int, rank: int, max_loras: int, max_rank: int
) -> dict[str, Any]:
    """`<layer>.<module>` -> vLLM's LoRA layer (qkv_proj, o_proj, gate_up_proj,
    down_proj) of TP rank `rank`, its stacked buffers allocated (bfloat16)."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import (
        MergedColumnParallelLinearWithLoRA,
        MergedQKVParallelLinearWithLoRA,
        RowParallelLinearWithLoRA,
    )
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    cfg = LoRAConfig(max_lora_rank=max_rank, max_loras=max_loras, lora_dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    kw = {"bias": False, "params_dtype": torch.bfloat16}
    with _tp(tp, rank):
        for i in range(d.layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            q = d.heads * d.head_dim
            layers = {
                f"{attn}.qkv_proj": MergedQKVParallelLinearWithLoRA(
                    QKVParallelLinear(d.hidden, d.head_dim, d.heads, d.kv_heads, **kw)
                ),
                f"{attn}.o_proj": RowParallelLinearWithLoRA(RowParallelLinear(q, d.hidden, **kw)),
                f"{mlp}.gate_up_proj": MergedColumnParallelLinearWithLoRA(
                    MergedColumnParallelLinear(d.hidden, [d.ffn, d.ffn], **kw)
                ),
                f"{mlp}.down_proj": RowParallelLinearWithLoRA(
                    RowParallelLinear(d.ffn, d.hidden, **kw)
                ),
            }
            for name, layer in layers.items():
                layer.create_lora_weights(max_loras, cfg)
                out[name] = layer
    return out


def stacked_buffers(layers: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every stacked buffer by its layout name `<layer>.<module>.lora_{a,b}_stacked.<i>`."""
    out = {}
    for name, layer in layers.items():
        for i, (a, b) in enumerate(zip(layer.lora_a_stacked, layer.lora_b_stacked, strict=True)):
            out[f"{name}.lora_a_stacked.{i}"] = a
            out[f"{name}.lora_b_stacked.{i}"] = b
    return out


def set_adapter(layers: Mapping[str, Any], slot: int, adapter: Mapping[str, torch.Tensor]) -> None:
    """vLLM's own `set_lora` of every layer at `slot` from the global PEFT tensors."""
    with _tp(next(iter(layers.values())).tp_size, next(iter(layers.values())).tp_rank):
        for name, layer in layers.items():
            prefix, module = name.rsplit(".", 1)
            parts = SLICES.get(module, (module,))
            a = [adapter[f"{prefix}.{m}.lora_A.weight"] for m in parts]
            b = [adapter[f"{prefix}.{m}.lora_B.weight"] for m in parts]
            if len(parts) == 1:
                layer.set_lora(slot, a[0], b[0])
            else:
                layer.set_lora(slot, a, b)


def random_adapter(d: LlamaDims, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Global PEFT-named A [rank, in] and B [out, rank] of every target, from a seed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in adapter_targets(d, tuple(ENGINE_MODULE)):
        out[t.a_name] = torch.randn(rank, t.in_features, generator=g).to(torch.bfloat16)
        out[t.b_name] = torch.randn(t.out_features, rank, generator=g).to(torch.bfloat16)
    return out


def peft_adapter(cfg: Any, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A transformers Llama wrapped by PEFT with rank-`rank` LoRA on q/k/v/o and
    gate/up/down, its A and B drawn from `seed`: the adapter tensors under their PEFT
    names without the wrapper's `base_model.model.` prefix and `default` adapter name."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    modules = list(ENGINE_MODULE)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank, target_modules=modules))
    g = torch.Generator().manual_seed(seed)
    out = {}
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" not in name:
                continue
            p.copy_(torch.randn(p.shape, generator=g))  # PEFT starts B at zero
            short = name.removeprefix("base_model.model.").replace(".default.", ".")
            out[short] = p.detach().to(torch.bfloat16)
    return out


def lora_trainer_rank(
    rank: int,
    controller: str,
    model: str,
    cfg: Any,
    lora_rank: int,
    commands: Any,
    results: Any,
    versions: range,
    wait: str = "committed",
) -> None:
    """A Megatron tp=2 trainer rank holding only adapter shards; ("refit", v) fills them
    from the PEFT adapter of seed v in place and refits v; the next refit may start
    while the engine ranks still flip to v (wait="committed")."""
    import traceback

    from clients.engine_layouts.lora import megatron_lora_shards
    from refitd.client import MegatronCoords, TrainerClient

    try:
        # Drawn ahead, so a refit follows the last one's commit at once.
        ahead = {
            v: megatron_lora_shards(peft_adapter(cfg, lora_rank, v), 2, rank) for v in versions
        }
        shards = megatron_lora_shards(peft_adapter(cfg, lora_rank, 0), 2, rank)
        with TrainerClient(controller, model, rank=rank, pool_size=2, device=f"cpu:{rank}") as t:
            t.register(shards, MegatronCoords(tp_rank=rank, tp_size=2))
            results.put((rank, "registered", 0))
            while (cmd := commands.get(timeout=300)) is not None:
                _, v = cmd
                for name, x in shards.items():
                    x.copy_(ahead[v][name])
                try:
                    results.put((rank, v, t.refit(v, wait=wait, timeout=120).state))
                except Exception as e:  # a failed refit is an answer of its own
                    results.put((rank, v, f"failed: {e}"))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
