"""The slot protocol: what a node agent (or a benchmark) and a transfer process say to each
other, and the one table every side dispatches from.

A command has three forms end to end: the controller's protobuf (refitd.node.codec decodes
it), the typed command here, and the typed report the transfer process answers with (the
codec encodes it into a pb.AgentReport). Down the transfer process's pipe a command travels
as `(request id, command)` and comes back as `(request id, report)`; an execute sends the
`SourcesReleased` event first with the same id. `VERBS` says, per command, which report a
success answers with, its field of pb.AgentCommand, the transfer slot's method that answers
it and how it runs. `SlotOptions` are a slot's timeouts and buffer sizes: their defaults are
written here, once (refitd.config.Settings takes its fields' defaults from them), because
the transfer process and the executor import this module and must not need pydantic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

if TYPE_CHECKING:
    from refitd.config import Settings

R = TypeVar("R")
REPLY_MARGIN_S = 10.0  # waited beyond a command's own timeout for its report to come back
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class SlotOptions:
    """A slot's timeouts (seconds) and buffer caps (bytes); `from_settings` in a node agent,
    the defaults in benchmarks and tests."""

    connect_timeout_s: float = 60.0  # the communicator (re)connects
    load_timeout_s: float = 60.0  # a slot program is loaded
    transfer_timeout_s: float = 300.0  # a refit (or an apply) of the slot
    rpc_timeout_s: float = 30.0  # the quick commands (abort, unload, ...) and the agent's RPCs
    staging_bytes: int = 256 * MiB  # cap on the slot's staging buffers
    snapshot_bytes: int = 2048 * MiB  # cap on the snapshot of the slot's sources
    rdma_protocol: str = "tcp"  # the rdma path's protocol (refitd.transfer.rdma_path)
    rdma_devices: tuple[str, ...] = ()  # its RDMA devices (empty: every one found)
    rdma_landing_bytes: int = 1024 * MiB  # cap on a slot's landing areas of packed messages

    @classmethod
    def from_settings(cls, settings: Settings) -> SlotOptions:
        return cls(
            connect_timeout_s=settings.connect_timeout_s,
            load_timeout_s=settings.load_timeout_s,
            transfer_timeout_s=settings.transfer_timeout_s,
            rpc_timeout_s=settings.rpc_timeout_s,
            staging_bytes=settings.staging_bytes,
            snapshot_bytes=settings.snapshot_bytes,
            rdma_protocol=settings.rdma_protocol,
            rdma_devices=tuple(settings.rdma_devices),
            rdma_landing_bytes=settings.rdma_landing_bytes,
        )


DEFAULTS = SlotOptions()


# ---------------------------------------------------------------------- reports
@dataclass
class MessageStat:
    id: int
    direction: str  # "send" | "recv"
    peer_slot: int
    nbytes: int
    seconds: float
    zero_copy_chunks: int = 0
    staged_chunks: int = 0


@dataclass
class ExecReport:
    """What one refit of one slot did: bytes and seconds per message, and totals.

    phases: seconds of the refit's phases (check_s: storage check; check_start_s: that and
    thread start; local_s: local copies from sources, of which local_launch_s their calls
    (on a CPU device, their work), on a GPU local_sync_s waiting for them and local_gpu_s
    their GPU time; messages_s: waiting for the messages after that; with messages,
    pack_s / unpack_s / recv_wait_s summed over chunks, bell_wait_s the time waiting for
    one-sided chunks to land; command_s: the whole execute command
    in the transfer process), so fixed per-refit overhead and the staging cost are visible
    next to the bytes.
    """

    slot: int
    seconds: float = 0.0
    sources_released_s: float = 0.0
    local_bytes: int = 0
    local_seconds: float = 0.0
    sent_bytes: int = 0
    recv_bytes: int = 0
    staging_peak_bytes: int = 0
    messages: list[MessageStat] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    # with verify: {"send": {message id: checksum}, "recv": {...}} (unsigned 64-bit)
    checksums: dict[str, dict[int, int]] | None = None
    # the first received chunk: when it completed (monotonic; 0: none) and its bytes; when
    # the last one completed
    first_landed_at: float = 0.0
    first_landed_bytes: int = 0
    last_landed_at: float = 0.0
    # a GPU landing's kernel configs: the grouped kernels' tiles and, per tensor launched
    # on its own, the config its tuner picked (`timed`) or the default
    tiles: dict[str, object] = field(default_factory=dict)

    def landed(self, nbytes: int) -> None:
        """`nbytes` more were received (the first and last chunks' times bound the bytes'
        arrival: a refit sharing the links with others measures its share between them)."""
        self.recv_bytes += nbytes
        if nbytes:
            self.last_landed_at = time.monotonic()
            if not self.first_landed_at:
                self.first_landed_at, self.first_landed_bytes = self.last_landed_at, nbytes


# `reported_as`: the pb.ReportKind (REPORT_KIND_<name>) of a report the controller receives
@dataclass(frozen=True, slots=True)
class Ack:
    """A command that answers nothing but success (abort, close)."""


@dataclass(frozen=True, slots=True)
class Connected:
    """Connected; `loaded`: digests of the plans the transfer process holds (a fresh
    process holds none: the controller loads its programs again)."""

    reported_as: ClassVar[str] = "connected"
    loaded: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Pong:
    slot: int | None


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """What a slot's snapshot holds: its bytes (0 when not taken) and why not, if so."""

    bytes: int
    fallback: str


