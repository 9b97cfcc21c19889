"""LoRA adapters as refit units: vLLM's stacked adapter buffers per TP rank, as boxes of
the trainer's adapter tensors, and the trainer's adapter shards as Megatron holds them.

An adapter on a linear `W` [out, in] is `A` [rank, in] and `B` [out, rank] (PEFT names
them `<module>.lora_A.weight` / `<module>.lora_B.weight`; those are the canonical names
here). Under tensor parallelism:
- trainer (Megatron-Core LoRA): for a column-parallel base (q/k/v, gate/up) B is split on
  its output dim and A is replicated; for a row-parallel base (o, down) A is split on its
  input dim and B is replicated. Fused qkv / gate_up carry one adapter per slice.
- engine (vLLM 0.33's LoRA layers): every adapted layer holds, per slice,
  `lora_a_stacked[i]` [max_loras, 1, max_rank, in_local] and `lora_b_stacked[i]`
  [max_loras, 1, out_local, max_rank], sharded like the base layer: qkv_proj has three
  slices (q, k, v; KV heads replicated when TP exceeds them), gate_up_proj two; A is
  whole on column-parallel layers, B whole on row-parallel ones. Adapter slot `s` of the
  buffers is `buf[s, 0, :rank, :]` (A) and `buf[s, 0, :, :rank]` (B).

A layout's tensors are named `<layer>.<module>.lora_a_stacked.<i>` / `lora_b_stacked.<i>`
(the engine module's name, then vLLM's attribute and slice index); `lora_slot_views`
turns a rank's stacked buffers into the views of one adapter slot, which
`engine_placements` registers. Pure layout code except `lora_slot_views` and
`megatron_lora_shards`, which only view and slice torch tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from clients.engine_layouts.layouts import EngineLayout, EngineParallel, EngineTensor, Piece
from clients.hf_names.maps import LlamaDims
from refitd.plan.errors import PlanError
from refitd.plan.names import NameMap

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
ENGINE_MODULE = {  # target module -> (vLLM module, slice index)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


@dataclass(frozen=True, slots=True)
class AdapterTarget:
    """One adapted linear of one layer: its HF module path and global [out, in]."""

    prefix: str  # e.g. model.layers.0.self_attn
    module: str  # q_proj ... down_proj
    out_features: int
    in_features: int

    @property
    def a_name(self) -> str:
        return f"{self.prefix}.{self.module}.lora_A.weight"

    @property
    def b_name(self) -> str:
        return f"{self.prefix}.{self.module}.lora_B.weight"

    def engine_names(self) -> tuple[str, str]:
        """The vLLM buffers (A, B) holding this adapter's slice."""
        mod, i = ENGINE_MODULE[self.module]
        base = f"{self.prefix}.{mod}"
        return f"{base}.lora_a_stacked.{i}", f"{base}.lora_b_stacked.{i}"


def adapter_targets(d: LlamaDims, modules: Sequence[str] = ATTENTION + MLP) -> list[AdapterTarget]:
    """The adapted linears of a Llama / Qwen2 / Qwen3 model (dense MLPs), layer by layer."""
    unknown = sorted(set(modules) - set(ENGINE_MODULE))
    if unknown:
        raise PlanError(f"LoRA target modules {unknown}: expected some of {list(ENGINE_MODULE)}")
    if d.experts:
        raise PlanError("LoRA layouts cover dense MLPs; this model has routed experts")
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    shapes = {
        "q_proj": (q, d.hidden),
        "k_proj": (kv, d.hidden),
        "v_proj": (kv, d.hidden),
        "o_proj": (d.hidden, q),
        "gate_proj": (d.ffn, d.hidden),
        "up_proj": (d.ffn, d.hidden),
        "down_proj": (d.hidden, d.ffn),
    }
    out = []
    for i in range(d.layers):
        for m in modules:
            part = "self_attn" if m in ATTENTION else "mlp"
            out.append(AdapterTarget(f"model.layers.{i}.{part}", m, *shapes[m]))
    return out


