"""Validation of worker and agent registrations: bad input is refused at the door.

Every message names the field, the tensor and the rank (and pool) at fault, so the user can
fix the registration without reading controller logs.
"""

from __future__ import annotations

import ipaddress
import math
import re
import time
from dataclasses import dataclass

from refitd._proto import refitd_pb2 as pb
from refitd.plan.layout import Box, TensorSpec
from refitd.plan.links import OFFERS
from refitd.plan.wire import DTYPE_SIZES, PLAIN, STORAGE_FORMATS
from refitd.server.errors import invalid
from refitd.server.interning import Interner

DEVICE_RE = re.compile(r"^(cpu|cuda):(\d{1,6})$")
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
HOST_RE = re.compile(r"^[A-Za-z0-9_.:\-\[\]%]{1,255}$")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
MAX_DIMS = 8
MAX_BOXES_PAIRWISE = 256
# Bounds that keep every later computation (plan sizes in int64, loops over boxes) sane.
MAX_DIM = 1 << 40
MAX_TENSOR_BYTES = 1 << 50
MAX_TENSORS = 1 << 18
MAX_BOXES = 1 << 16
MAX_TENSOR_NAME = 512
YIELD_EVERY = 128  # tensors validated between two yields of the GIL
MAX_HANDLE_BYTES = 1 << 16
MAX_META = 64
MAX_META_KEY = 128
MAX_META_VALUE = 4096
MAX_POOL_SIZE = 1 << 20
MAX_SLOTS_PER_AGENT = 4096
MAX_MESSAGE_TEXT = 1 << 16
MAX_IDENTITY_TEXT = 128
MAX_TIMEOUT_S = 7 * 24 * 3600.0

ROLE_NAMES = {pb.ROLE_SOURCE: "source", pb.ROLE_DESTINATION: "destination"}


def check_device(device: str, what: str) -> str:
    """A device slot name: 'cpu:K' or 'cuda:K'."""
    if not DEVICE_RE.match(device):
        raise invalid(f"{what}: device {device[:64]!r} must look like 'cpu:K' or 'cuda:K'")
    return device


def check_text(value: str, limit: int, field: str, empty_ok: bool = False) -> str:
    """Free text (tensor names, messages): bounded, no control characters."""
    if not value and not empty_ok:
        raise invalid(f"{field} is empty")
    if len(value) > limit:
        raise invalid(f"{field} is {len(value)} characters, at most {limit}")
    if CONTROL_RE.search(value):
        raise invalid(f"{field} {value[:64]!r} contains control characters")
    return value


def check_host(host: str, field: str) -> str:
    """A host name or address as agents and workers give it."""
    if not host:
        raise invalid(f"{field} is empty")
    if not HOST_RE.match(host):
        raise invalid(
            f"{field}={host[:64]!r} must be 1-255 characters of letters, digits and '_.:-[]%'"
        )
    return host


def check_id(value: str, field: str) -> str:
    """A worker or agent id (assigned by the controller, echoed back by clients)."""
    if not ID_RE.match(value):
        raise invalid(
            f"field {field}={value[:64]!r} must be 1-64 characters of letters, digits, "
            f"'_', '.', '-'"
        )
    return value


def check_optional_id(value: str, field: str) -> str:
    return check_id(value, field) if value else value


def check_timeout(value: float, field: str) -> float:
    """A requested timeout in seconds: finite, >= 0 (0: the default), at most a week."""
    if not math.isfinite(value) or value < 0 or value > MAX_TIMEOUT_S:
        raise invalid(
            f"field {field} must be a finite number in [0, {MAX_TIMEOUT_S:g}], got {value}"
        )
    return value


def check_non_negative(value: int | float, field: str) -> None:
    if not (isinstance(value, int) or math.isfinite(value)) or value < 0:
        raise invalid(f"field {field} must be a finite number >= 0, got {value}")


def check_refit_request(req: pb.RefitRequest, waits: tuple[int, ...]) -> None:
    check_id(req.worker_id, "worker_id")
    if req.wait not in waits:
        raise invalid(f"field wait={req.wait} is not a WaitFor value")
    if req.version <= 0:
        raise invalid(f"field version must be > 0, got {req.version}")
    check_timeout(req.timeout_s, "timeout_s")


def check_ack(req: pb.AckRequest) -> None:
    check_id(req.worker_id, "worker_id")
    if req.event_id <= 0:
        raise invalid(f"field event_id must be > 0, got {req.event_id}")
    check_text(req.message, MAX_MESSAGE_TEXT, "field message of the ack", empty_ok=True)
    if len(req.moved_tensors) > MAX_TENSORS:
        raise invalid(
            f"field moved_tensors lists {len(req.moved_tensors)} names, at most {MAX_TENSORS}"
        )
    for name in req.moved_tensors:
        check_text(name, MAX_TENSOR_NAME, "a name in field moved_tensors")


