"""Read a module's DTensor parameters (FSDP2's fully_shard, TP plans, distribute_tensor)
and turn them into registrations.

Each DTensor's device mesh (shape, this process's coordinate) and placements become boxes
through refitd.plan.layouts.dtensor_layout, which follows torch.chunk for uneven shards and
applies mesh dims left to right (two mesh dims may shard the same tensor dim). The local
tensor registered is the DTensor's own local shard, so registration moves the storage the
optimizer writes to, and later steps are what the next refit reads. The storage moves in
place, so FSDP2's padded all-gather buffer, of which the local shard is a view, moves with
it and the trainer's forward keeps reading the registered memory. Wrapper prefixes that
FSDP, activation checkpointing and torch.compile insert are dropped from canonical names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refitd.client import Placed
from refitd.client.tensors import dtensor_placement, reshard_fsdp
from refitd.client.worker import Registration, WorkerClient

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_dtensor_name(name: str, wrappers: Sequence[str] = WRAPPER_PREFIXES) -> str:
    """The module name without wrapper components (`_orig_mod.layers.0.w` -> `layers.0.w`)."""
    for w in wrappers:
        name = name.replace(w, "")
    return name


def dtensor_tensors(module: torch.nn.Module) -> dict[str, Placed]:
    """Parameters and persistent buffers as Placed tensors; plain tensors are replicas.

    FSDP2 modules are resharded first (`reshard_fsdp`), so a module can be read at any
    point of its life (right after fully_shard, after an eval or a training forward): its
    parameters are then FSDP2's sharded DTensors, whose local shards the optimizer steps.

    A shard that is empty on this rank (torch.chunk gives trailing ranks nothing when a
    dim is smaller than the mesh) is registered with no boxes: the rank sends and receives
    nothing for it, and every rank of the pool registers the same names.
    """
    from torch.distributed.tensor import DTensor

    reshard_fsdp(module)
    skip = {
        f"{prefix}.{n}" if prefix else n
        for prefix, mod in module.named_modules()
        for n in getattr(mod, "_non_persistent_buffers_set", ())
    }
    named = [*module.named_parameters(), *module.named_buffers()]
    out: dict[str, Placed] = {}
    for name, t in named:
        if name in skip:
            continue
        canonical = canonical_dtensor_name(name)
        if isinstance(t, DTensor):
            out[name] = _from_dtensor(name, canonical, t)
        else:
            out[name] = Placed(t, canonical=canonical)
    if not out:
        raise ValueError("the module has no parameters or persistent buffers")
    return out


def register_dtensor_module(client: WorkerClient, module: torch.nn.Module) -> Registration:
    """Register a module with DTensor parameters with a TrainerClient (or InferenceClient)."""
    return client.register(dtensor_tensors(module))


def _from_dtensor(name: str, canonical: str, dt: torch.Tensor) -> Placed:
    coord = dt.device_mesh.get_coordinate()
    where = f"tensor {name!r} (mesh {tuple(dt.device_mesh.shape)}, coordinate {coord})"
    local, layout = dtensor_placement(dt, where)
    return Placed(local, tuple(dt.shape), layout.boxes, canonical=canonical)
