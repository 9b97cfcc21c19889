"""Register an engine rank's parameters (vLLM / SGLang names) as destinations of a Megatron
trainer, through an EngineLayout (clients.engine_layouts.layouts).

Each engine tensor becomes one registration per canonical tensor it holds pieces of: the
fused `qkv_proj` registers as `...qkv_proj.weight` (its q rows in HF q_proj),
`...qkv_proj.weight@k_proj` and `...qkv_proj.weight@v_proj`, all on the same memory; a
stacked expert parameter registers one slice per local expert (`...w13_weight[k]`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from clients.engine_layouts.layouts import EngineLayout, EngineTensor
from refitd.client import Placed
from refitd.client.worker import Registration, WorkerClient
from refitd.plan.errors import PlanError
from refitd.plan.layout import PLAIN, Box


def _short(canonical: str) -> str:
    """`model.layers.0.self_attn.k_proj.weight` -> `k_proj`."""
    parts = canonical.split(".")
    return parts[-2] if len(parts) > 1 else canonical


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
) -> dict[str, Placed]:
    """Every engine tensor of the layout as Placed boxes in its canonical tensors.

    storage: registration storage by engine parameter name ("mxfp8", "fp8_block") for
    quantized persistent buffers; plain by default.
    """
    out: dict[str, Placed] = {}
    for t in layout.tensors:
        x = _local(params, t)
        by_canonical: dict[str, list[Box]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for p in t.pieces:
            offset = [0] * x.dim()
            local = [0] * x.dim()
            shape = list(x.shape)
            offset[p.dim], local[p.dim], shape[p.dim] = p.start, p.local, p.length
            by_canonical.setdefault(p.canonical, []).append(
                Box(tuple(offset), tuple(shape), tuple(local))
            )
            shapes[p.canonical] = p.global_shape
        for k, (canonical, boxes) in enumerate(by_canonical.items()):
            key = t.key if k == 0 else f"{t.key}@{_short(canonical)}"
            out[key] = Placed(
                x,
                shapes[canonical],
                boxes,
                canonical=canonical,
                storage=(storage or {}).get(t.name, PLAIN),
            )
    return out


@dataclass(frozen=True, slots=True)
class _Slice:
    """An expert slice of a stacked parameter (to re-point the parameter after its storage
    moved to shared memory)."""

    param: torch.Tensor
    view: torch.Tensor
    offset_delta: int


def register_engine(
    client: WorkerClient, params: Mapping[str, torch.Tensor], layout: EngineLayout
) -> Registration:
    """Register an engine rank's parameters (e.g. `dict(model.named_parameters())`) as
    destinations through `layout`. Stacked expert parameters are re-pointed at the shared
    memory their slices moved to (CPU), so the engine serves what the refit writes."""
    placed = engine_placements(params, layout)
    slices = [
        _Slice(
            params[t.name], p.tensor, params[t.name].storage_offset() - p.tensor.storage_offset()
        )
        for t in layout.tensors
        if t.index is not None and (p := placed[t.key]) is not None
    ]
    reg = client.register(placed)
    with torch.no_grad():
        for s in slices:
            if s.param.untyped_storage().data_ptr() != s.view.untyped_storage().data_ptr():
                s.param.set_(
                    s.view.untyped_storage(),
                    s.view.storage_offset() + s.offset_delta,
                    s.param.size(),
                    s.param.stride(),
                )
    return reg
