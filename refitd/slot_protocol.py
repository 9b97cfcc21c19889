"""The typed messages between a node agent (or a benchmark) and a transfer process.

Commands go down the Pipe as `Request(rid, command)`; the process answers each with
`Response(rid, body)` where body is the command's reply, a `Failed`, or, before an
`Executed`, the `SourcesReleased` event. node.py converts the controller's protos into these
commands and their replies into report protos (proto_codec.py); nothing in between reads a
string-keyed dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    phases: seconds of the refit's phases (check_start_s: storage check and thread start;
    local_s: local copies from sources; messages_s: waiting for the messages after that;
    with messages, pack_s / unpack_s / recv_wait_s summed over chunks), so fixed per-refit
    overhead and the staging cost are visible next to the bytes.
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


# ---------------------------------------------------------------------- commands
@dataclass(frozen=True, slots=True)
class Connect:
    """Join the refit communicator of `epoch` as `rank` (peers reach this rank at the
    agent's data-plane address or interface)."""

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


@dataclass(frozen=True, slots=True)
class Load:
    """Cache a slot program and the memory handles of its tensors under `digest`."""

    digest: str
    program: bytes
    handles: dict[int, bytes]
    staging_bytes: int | None = None
    wire_chunk: int | None = None
    staged_chunk: int | None = None
    staged: tuple[int, ...] = ()
    model: str = ""
    snapshot: tuple[int, ...] = ()
    snapshot_bytes: int | None = None


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
class Execute:
    """Run one refit of a loaded plan."""

    digest: str
    version: int
    refit_id: int
    timeout_s: float
    verify: bool = False
    delta: DeltaPlan | None = None


@dataclass(frozen=True, slots=True)
class Apply:
    """Copy the staged tensors of `digest` in place, if refit_id's execute filled them."""

    digest: str
    refit_id: int


@dataclass(frozen=True, slots=True)
class Unload:
    digest: str


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop the running execute; with a refit id, a later execute of that refit too."""

    refit_id: int = 0


@dataclass(frozen=True, slots=True)
class Probe:
    """Raw reference for benchmarks: per peer rank one buffer of nbytes sent (or received)
    `repeat` times ({rank: (nbytes, repeat)}), or one memcpy of `memcpy` bytes `repeat`
    times on `device`. `prepare` only allocates; buffers live until `release`."""

    timeout_s: float
    sends: dict[int, tuple[int, int]] = field(default_factory=dict)
    recvs: dict[int, tuple[int, int]] = field(default_factory=dict)
    memcpy: int | None = None
    repeat: int = 1
    device: str = "cpu"
    prepare: bool = False
    release: bool = False


@dataclass(frozen=True, slots=True)
class Ping:
    pass


@dataclass(frozen=True, slots=True)
class Close:
    pass


Command = Connect | Load | Execute | Apply | Unload | Abort | Probe | Ping | Close


# ---------------------------------------------------------------------- replies
@dataclass(frozen=True, slots=True)
class Ack:
    """A command that answers nothing but success (connect, abort, close, probe setup)."""


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
    snapshot: SnapshotInfo | None = None


@dataclass(frozen=True, slots=True)
class Applied:
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Unloaded:
    unloaded: bool


@dataclass(frozen=True, slots=True)
class Probed:
    seconds: float


@dataclass(frozen=True, slots=True)
class DeltaResult:
    """The delta path's part of one execute (refitd.executor.delta.exchange): the base it
    holds, per message sent its kind and stats (delta_exchange's own records), timings."""

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

    report: ExecReport
    version: int
    refit_id: int
    delta: DeltaResult | None = None
    snapshot: SnapshotInfo | None = None


@dataclass(frozen=True, slots=True)
class SourcesReleased:
    """Event before an Executed: the trainer's memory is no longer read (wall time t)."""

    t: float


@dataclass(frozen=True, slots=True)
class Failed:
    """A command failed; kind is "storage_moved" or the exception's class name."""

    kind: str
    error: str


Reply = Ack | Pong | Loaded | Applied | Unloaded | Probed | Executed | SourcesReleased | Failed


@dataclass(frozen=True, slots=True)
class Request:
    rid: int
    command: Command


@dataclass(frozen=True, slots=True)
class Response:
    rid: int
    body: Reply