def _rows(t: AdapterTarget, d: LlamaDims, p: EngineParallel) -> tuple[int, int]:
    """(start, length) of the output rows this engine rank holds of a column-parallel base;
    KV heads are replicated on tp / kv_heads ranks when TP exceeds them."""
    tp = p.tp_size
    if t.module in ("k_proj", "v_proj"):
        kv = d.kv_heads
        if (tp >= kv and tp % kv) or (tp < kv and kv % tp):
            raise PlanError(f"{t.prefix}: {kv} KV heads and TP {tp}: neither divides the other")
        rows = max(1, kv // tp) * d.head_dim
        return (p.tp_rank // max(1, tp // kv)) * rows, rows
    if t.out_features % tp:
        raise PlanError(f"{t.b_name}: {t.out_features} rows do not split over TP {tp}")
    n = t.out_features // tp
    return p.tp_rank * n, n


def lora_engine_layout(
    d: LlamaDims,
    p: EngineParallel,
    rank: int,
    modules: Sequence[str] = ATTENTION + MLP,
) -> EngineLayout:
    """vLLM's stacked LoRA buffers of one TP rank (one adapter slot's views, each
    [rank, in_local] or [out_local, rank]) as boxes of the trainer's PEFT-named A and B."""
    if p.ep_size != 1:
        raise PlanError("LoRA layouts take no expert parallelism")
    tensors: list[EngineTensor] = []
    for t in adapter_targets(d, modules):
        a_name, b_name = t.engine_names()
        a_shape, b_shape = (rank, t.in_features), (t.out_features, rank)
        if t.module in ROW_PARALLEL:
            if t.in_features % p.tp_size:
                raise PlanError(f"{t.a_name}: {t.in_features} columns do not split over TP")
            n = t.in_features // p.tp_size
            a = EngineTensor(a_name, (rank, n), (Piece(t.a_name, a_shape, 1, p.tp_rank * n, n, 0),))
            b = EngineTensor(b_name, b_shape, (Piece(t.b_name, b_shape, 0, 0, t.out_features, 0),))
        else:
            start, n = _rows(t, d, p)
            a = EngineTensor(a_name, a_shape, (Piece(t.a_name, a_shape, 0, 0, rank, 0),))
            b = EngineTensor(b_name, (n, rank), (Piece(t.b_name, b_shape, 0, start, n, 0),))
        tensors += [a, b]
    return EngineLayout(tuple(tensors), NameMap(()), "hf")


def lora_buffer_shapes(layout: EngineLayout, max_loras: int, max_rank: int) -> dict[str, tuple]:
    """The stacked buffer each layout tensor lives in: [max_loras, 1, rows, cols] with the
    rank dim padded to max_rank (what vLLM's `create_lora_weights` allocates)."""
    out = {}
    for t in layout.tensors:
        rows, cols = t.local_shape
        if ".lora_a_stacked." in t.name:
            rows = max_rank
        else:
            cols = max_rank
        if t.local_shape[0] > rows or t.local_shape[1] > cols:
            raise PlanError(f"{t.name}: adapter rank exceeds the buffers' max rank {max_rank}")
        out[t.name] = (max_loras, 1, rows, cols)
    return out


def lora_slot_views(
    buffers: Mapping[str, torch.Tensor], layout: EngineLayout, slot: int
) -> dict[str, torch.Tensor]:
    """Adapter slot `slot` of a rank's stacked buffers: per layout tensor the view
    `buf[slot, 0, :rank, :]` (A) or `buf[slot, 0, :, :rank]` (B)."""
    out = {}
    for t in layout.tensors:
        if t.name not in buffers:
            raise PlanError(f"LoRA buffer {t.name!r} is missing from the engine's buffers")
        buf = buffers[t.name]
        if buf.dim() != 4 or not 0 <= slot < buf.shape[0]:
            raise PlanError(f"LoRA buffer {t.name!r} {tuple(buf.shape)} has no adapter slot {slot}")
        rows, cols = t.local_shape
        view = buf[slot, 0, :rows, :cols]
        if tuple(view.shape) != t.local_shape:
            raise PlanError(
                f"LoRA buffer {t.name!r} {tuple(buf.shape)} cannot hold {t.local_shape}"
            )
        out[t.name] = view
    return out


def megatron_lora_shards(
    adapters: Mapping[str, torch.Tensor], tp_size: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    """A Megatron trainer rank's adapter tensors from the global PEFT-named A and B:
    column-parallel bases split B on dim 0 (A replicated), row-parallel bases split A on
    dim 1 (B replicated); each shard carries Megatron's TP attributes."""
    out = {}
    for name, full in adapters.items():
        module, kind = name.split(".")[-3], name.split(".")[-2]
        if module not in ENGINE_MODULE or kind not in ("lora_A", "lora_B"):
            raise PlanError(f"{name}: not a PEFT adapter tensor of {list(ENGINE_MODULE)}")
        split = (kind == "lora_B" and module in COLUMN_PARALLEL) or (
            kind == "lora_A" and module in ROW_PARALLEL
        )
        dim = 0 if kind == "lora_B" else 1
        if split:
            if full.shape[dim] % tp_size:
                raise PlanError(f"{name}: dim {dim} of {tuple(full.shape)} splits unevenly")
            shard = full.chunk(tp_size, dim)[tp_rank].contiguous()
        else:
            shard = full.clone()
        shard.tensor_model_parallel = split
        shard.partition_dim = dim if split else -1
        shard.partition_stride = 1
        out[name] = shard
    return out
