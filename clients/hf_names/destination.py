"""Register a Hugging Face model (inference side) against a Megatron trainer's tensors.

`hf_checkpoint_tensors` names an HF module's tensors the way checkpoints do (transformers 5
fuses routed experts into 3-D `experts.gate_up_proj` / `experts.down_proj`; those become
per-expert views `experts.{e}.gate_proj.weight`...). `apply_name_map` then rewrites each
destination tensor as boxes in the source (Megatron) canonical tensors it is made of: q_proj
is the q rows of every KV group of the fused QKV, gate_proj the first half of fc1. The
planner intersects those boxes with the trainer's shards like any other placement, so the
map works through any controller today and nothing is gathered whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from refitd.client import Placed
from refitd.client.worker import Registration, WorkerClient
from refitd.plan.errors import PlanError
from refitd.plan.layout import Box
from refitd.plan.names import NameMap

_FUSED_GATE_UP = ".mlp.experts.gate_up_proj"
_FUSED_DOWN = ".mlp.experts.down_proj"


def hf_checkpoint_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under HF checkpoint names (fused experts as
    per-expert views that share the parameter's memory)."""
    skip = {
        f"{prefix}.{n}" if prefix else n
        for prefix, mod in module.named_modules()
        for n in getattr(mod, "_non_persistent_buffers_set", ())
    }
    out: dict[str, torch.Tensor] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if name in skip:
            continue
        if name.endswith(_FUSED_GATE_UP) and t.dim() == 3:
            base, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t.data[e, :half]
                out[f"{base}{e}.up_proj.weight"] = t.data[e, half:]
        elif name.endswith(_FUSED_DOWN) and t.dim() == 3:
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t.data[e]
        else:
            out[name] = t
    return out


def source_extents(name_map: NameMap) -> dict[str, tuple[int, int]]:
    """(dim, length along dim) of every source tensor the map reads, from the parts that
    read it (the maps here cover each source whole)."""
    out: dict[str, tuple[int, int]] = {}
    for rule in name_map.rules:
        for p in rule.parts:
            dim, end = out.get(p.source, (rule.dim, 0))
            if dim != rule.dim:
                raise PlanError(f"source {p.source!r} is split along dims {dim} and {rule.dim}")
            out[p.source] = (dim, max(end, p.start + p.length))
    return out


def apply_name_map(tensors: Mapping[str, torch.Tensor], name_map: NameMap) -> dict[str, Placed]:
    """Each destination tensor as Placed boxes in its source canonical tensor(s).

    Tensors without a rule keep their own name as canonical. A destination made of parts
    of several sources becomes one registration per source (`name`, `name@source`).
    """
    rules = name_map.index()
    extents = source_extents(name_map)
    out: dict[str, Placed] = {}
    for name, t in tensors.items():
        rule = rules.get(name)
        if rule is None:
            out[name] = Placed(t, canonical=name)
            continue
        covered = rule.covered
        if not 0 <= rule.dim < t.dim() or covered != t.shape[rule.dim]:
            raise PlanError(
                f"tensor {name!r} of shape {tuple(t.shape)}: the name map's parts cover "
                f"{covered} along dim {rule.dim}"
            )
        by_source: dict[str, list[Box]] = {}
        at = 0
        for p in rule.parts:
            offset = [0] * t.dim()
            local = [0] * t.dim()
            shape = list(t.shape)
            offset[rule.dim], local[rule.dim], shape[rule.dim] = p.start, at, p.length
            by_source.setdefault(p.source, []).append(
                Box(tuple(offset), tuple(shape), tuple(local))
            )
            at += p.length
        for k, (source, boxes) in enumerate(by_source.items()):
            gshape = list(t.shape)
            gshape[rule.dim] = extents[source][1]
            key = name if k == 0 else f"{name}@{source}"
            out[key] = Placed(t, tuple(gshape), boxes, canonical=source)
    return out


def register_hf(client: WorkerClient, module: torch.nn.Module, name_map: NameMap) -> Registration:
    """Register an HF model's tensors as destinations of a Megatron source through
    `name_map`. Fused expert parameters register as per-expert views of themselves;
    registration moves their storage in place, so the module serves what the refit writes."""
    return client.register(apply_name_map(hf_checkpoint_tensors(module), name_map))
