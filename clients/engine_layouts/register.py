"""Register an engine rank's parameters (vLLM / SGLang names) as destinations of a trainer
(Megatron- or HF-named), through an EngineLayout (clients.engine_layouts.layouts).

Each engine tensor becomes one registration per piece: the fused `qkv_proj` registers as
`...qkv_proj.weight` (its q heads), `...qkv_proj.weight@k_proj` and `@v_proj`, all on the
same memory, each as boxes of the trainer tensor the name map reads (a Megatron trainer:
fused QKV rows of every KV group; an HF one: q_proj, k_proj, v_proj). One registration per
piece keeps replicated KV heads a whole replica of their own (ranks sharing a KV head hold
identical boxes). A stacked expert parameter registers one slice per local expert
(`...w13_weight[k]`); a piece of a stacked canonical (transformers' fused experts) views
that slice with a leading dim of 1, its box at the expert's index. A piece that lies
entirely in declared padding (a vocabulary shard past the real vocabulary) registers
nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from clients.engine_layouts.layouts import EngineLayout, EngineTensor
from clients.hf_names import source_extents
from refitd.client import Placed
from refitd.client.worker import Registration, WorkerClient
from refitd.plan.errors import PlanError
from refitd.plan.layout import Box
from refitd.plan.names import source_boxes
from refitd.plan.wire import PLAIN


def _short(canonical: str) -> str:
    """`model.layers.0.self_attn.k_proj.weight` -> `k_proj`,
    `model.layers.1.mlp.experts.gate_up_proj` -> `gate_up_proj`."""
    parts = canonical.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] in ("weight", "bias") else parts[-1]


def _local(params: Mapping[str, torch.Tensor], t: EngineTensor) -> torch.Tensor:
    if t.name not in params:
        raise PlanError(f"engine tensor {t.name!r} is missing from the model's parameters")
    x = params[t.name]
    if t.index is not None:
        if x.dim() < 1 or not 0 <= t.index < x.shape[0]:
            raise PlanError(
                f"engine tensor {t.name!r} of shape {tuple(x.shape)} has no expert slice {t.index}"
            )
        x = x[t.index]
    if tuple(x.shape) != t.local_shape:
        raise PlanError(
            f"engine tensor {t.key!r} has shape {tuple(x.shape)}, its layout says {t.local_shape}"
        )
    return x


def engine_placements(
    params: Mapping[str, torch.Tensor],
    layout: EngineLayout,
    storage: Mapping[str, str] | None = None,
    through_map: bool = True,
    scales: Mapping[str, torch.Tensor] | None = None,
    dtype: str = "bfloat16",
) -> dict[str, Placed]:
    """Every engine tensor of the layout as Placed boxes, one registration per piece.

    through_map: boxes in the trainer's canonicals, through the layout's name map
    (`refitd.plan.names.source_boxes`; declared padding rows map to nothing), which any
    controller plans as is; False: boxes in the layout's piece canonicals (for a planner
    given the name map itself). storage: registration storage by engine parameter name
    ("mxfp8", "fp8_block") for quantized persistent buffers (plain by default); such a
    parameter is its uint8 data, `scales[name]` its scale buffer, `dtype` what they stand
    for.
    """
    rules = layout.name_map.index() if through_map else {}
    extents = source_extents(layout.name_map) if through_map else {}
    out: dict[str, Placed] = {}
    for t in layout.tensors:
        x = _local(params, t)
        kind = (storage or {}).get(t.name, PLAIN)
        sc = None
        if kind != PLAIN:
            if scales is None or t.name not in scales:
                raise PlanError(f"engine tensor {t.name!r}: {kind} storage without scales")
            sc = scales[t.name] if t.index is None else scales[t.name][t.index]
        for k, p in enumerate(t.pieces):
            stacked = p.index is not None  # a slice of a stacked canonical: a leading dim
            held = x.unsqueeze(0) if stacked else x
            offset = [0] * held.dim()
            local = [0] * held.dim()
            shape = list(held.shape)
            if p.index is not None:
                offset[0] = p.index
            d = p.dim + stacked
            offset[d], local[d], shape[d] = p.start, p.local, p.length
            box = Box(tuple(offset), tuple(shape), tuple(local))
            key = t.key if k == 0 else f"{t.key}@{_short(p.canonical)}"
            for j, (source, b) in enumerate(source_boxes(rules, p.canonical, box)):
                gshape = list(p.global_shape)
                if source in extents:
                    dim, length = extents[source]
                    gshape[dim] = length
                out[key if j == 0 else f"{key}#{j}"] = Placed(
                    held,
                    tuple(gshape),
                    [b],
                    canonical=source,
                    storage=kind,
                    scales=sc.unsqueeze(0) if stacked and sc is not None else sc,
                    dtype=dtype if kind != PLAIN else None,
                )
    return out


def register_engine(
    client: WorkerClient,
    params: Mapping[str, torch.Tensor],
    layout: EngineLayout,
    storage: Mapping[str, str] | None = None,
    scales: Mapping[str, torch.Tensor] | None = None,
) -> Registration:
    """Register an engine rank's parameters (e.g. `dict(model.named_parameters())`) as
    destinations through `layout` (quantized ones: see engine_placements). A stacked expert
    parameter registers as slices of itself; registration moves its storage in place, so
    the parameter serves what the refit writes into the slices."""
    return client.register(engine_placements(params, layout, storage, scales=scales))


def engine_module(tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are `tensors` under their dotted names: what a vLLM or
    SGLang model runner holds for one TP rank (for engines run outside their runner)."""
    module = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = module
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, torch.nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return module
