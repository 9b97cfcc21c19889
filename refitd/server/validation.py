"""Validation of worker and agent registrations: bad input is refused at the door.

Every message names the field, the tensor and the rank (and pool) at fault, so the user can
fix the registration without reading controller logs.
"""

from __future__ import annotations

import re

from refitd._proto import refitd_pb2 as pb
from refitd.plan.layout import PLAIN, STORAGE_FORMATS, Box, TensorSpec
from refitd.plan.wire import DTYPE_SIZES
from refitd.server.errors import invalid

DEVICE_RE = re.compile(r"^(cpu|cuda):(\d+)$")
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
MAX_DIMS = 8
MAX_BOXES_PAIRWISE = 256

ROLE_NAMES = {pb.ROLE_SOURCE: "source", pb.ROLE_DESTINATION: "destination"}


def check_device(device: str, what: str) -> str:
    """A device slot name: 'cpu:K' or 'cuda:K'."""
    if not DEVICE_RE.match(device):
        raise invalid(f"{what}: device {device!r} must look like 'cpu:K' or 'cuda:K'")
    return device


def check_identifier(value: str, field: str) -> str:
    """Model and pool names: short, printable, no spaces."""
    if not NAME_RE.match(value):
        raise invalid(
            f"field {field}={value!r} must be 1-128 characters of letters, digits, '_', '.', '-'"
        )
    return value


def check_worker_header(req: pb.RegisterWorkerRequest) -> str:
    """Fields of RegisterWorker other than the tensors; returns the role name."""
    check_identifier(req.model, "model")
    check_identifier(req.pool, "pool")
    if req.role not in ROLE_NAMES:
        raise invalid(
            f"field role of rank {req.rank} in pool {req.pool!r} must be ROLE_SOURCE or "
            f"ROLE_DESTINATION, got {req.role}"
        )
    if req.pool_size < 1:
        raise invalid(f"field pool_size of pool {req.pool!r} must be >= 1, got {req.pool_size}")
    if not 0 <= req.rank < req.pool_size:
        raise invalid(
            f"field rank {req.rank} of pool {req.pool!r} is outside [0, pool_size={req.pool_size})"
        )
    if not req.host:
        raise invalid(f"field host of rank {req.rank} in pool {req.pool!r} is empty")
    check_device(req.device, f"field device of rank {req.rank} in pool {req.pool!r}")
    if not req.tensors:
        raise invalid(f"rank {req.rank} of pool {req.pool!r} registers no tensors")
    return ROLE_NAMES[req.role]


def specs_from_request(req: pb.RegisterWorkerRequest, slot: int) -> list[TensorSpec]:
    """TensorSpecs of a RegisterWorker request, every tensor checked on its own."""
    seen: set[str] = set()
    specs = []
    for t in req.tensors:
        where = f"tensor {t.name!r} of rank {req.rank} in pool {req.pool!r}"
        if not t.name:
            raise invalid(f"a tensor of rank {req.rank} in pool {req.pool!r} has an empty name")
        if t.name in seen:
            raise invalid(f"{where}: duplicate tensor name")
        seen.add(t.name)
        specs.append(_spec(req, t, slot, where))
    return specs


def _spec(
    req: pb.RegisterWorkerRequest, t: pb.TensorRegistration, slot: int, where: str
) -> TensorSpec:
    gshape = tuple(t.global_shape)
    lshape = tuple(t.local_shape)
    ndim = len(gshape)
    if ndim > MAX_DIMS:
        raise invalid(f"{where}: global_shape has {ndim} dims, at most {MAX_DIMS}")
    if any(d < 0 for d in gshape):
        raise invalid(f"{where}: global_shape {list(gshape)} has a negative dim")
    if len(lshape) != ndim:
        raise invalid(
            f"{where}: local_shape {list(lshape)} has {len(lshape)} dims, global_shape "
            f"{list(gshape)} has {ndim}"
        )
    if any(d < 0 for d in lshape):
        raise invalid(f"{where}: local_shape {list(lshape)} has a negative dim")
    if t.dtype not in DTYPE_SIZES:
        raise invalid(f"{where}: unknown dtype {t.dtype!r}; known: {sorted(DTYPE_SIZES)}")
    storage = t.storage or PLAIN
    if storage not in STORAGE_FORMATS:
        raise invalid(f"{where}: unknown storage {storage!r}; known: {list(STORAGE_FORMATS)}")
    if not t.memory:
        raise invalid(f"{where}: field memory (the memory handle) is empty")
    if not t.boxes:
        raise invalid(f"{where}: no boxes (a placement needs at least one)")
    boxes = tuple(_box(b, i, gshape, lshape, where) for i, b in enumerate(t.boxes))
    _check_disjoint(boxes, where)
    return TensorSpec(
        model=req.model,
        pool=req.pool,
        rank=req.rank,
        slot=slot,
        name=t.name,
        canonical=t.canonical or t.name,
        global_shape=gshape,
        dtype=t.dtype,
        local_shape=lshape,
        boxes=boxes,
        storage=storage,
        meta=tuple(sorted(t.meta.items())),
    )


def _box(b: pb.Box, i: int, gshape: tuple[int, ...], lshape: tuple[int, ...], where: str) -> Box:
    ndim = len(gshape)
    off, shp, loff = tuple(b.offset), tuple(b.shape), tuple(b.local_offset)
    for field, v in (("offset", off), ("shape", shp), ("local_offset", loff)):
        if len(v) != ndim:
            raise invalid(
                f"{where}: box {i} {field} {list(v)} has {len(v)} dims, global_shape "
                f"{list(gshape)} has {ndim}"
            )
    for d in range(ndim):
        if shp[d] <= 0 or off[d] < 0 or loff[d] < 0:
            raise invalid(
                f"{where}: box {i} dim {d}: offset {off[d]}, shape {shp[d]}, local_offset "
                f"{loff[d]} must be >= 0 with shape > 0"
            )
        if off[d] + shp[d] > gshape[d]:
            raise invalid(
                f"{where}: box {i} dim {d}: offset {off[d]} + shape {shp[d]} exceeds "
                f"global_shape {gshape[d]}"
            )
        if loff[d] + shp[d] > lshape[d]:
            raise invalid(
                f"{where}: box {i} dim {d}: local_offset {loff[d]} + shape {shp[d]} exceeds "
                f"local_shape {lshape[d]}"
            )
    return Box(off, shp, loff)


def _overlap(
    a0: tuple[int, ...], b0: tuple[int, ...], s: tuple[int, ...], t: tuple[int, ...]
) -> bool:
    return all(x < y + ty and y < x + sx for x, y, sx, ty in zip(a0, b0, s, t, strict=True))


def _check_disjoint(boxes: tuple[Box, ...], where: str) -> None:
    """Boxes of one tensor may overlap neither in the global nor in the local tensor."""
    if len(boxes) > MAX_BOXES_PAIRWISE:
        return  # the planner's sweep checks large placements
    for i in range(len(boxes)):
        for j in range(i):
            a, b = boxes[i], boxes[j]
            if _overlap(a.offset, b.offset, a.shape, b.shape):
                raise invalid(f"{where}: boxes {j} and {i} overlap in the global tensor")
            if _overlap(a.local_offset, b.local_offset, a.shape, b.shape):
                raise invalid(f"{where}: boxes {j} and {i} overlap in the local tensor")