def check_register_agent(req: pb.RegisterAgentRequest) -> None:
    check_host(req.host, "field host of RegisterAgent")
    if len(req.slots) > MAX_SLOTS_PER_AGENT:
        raise invalid(
            f"agent on host {req.host!r} registers {len(req.slots)} slots, at most "
            f"{MAX_SLOTS_PER_AGENT}"
        )
    if req.pid < 0:
        raise invalid(f"field pid of agent on host {req.host!r} must be >= 0, got {req.pid}")
    check_optional_id(req.agent_id, f"field agent_id of agent on host {req.host!r}")
    unknown = sorted(set(req.links) - OFFERS)
    if unknown:
        raise invalid(
            f"field links of agent on host {req.host!r} names unknown paths "
            f"{[u[:32] for u in unknown[:4]]}; known: {', '.join(sorted(OFFERS))}"
        )
    if req.data_plane_address:
        try:
            ipaddress.ip_address(req.data_plane_address)
        except ValueError:
            raise invalid(
                f"field data_plane_address of agent on host {req.host!r} must be an IP "
                f"address, got {req.data_plane_address[:64]!r}"
            ) from None


def check_report(req: pb.AgentReport, slots: list[int]) -> None:
    """An agent's report (and the batched ones in `more`): known kind, its own slots."""
    for i, r in enumerate((req, *req.more)):
        where = "report" if i == 0 else f"report more[{i - 1}]"
        if r.more and i > 0:
            raise invalid(f"{where} of agent {req.agent_id}: nested field more")
        if r.kind not in pb.ReportKind.values() or r.kind == pb.REPORT_KIND_UNSPECIFIED:
            raise invalid(f"field kind={r.kind} of {where} is not a ReportKind")
        if r.slot not in slots:
            raise invalid(
                f"agent {req.agent_id} {where} names slot {r.slot}, which it does not serve "
                f"(its slots: {slots})"
            )
        for field in ("command_id", "refit_id", "bytes_sent", "bytes_received", "bytes_local"):
            check_non_negative(getattr(r, field), f"{field} of {where} for slot {r.slot}")
        check_non_negative(r.seconds, f"seconds of {where} for slot {r.slot}")
        check_text(r.message, MAX_MESSAGE_TEXT, f"field message of {where}", empty_ok=True)


def check_identifier(value: str, field: str) -> str:
    """Model and pool names: short, printable, no spaces."""
    if not NAME_RE.match(value):
        raise invalid(
            f"field {field}={value!r} must be 1-128 characters of letters, digits, '_', '.', '-'"
        )
    return value


def check_process(p: pb.ProcessIdentity, what: str) -> None:
    """A process identity: its boot and namespace named, its pid and start positive."""
    check_text(p.boot_id, MAX_IDENTITY_TEXT, f"{what}: boot_id")
    check_text(p.pid_namespace, MAX_IDENTITY_TEXT, f"{what}: pid_namespace")
    if p.pid <= 0 or p.start_ticks <= 0:
        raise invalid(f"{what}: pid and start_ticks must be > 0, got {p.pid}, {p.start_ticks}")


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
    if req.pool_size > MAX_POOL_SIZE:
        raise invalid(
            f"field pool_size of pool {req.pool!r} is {req.pool_size}, at most {MAX_POOL_SIZE}"
        )
    who = f"rank {req.rank} in pool {req.pool!r}"
    check_host(req.host, f"field host of {who}")
    check_device(req.device, f"field device of {who}")
    if req.pid < 0:
        raise invalid(f"field pid of {who} must be >= 0, got {req.pid}")
    check_optional_id(req.worker_id, f"field worker_id of {who}")
    for name in ("held_version", "paused_refit_id"):
        if getattr(req, name) < 0:
            raise invalid(f"field {name} of {who} must be >= 0, got {getattr(req, name)}")
    if req.paused_refit_id and req.role != pb.ROLE_DESTINATION:
        raise invalid(f"field paused_refit_id of {who}: only destination ranks pause")
    for name in ("process", "predecessor"):
        if req.HasField(name):
            check_process(getattr(req, name), f"field {name} of {who}")
    if req.HasField("predecessor") and not req.HasField("process"):
        raise invalid(f"field predecessor of {who} needs field process (who looked it up)")
    if not req.tensors:
        raise invalid(f"rank {req.rank} of pool {req.pool!r} registers no tensors")
    if len(req.tensors) > MAX_TENSORS:
        raise invalid(f"{who} registers {len(req.tensors)} tensors, at most {MAX_TENSORS}")
    return ROLE_NAMES[req.role]


def specs_from_request(
    req: pb.RegisterWorkerRequest, slot: int, intern: Interner
) -> list[TensorSpec]:
    """TensorSpecs of a RegisterWorker request, every tensor checked on its own; names,
    shapes and boxes shared through `intern` with the ranks registered before."""
    seen: set[str] = set()
    specs = []
    header = _Header(intern(req.model), intern(req.pool), req.rank, slot)
    for i, t in enumerate(req.tensors):
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            # a large registration is tens of milliseconds of Python: let the gRPC poller
            # and the heartbeat handlers in between, or their calls queue behind it
            time.sleep(0)
        where = _Where(t.name, req.rank, req.pool)
        if not t.name:
            raise invalid(f"a tensor of rank {req.rank} in pool {req.pool!r} has an empty name")
        check_text(t.name, MAX_TENSOR_NAME, f"field name of a tensor of rank {req.rank}")
        if t.name in seen:
            raise invalid(f"{where}: duplicate tensor name")
        seen.add(t.name)
        specs.append(_spec(header, t, where, intern))
    return specs


