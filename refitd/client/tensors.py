"""Turn what a worker holds (a torch module, named tensors with Megatron attributes,
DTensors, or tensors with explicit boxes) into the local tensors and placements it registers.

Thin glue over the planner's layout constructors (refitd.plan.layouts): this module only
reads torch objects and attributes; the boxes and their checks come from the planner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from refitd.plan.errors import PlanError
from refitd.plan.layout import Box
from refitd.plan.layouts import (
    Layout,
    Replicate,
    Shard,
    check_layout,
    dtensor_layout,
    explicit_layout,
    megatron_layout,
)
from refitd.plan.names import canonical_name as plan_canonical_name
from refitd.plan.wire import (
    FP8_BLOCK,
    MXFP8,
    NVFP4,
    PLAIN,
    fp8_block_scale_shape,
    mxfp8_scale_shape,
    nvfp4_scale_shape,
    storage_data_shape,
)
from refitd.torch_dtypes import dtype_name


@dataclass(frozen=True)
class Placed:
    """A local tensor with an explicit placement: its global shape and boxes.

    boxes are Box objects or (global offset, shape, local offset) triples; the default is
    the whole tensor (a replica). A quantized persistent buffer (storage "mxfp8",
    "fp8_block" or "nvfp4") is `tensor` = its uint8 data, `scales` = its scale buffer, and
    `dtype` = the element dtype it stands for (the source's, e.g. "bfloat16"). NVFP4 data
    packs two values per byte of its last dim (uint8 (..., n / 2) for n elements), its
    scales are E4M3 bytes (..., ceil(n / 16)), and `global_scale` is its float32 global
    scale (one element); global_shape and boxes count elements.
    """

    tensor: torch.Tensor
    global_shape: Sequence[int] | None = None
    boxes: Sequence[Box | tuple[Sequence[int], ...]] | None = None
    canonical: str | None = None
    storage: str = PLAIN
    meta: Mapping[str, str] = field(default_factory=dict)
    scales: torch.Tensor | None = None
    dtype: str | None = None
    global_scale: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class MegatronCoords:
    """Where a Megatron rank sits: TP/EP/expert-TP coordinates and its PP offsets.

    layer_offset turns local layer indices (`decoder.layers.{i}.`) into global ones;
    expert_offset does the same for per-expert tensors (`...weight{K}`, `...bias{K}`).
    Expert parameters are those with `allreduce = False` (Megatron's marker); they are split
    over expert-TP (etp_*) instead of TP.
    """

    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    layer_offset: int = 0
    expert_offset: int = 0


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """One tensor to register: the object itself and everything the controller needs."""

    name: str
    canonical: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    layout: Layout
    storage: str = PLAIN
    meta: tuple[tuple[str, str], ...] = ()
    scales: torch.Tensor | None = None  # quantized storage: the scale buffer
    logical_dtype: str = ""  # quantized storage: the element dtype the data stands for
    global_scale: torch.Tensor | None = None  # nvfp4 storage: the float32 global scale

    @property
    def dtype(self) -> str:
        return self.logical_dtype or dtype_name(self.tensor.dtype)


def canonical_name(name: str, coords: MegatronCoords) -> str:
    """Global layer index under PP and global expert index under EP."""
    return plan_canonical_name(name, coords.layer_offset, coords.expert_offset)


def collect(
    tensors: torch.nn.Module | Mapping[str, Any],
    coords: MegatronCoords | None = None,
    label: str = "",
) -> list[LocalTensor]:
    """The local tensors to register, in a stable order.

    A module contributes its parameters and persistent buffers (FSDP2 modules resharded
    first, see `reshard_fsdp`). A mapping's values may be
    torch tensors (Megatron attributes read when present, otherwise whole replicas),
    DTensors, or Placed (explicit boxes).
    """
    coords = coords or MegatronCoords()
    if isinstance(tensors, torch.nn.Module):
        reshard_fsdp(tensors)
        items: dict[str, Any] = dict(tensors.named_parameters())
        non_persistent = {
            f"{prefix}.{n}" if prefix else n
            for prefix, mod in tensors.named_modules()
            for n in getattr(mod, "_non_persistent_buffers_set", ())
        }
        items.update({n: b for n, b in tensors.named_buffers() if n not in non_persistent})
    elif isinstance(tensors, Mapping):
        items = dict(tensors)
    else:
        raise TypeError(
            f"register() takes a torch.nn.Module or a mapping name -> tensor, got {type(tensors)}"
        )
    if not items:
        raise ValueError(f"nothing to register{f' ({label})' if label else ''}")
    return [_one(name, value, coords, label) for name, value in items.items()]


def reshard_fsdp(module: torch.nn.Module) -> None:
    """Put every FSDP2 module inside `module` back in its sharded state, as FSDP2's own
    state_dict() does before it reads parameters.

    After a forward FSDP2 may hold a module's parameters unsharded (the root's stay so after
    an eval forward): plain full tensors living in its all-gather buffers, which it frees
    and refills, while the optimizer steps the sharded DTensors. Registering those would
    ship buffers the next step never writes. Resharded, the module's parameters are the
    sharded DTensors again, the tensors the optimizer and the next all-gather use; the next
    forward all-gathers them as usual.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch build without distributed
        return
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _one(name: str, value: Any, coords: MegatronCoords, label: str) -> LocalTensor:
    where = f"tensor {name!r}{f', {label}' if label else ''}"
    if isinstance(value, Placed):
        t = value.tensor
        shape = tuple(t.shape)
        if value.storage == NVFP4 and shape:
            shape = (*shape[:-1], 2 * shape[-1])  # two values per byte
        gshape = tuple(value.global_shape) if value.global_shape is not None else shape
        boxes = value.boxes
        if boxes is None:
            boxes = [Box((0,) * t.dim(), shape, (0,) * t.dim())]
        layout = explicit_layout(shape, boxes)
        canonical = value.canonical or canonical_name(name, coords)
        out = _checked(name, canonical, t, gshape, layout, where, value.storage, value.meta)
        return _quantized(out, value, where) if value.storage != PLAIN else out
    if _is_dtensor(value):
        return _from_dtensor(name, value, coords, where)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, DTensor or Placed, got {type(value)}")
    gshape, layout = megatron_placement(value, coords, where)
    return _checked(name, canonical_name(name, coords), value, gshape, layout, where)


def megatron_placement(
    t: torch.Tensor, coords: MegatronCoords, where: str
) -> tuple[tuple[int, ...], Layout]:
    """Global shape and layout of a local tensor from the attributes Megatron sets on it.

    `tensor_model_parallel`, `partition_dim`, `partition_stride` and the local
    `partition_sizes`; `allreduce = False` marks an expert parameter, split over expert-TP.
    A tensor without them (or with a parallel size of 1) is a whole replica.
    """
    expert = getattr(t, "allreduce", True) is False
    rank, size = (coords.etp_rank, coords.etp_size) if expert else (coords.tp_rank, coords.tp_size)
    gshape = list(t.shape)
    dim: int | None = None
    stride = 1
    sizes: list[int] | None = None
    if bool(getattr(t, "tensor_model_parallel", False)) and size > 1:
        dim = int(getattr(t, "partition_dim", -1))
        if not 0 <= dim < t.dim():
            raise PlanError(
                f"{where}: partition_dim {dim} out of range for local shape {tuple(t.shape)}"
            )
        stride = int(getattr(t, "partition_stride", 1))
        local_sizes = getattr(t, "partition_sizes", None)
        if local_sizes is not None:
            if sum(local_sizes) != t.shape[dim]:
                raise PlanError(
                    f"{where}: partition_sizes {list(local_sizes)} sum to {sum(local_sizes)}, "
                    f"the local dim {dim} has {t.shape[dim]}"
                )
            sizes = [int(x) * size for x in local_sizes]
        gshape[dim] *= size
    layout = megatron_layout(
        gshape,
        tp_rank=rank,
        tp_size=size,
        partition_dim=dim,
        partition_stride=stride,
        partition_sizes=sizes,
        label=where,
    )
    return tuple(gshape), layout


def _is_dtensor(value: Any) -> bool:
    return hasattr(value, "device_mesh") and hasattr(value, "placements")


def _from_dtensor(name: str, dt: Any, coords: MegatronCoords, where: str) -> LocalTensor:
    local, layout = dtensor_placement(dt, where)
    return _checked(name, canonical_name(name, coords), local, tuple(dt.shape), layout, where)


def dtensor_placement(dt: Any, where: str) -> tuple[torch.Tensor, Layout]:
    """The local shard of a DTensor and its layout (mesh coordinate and placements).

    The local tensor is the DTensor's own: optimizer steps write to it in place, so its
    storage is the one registration moves (to_local() can hand back an alias of it).
    """
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise PlanError(f"{where}: this process is not part of the DTensor's device mesh")
    placements: list[Shard | Replicate] = []
    for p in dt.placements:
        # _StridedShard (FSDP2 over a TP-sharded dim) subclasses Shard but interleaves.
        if type(p) is TorchShard:
            placements.append(Shard(p.dim))
        elif isinstance(p, TorchReplicate):
            placements.append(Replicate())
        else:
            raise PlanError(
                f"{where}: placement {p} is not supported (Shard and Replicate are); "
                "a Partial tensor must be reduced before registration"
            )
    layout = dtensor_layout(tuple(dt.shape), tuple(mesh.shape), tuple(coord), placements, where)
    local = getattr(dt, "_local_tensor", None)
    if local is None:
        with torch.no_grad():
            local = dt.to_local()
    if tuple(local.shape) != layout.local_shape:
        raise PlanError(
            f"{where}: local shard has shape {tuple(local.shape)}, its placements "
            f"{dt.placements} describe {layout.local_shape}"
        )
    return local, layout


def _checked(
    name: str,
    canonical: str,
    tensor: torch.Tensor,
    global_shape: tuple[int, ...],
    layout: Layout,
    where: str,
    storage: str = PLAIN,
    meta: Mapping[str, str] | None = None,
) -> LocalTensor:
    want = storage_data_shape(storage, layout.local_shape)
    if tuple(tensor.shape) != want:
        raise PlanError(
            f"{where}: local tensor has shape {tuple(tensor.shape)} but its placement "
            f"describes {want}"
        )
    check_layout(tuple(global_shape), layout, where)
    return LocalTensor(
        name=name,
        canonical=canonical,
        tensor=tensor,
        global_shape=tuple(int(s) for s in global_shape),
        layout=layout,
        storage=storage,
        meta=tuple(sorted((meta or {}).items())),
    )


_SCALE_SHAPES = {
    MXFP8: mxfp8_scale_shape,
    FP8_BLOCK: fp8_block_scale_shape,
    NVFP4: nvfp4_scale_shape,
}


def _quantized(t: LocalTensor, value: Placed, where: str) -> LocalTensor:
    """A quantized persistent buffer: uint8 data, scales of the format's shape, the
    element dtype it stands for, and (nvfp4) a float32 global scale of one element."""
    if value.storage not in _SCALE_SHAPES:
        raise PlanError(
            f"{where}: unknown storage {value.storage!r}; known: {PLAIN!r}, {list(_SCALE_SHAPES)}"
        )
    want = _SCALE_SHAPES[value.storage](t.layout.local_shape)
    sc = value.scales
    if value.tensor.dtype != torch.uint8 or sc is None or tuple(sc.shape) != want:
        raise PlanError(
            f"{where}: {value.storage} storage needs uint8 data and scales of shape {want}, "
            f"got data {value.tensor.dtype} and scales "
            f"{None if sc is None else tuple(sc.shape)}"
        )
    gs = value.global_scale
    if (value.storage == NVFP4) != (gs is not None) or (
        gs is not None and (gs.dtype != torch.float32 or gs.numel() != 1)
    ):
        raise PlanError(
            f"{where}: a float32 global_scale of one element goes with nvfp4 storage only, "
            f"got {None if gs is None else (gs.dtype, tuple(gs.shape))} for {value.storage}"
        )
    if not value.dtype:
        raise PlanError(f"{where}: {value.storage} storage needs dtype= (the source dtype)")
    return dataclasses.replace(t, scales=sc, logical_dtype=value.dtype, global_scale=gs)