@dataclass(frozen=True, slots=True)
class Loaded:
    reported_as: ClassVar[str] = "loaded"
    snapshot: SnapshotInfo | None = None


@dataclass(frozen=True, slots=True)
class Applied:
    reported_as: ClassVar[str] = "done"
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Unloaded:
    unloaded: bool


@dataclass(frozen=True, slots=True)
class Probed:
    """Seconds of a timed probe (0.0 when it only allocated or released its buffers)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class DeltaResult:
    """The delta path's part of one execute (refitd.executor.delta.exchange): the base it
    holds, per message sent its kind and stats (the exchange's own records), timings."""

    promoted: bool
    base_version: int
    pending_version: int
    base_bytes: int
    sent: dict[int, dict]
    received: dict[int, dict]
    encode_s: float
    apply_s: float
    seconds: float
    wire_bytes: int
    recv_bytes: int


@dataclass(frozen=True, slots=True)
class Executed:
    """One refit of the slot: the executor's report (delta bytes and checksums included),
    and the delta path's and the snapshot's parts when they took part."""

    reported_as: ClassVar[str] = "done"
    report: ExecReport
    version: int
    refit_id: int
    delta: DeltaResult | None = None
    snapshot: SnapshotInfo | None = None


@dataclass(frozen=True, slots=True)
class SourcesReleased:
    """Event before an Executed: the trainer's memory is no longer read (wall time t)."""

    reported_as: ClassVar[str] = "sources_released"
    t: float


@dataclass(frozen=True, slots=True)
class Failed:
    """A command failed; kind is "storage_moved" or the exception's class name."""

    reported_as: ClassVar[str] = "failed"
    kind: str
    error: str


Report = (
    Ack
    | Connected
    | Pong
    | Loaded
    | Applied
    | Unloaded
    | Probed
    | Executed
    | SourcesReleased
    | Failed
)


# ---------------------------------------------------------------------- commands
class SlotCommand(Generic[R]):
    """A command of one slot whose success is answered by a report of type R."""

    __slots__ = ()

    def wait_s(self, options: SlotOptions) -> float:
        """How long the sender waits for the report."""
        return options.rpc_timeout_s


@dataclass(frozen=True, slots=True)
class Connect(SlotCommand[Connected]):
    """Join the refit communicator of `epoch` as `rank` (all ranks connect at the same
    time; peers reach this rank at the agent's data-plane address or interface)."""

    epoch: int
    store_host: str
    store_port: int
    rank: int
    world_size: int
    transport: str
    timeout_s: float
    slot_ranks: dict[int, int] | None = None
    store_token: str = ""
    data_plane_address: str = ""
    data_plane_interface: str = ""
    rdma_protocol: str = "tcp"  # the agent's settings of the rdma path
    rdma_devices: tuple[str, ...] = ()
    rdma_landing_bytes: int = DEFAULTS.rdma_landing_bytes

    def wait_s(self, options: SlotOptions) -> float:
        return self.timeout_s + REPLY_MARGIN_S


@dataclass(frozen=True, slots=True)
class Load(SlotCommand[Loaded]):
    """Cache a slot program and the memory handles of its tensors under `digest`.

    wire_chunk and staged_chunk must be the same on every slot of a plan (None: the
    executor's). `staged`: plan tensor indices written into staging buffers (allocated
    here; those of the model's older plans are freed) and copied in place by `Apply`.
    `snapshot`: source tensors copied into a snapshot before the trainer is released (at
    most snapshot_bytes per slot, else live reads; the report's `snapshot` says which).
    """

    digest: str
    program: bytes
    handles: dict[int, bytes]
    staging_bytes: int = DEFAULTS.staging_bytes
    wire_chunk: int | None = None
    staged_chunk: int | None = None
    staged: tuple[int, ...] = ()
    model: str = ""
    snapshot: tuple[int, ...] = ()
    snapshot_bytes: int = DEFAULTS.snapshot_bytes

    def wait_s(self, options: SlotOptions) -> float:
        return options.load_timeout_s


@dataclass(frozen=True, slots=True)
class DeltaPlan:
    """This slot's part of a delta refit: message ids sent and received on the delta path,
    those allowed to go as a delta, the version to promote (-1: none), the density cap."""

    send: tuple[int, ...]
    recv: tuple[int, ...]
    allowed: tuple[int, ...]
    promote: int
    max_density: float


@dataclass(frozen=True, slots=True)
class Execute(SlotCommand[Executed]):
    """Run one refit of a loaded plan (with verify, its checksums; with delta, the delta
    path's part)."""

    digest: str
    version: int
    refit_id: int
    timeout_s: float
    verify: bool = False
    delta: DeltaPlan | None = None
    lane: int = 0  # the refit's tag space on the communicator (refits of models at once)
    weight: float = 0.0  # the model's weight on links other models' refits share (0: 1)
    piece: int = 0  # bytes of the pieces its gated chunks go in (0: whole; Share.pieces)

    def wait_s(self, options: SlotOptions) -> float:
        return self.timeout_s + REPLY_MARGIN_S


@dataclass(frozen=True, slots=True)
class Apply(SlotCommand[Applied]):
    """Copy the staged tensors of `digest` in place, if refit_id's execute filled them."""

    digest: str
    refit_id: int
    timeout_s: float = DEFAULTS.transfer_timeout_s

    def wait_s(self, options: SlotOptions) -> float:
        return self.timeout_s


@dataclass(frozen=True, slots=True)
class Unload(SlotCommand[Unloaded]):
    digest: str


@dataclass(frozen=True, slots=True)
class Abort(SlotCommand[Ack]):
    """Stop the running execute of this slot (the node agent refuses a later execute of
    refit_id itself)."""

    refit_id: int = 0


@dataclass(frozen=True, slots=True)
class Probe(SlotCommand[Probed]):
    """Raw reference for benchmarks: per peer rank one buffer of nbytes sent (or received)
    `repeat` times ({rank: (nbytes, repeat)}), or one memcpy of `memcpy` bytes `repeat`
    times on `device` (in pieces of `memcpy_piece` bytes when set, as a refit copies its
    chunks). `prepare` only allocates; buffers live until `release`, except `kept` memcpy
    buffers, which live as long as the process (made early, they are as old as the worker
    memory a bench registered beside them: a VM backs fresh pages more slowly)."""

    timeout_s: float
    sends: dict[int, tuple[int, int]] = field(default_factory=dict)
    recvs: dict[int, tuple[int, int]] = field(default_factory=dict)
    memcpy: int | None = None
    repeat: int = 1
    device: str = "cpu"
    memcpy_piece: int | None = None
    kept: bool = False
    prepare: bool = False
    release: bool = False

    def wait_s(self, options: SlotOptions) -> float:
        return self.timeout_s


@dataclass(frozen=True, slots=True)
class Ping(SlotCommand[Pong]):
    pass


@dataclass(frozen=True, slots=True)
class Close(SlotCommand[Ack]):
    pass


# ---------------------------------------------------------------------- the table
@dataclass(frozen=True, slots=True)
class Verb:
    """How every side handles one command.

    wire: its field of pb.AgentCommand ("": the controller never sends it). handler: the
    method of the transfer process's slot (refitd.transfer.slot.TransferSlot) answering it.
    refit: it runs a refit: on its own thread in the transfer process (the command loop
    stays free for abort), reporting SourcesReleased before its report, and refused by the
    node agent once its refit was aborted. all_slots: the node agent hands it to every slot
    at once, ahead of their queued commands. fresh: it can run on a restarted transfer
    process (the others need the communicator or programs it lost).
    """

    command: type[SlotCommand[Any]]
    report: type
    wire: str
    handler: str
    refit: bool = False
    all_slots: bool = False
    fresh: bool = False


VERBS: dict[type, Verb] = {
    v.command: v
    for v in (
        Verb(Connect, Connected, "connect", "connect", fresh=True),
        Verb(Load, Loaded, "load", "load"),
        Verb(Execute, Executed, "execute", "execute", refit=True),
        Verb(Apply, Applied, "apply", "apply"),
        Verb(Abort, Ack, "abort", "abort", all_slots=True),
        Verb(Unload, Unloaded, "", "unload"),
        Verb(Probe, Probed, "", "probe"),
        Verb(Ping, Pong, "", "ping"),
        Verb(Close, Ack, "", "close"),
    )
}
WIRE_VERBS: dict[str, Verb] = {v.wire: v for v in VERBS.values() if v.wire}


class ProtocolError(ValueError):
    """Something that is not a command of this protocol."""


def verb_of(command: object) -> Verb:
    """The table's entry of a typed command."""
    verb = VERBS.get(type(command))
    if verb is None:
        raise ProtocolError(f"not a slot command: {type(command).__name__}")
    return verb