@dataclass(frozen=True, slots=True)
class _Header:
    """What every TensorSpec of one registration shares (read from the request once)."""

    model: str
    pool: str
    rank: int
    slot: int


class _Where:
    """ "tensor 'x' of rank R in pool 'p'", formatted only when an error message needs it
    (a registration may hold 100,000 tensors)."""

    __slots__ = ("name", "pool", "rank")

    def __init__(self, name: str, rank: int, pool: str) -> None:
        self.name, self.rank, self.pool = name, rank, pool

    def __str__(self) -> str:
        return f"tensor {self.name!r} of rank {self.rank} in pool {self.pool!r}"


def _spec(
    head: _Header, t: pb.TensorRegistration, where: _Where | str, intern: Interner
) -> TensorSpec:
    gshape = intern(tuple(t.global_shape))
    lshape = intern(tuple(t.local_shape))
    ndim = len(gshape)
    if ndim > MAX_DIMS:
        raise invalid(f"{where}: global_shape has {ndim} dims, at most {MAX_DIMS}")
    if gshape and min(gshape) < 0:
        raise invalid(f"{where}: global_shape {list(gshape)} has a negative dim")
    if gshape and max(gshape) > MAX_DIM:
        raise invalid(f"{where}: global_shape {list(gshape)} has a dim above {MAX_DIM}")
    if len(lshape) != ndim:
        raise invalid(
            f"{where}: local_shape {list(lshape)} has {len(lshape)} dims, global_shape "
            f"{list(gshape)} has {ndim}"
        )
    if lshape and min(lshape) < 0:
        raise invalid(f"{where}: local_shape {list(lshape)} has a negative dim")
    if lshape and max(lshape) > MAX_DIM:
        raise invalid(f"{where}: local_shape {list(lshape)} has a dim above {MAX_DIM}")
    if t.dtype not in DTYPE_SIZES:
        raise invalid(f"{where}: unknown dtype {t.dtype[:64]!r}; known: {sorted(DTYPE_SIZES)}")
    nbytes = math.prod(gshape) * DTYPE_SIZES[t.dtype]
    if nbytes > MAX_TENSOR_BYTES:
        raise invalid(
            f"{where}: global_shape {list(gshape)} of {t.dtype} is {nbytes} bytes, at most "
            f"{MAX_TENSOR_BYTES}"
        )
    if len(t.canonical) > MAX_TENSOR_NAME or CONTROL_RE.search(t.canonical):
        check_text(t.canonical, MAX_TENSOR_NAME, f"{where}: field canonical", empty_ok=True)
    if len(t.memory) > MAX_HANDLE_BYTES:
        raise invalid(
            f"{where}: field memory is {len(t.memory)} bytes, a handle is at most "
            f"{MAX_HANDLE_BYTES}"
        )
    if len(t.meta) > MAX_META:
        raise invalid(f"{where}: field meta has {len(t.meta)} entries, at most {MAX_META}")
    for k, v in t.meta.items():
        check_text(k, MAX_META_KEY, f"{where}: a key of field meta")
        check_text(v, MAX_META_VALUE, f"{where}: field meta[{k!r}]", empty_ok=True)
    if len(t.boxes) > MAX_BOXES:
        raise invalid(f"{where}: {len(t.boxes)} boxes, at most {MAX_BOXES}")
    storage = t.storage or PLAIN
    if storage not in STORAGE_FORMATS:
        raise invalid(f"{where}: unknown storage {storage[:64]!r}; known: {list(STORAGE_FORMATS)}")
    if not t.memory:
        raise invalid(f"{where}: field memory (the memory handle) is empty")
    if not t.boxes and math.prod(lshape):
        raise invalid(
            f"{where}: no boxes, but local_shape {list(lshape)} holds {math.prod(lshape)} "
            "elements (only an empty shard, a local dim of 0, may hold no part of the tensor)"
        )
    boxes = tuple(_box(b, i, gshape, lshape, where) for i, b in enumerate(t.boxes))
    _check_disjoint(boxes, where)
    name = intern(t.name)
    return TensorSpec(
        model=head.model,
        pool=head.pool,
        rank=head.rank,
        slot=head.slot,
        name=name,
        canonical=intern(t.canonical) if t.canonical else name,
        global_shape=gshape,
        dtype=intern(t.dtype),
        local_shape=lshape,
        boxes=intern(boxes),
        storage=intern(storage),
        meta=intern(tuple(sorted(t.meta.items()))) if t.meta else (),
    )


def _box(
    b: pb.Box, i: int, gshape: tuple[int, ...], lshape: tuple[int, ...], where: _Where | str
) -> Box:
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


def _check_disjoint(boxes: tuple[Box, ...], where: _Where | str) -> None:
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
