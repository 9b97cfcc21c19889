"""Megatron-shaped modules built from global tensors, for tests and examples.

megatron-core is not a dependency, so `build_rank_module` builds what a Megatron rank
holds: modules named like Megatron-Core's GPT (`embedding.word_embeddings`,
`decoder.layers.{i}.self_attention.linear_qkv`, ..., `output_layer`), layer modules with a
global 1-based `layer_number`, and parameters sliced from the global tensors with plain
torch indexing and annotated the way Megatron annotates them (`tensor_model_parallel`,
`partition_dim`, `partition_stride`, `allreduce = False` on experts). The slicing here is
independent of refitd's box arithmetic, so a refit checked against the global tensors
tests the adapter and the planner, not a copy of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from clients.megatron_adapter.adapter import ParallelState

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.*\.experts\.linear_fc[12]\.weight)(\d+)$")


@dataclass(frozen=True, slots=True)
class MegatronSplit:
    """How Megatron splits a tensor: dim (None: replicated), stride, expert (ETP) or TP."""

    dim: int | None
    stride: int = 1
    expert: bool = False


def megatron_split(name: str) -> MegatronSplit:
    """Megatron-Core's split of a GPT / MLA / MoE tensor by its name."""
    if _EXPERT.match(name):
        return MegatronSplit(0, 2, True) if ".linear_fc1." in name else MegatronSplit(1, 1, True)
    if name.endswith(("layer_norm_weight", "layernorm.weight", "layer_norm_bias")):
        return MegatronSplit(None)
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return MegatronSplit(0)
    if ".linear_qkv." in name or ".linear_q_up_proj." in name or ".linear_kv_up_proj." in name:
        return MegatronSplit(0)
    if name.endswith("linear_fc1.weight"):
        return MegatronSplit(0, 2)  # gated: [gate; up], each rank holds its piece of both
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return MegatronSplit(1)
    return MegatronSplit(None)  # norms, down projections of MLA, router weight and expert_bias


def stage_layers(layers: int, pp_size: int, pp_rank: int) -> range:
    """Layers of a PP stage: an even split, the first stages taking one more."""
    base, extra = divmod(layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def shard_of(t: torch.Tensor, dim: int, rank: int, size: int, stride: int) -> torch.Tensor:
    """Rank's shard: the dim cut into size*stride chunks, chunks rank, rank+size, ..."""
    chunks = torch.chunk(t, size * stride, dim=dim)
    return torch.cat([chunks[rank + j * size] for j in range(stride)], dim=dim).clone()


class _Node(torch.nn.Module):
    """A bare container; Megatron's real modules would also hold the forward."""


def build_rank_module(
    global_tensors: Mapping[str, torch.Tensor],
    layers: int,
    state: ParallelState,
    num_experts: int = 0,
    buffers: tuple[str, ...] = ("expert_bias",),
) -> torch.nn.Module:
    """The module one Megatron rank holds for `global_tensors` (canonical Megatron names:
    global layer indices, per-expert `weight{E}` with global E).

    PP stage `state.pp_rank` holds its layers (local names `decoder.layers.{i}`), the first
    stage the embedding and the last the final norm and output layer; EP rank r holds
    experts r*E/ep ... as local `weight{K}`. Names ending in one of `buffers` become
    persistent buffers.
    """
    mine = stage_layers(layers, state.pp_size, state.pp_rank)
    root = _Node()
    for name, full in global_tensors.items():
        local = _local_name(name, mine, state, num_experts)
        if local is None:
            continue
        spec = megatron_split(name)
        rank, size = (
            (state.etp_rank, state.etp_size) if spec.expert else (state.tp_rank, state.tp_size)
        )
        if spec.dim is None or size == 1:
            data = full.clone()
        else:
            data = shard_of(full, spec.dim, rank, size, spec.stride)
        parent, leaf = _parent(root, local)
        if leaf.endswith(buffers):
            parent.register_buffer(leaf, data, persistent=True)
            continue
        p = torch.nn.Parameter(data, requires_grad=False)
        if spec.dim is not None:
            p.tensor_model_parallel = True
            p.partition_dim = spec.dim
            p.partition_stride = spec.stride
        if spec.expert:
            p.allreduce = False
        parent.register_parameter(leaf, p)
    for i, layer in enumerate(mine):
        _parent(root, f"decoder.layers.{i}.x")[0].layer_number = layer + 1
    return root


def _local_name(name: str, mine: range, state: ParallelState, num_experts: int) -> str | None:
    """The rank's local name of a global tensor, or None if the rank does not hold it."""
    m = _LAYER.match(name)
    if m is None:
        first, last = state.pp_rank == 0, state.pp_rank == state.pp_size - 1
        if name.startswith("embedding."):
            return name if first else None
        return name if last else None
    layer, rest = int(m[1]), m[2]
    if layer not in mine:
        return None
    e = _EXPERT.match(rest)
    if e:
        per_rank = num_experts // state.ep_size
        k = int(e[2]) - state.ep_rank * per_rank
        if not 0 <= k < per_rank:
            return None
        rest = f"{e[1]}{k}"
    return f"decoder.layers.{layer - mine.start}.{rest}"


def _parent(root: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = _Node()
            mod.add_module(part, child)
        mod = child
    return mod, leaf
