from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SOURCE: _ClassVar[Role]
    ROLE_DESTINATION: _ClassVar[Role]

class WaitFor(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WAIT_UNSPECIFIED: _ClassVar[WaitFor]
    WAIT_SOURCES_READ: _ClassVar[WaitFor]
    WAIT_COMMITTED: _ClassVar[WaitFor]
    WAIT_ACCEPTED: _ClassVar[WaitFor]
    WAIT_SERVED: _ClassVar[WaitFor]

class RefitState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFIT_STATE_UNSPECIFIED: _ClassVar[RefitState]
    REFIT_STATE_REQUESTED: _ClassVar[RefitState]
    REFIT_STATE_SOURCES_READY: _ClassVar[RefitState]
    REFIT_STATE_TRANSFERRING: _ClassVar[RefitState]
    REFIT_STATE_LANDED: _ClassVar[RefitState]
    REFIT_STATE_COMMITTED: _ClassVar[RefitState]
    REFIT_STATE_FAILED: _ClassVar[RefitState]
    REFIT_STATE_SUPERSEDED: _ClassVar[RefitState]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_PAUSE: _ClassVar[EventKind]
    EVENT_KIND_COMMIT: _ClassVar[EventKind]
    EVENT_KIND_ABORT: _ClassVar[EventKind]
    EVENT_KIND_INCOMPLETE: _ClassVar[EventKind]
    EVENT_KIND_HELLO: _ClassVar[EventKind]

class ReportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPORT_KIND_UNSPECIFIED: _ClassVar[ReportKind]
    REPORT_KIND_CONNECTED: _ClassVar[ReportKind]
    REPORT_KIND_LOADED: _ClassVar[ReportKind]
    REPORT_KIND_SOURCES_RELEASED: _ClassVar[ReportKind]
    REPORT_KIND_DONE: _ClassVar[ReportKind]
    REPORT_KIND_FAILED: _ClassVar[ReportKind]
ROLE_UNSPECIFIED: Role
ROLE_SOURCE: Role
ROLE_DESTINATION: Role
WAIT_UNSPECIFIED: WaitFor
WAIT_SOURCES_READ: WaitFor
WAIT_COMMITTED: WaitFor
WAIT_ACCEPTED: WaitFor
WAIT_SERVED: WaitFor
REFIT_STATE_UNSPECIFIED: RefitState
REFIT_STATE_REQUESTED: RefitState
REFIT_STATE_SOURCES_READY: RefitState
REFIT_STATE_TRANSFERRING: RefitState
REFIT_STATE_LANDED: RefitState
REFIT_STATE_COMMITTED: RefitState
REFIT_STATE_FAILED: RefitState
REFIT_STATE_SUPERSEDED: RefitState
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_PAUSE: EventKind
EVENT_KIND_COMMIT: EventKind
EVENT_KIND_ABORT: EventKind
EVENT_KIND_INCOMPLETE: EventKind
EVENT_KIND_HELLO: EventKind
REPORT_KIND_UNSPECIFIED: ReportKind
REPORT_KIND_CONNECTED: ReportKind
REPORT_KIND_LOADED: ReportKind
REPORT_KIND_SOURCES_RELEASED: ReportKind
REPORT_KIND_DONE: ReportKind
REPORT_KIND_FAILED: ReportKind

class Box(_message.Message):
    __slots__ = ("offset", "shape", "local_offset")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    local_offset: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., local_offset: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorRegistration(_message.Message):
    __slots__ = ("name", "canonical", "global_shape", "dtype", "local_shape", "boxes", "storage", "memory", "meta")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    BOXES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    name: str
    canonical: str
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    local_shape: _containers.RepeatedScalarFieldContainer[int]
    boxes: _containers.RepeatedCompositeFieldContainer[Box]
    storage: str
    memory: bytes
    meta: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., canonical: _Optional[str] = ..., global_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., local_shape: _Optional[_Iterable[int]] = ..., boxes: _Optional[_Iterable[_Union[Box, _Mapping]]] = ..., storage: _Optional[str] = ..., memory: _Optional[bytes] = ..., meta: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("model", "pool", "role", "rank", "pool_size", "host", "device", "pid", "tensors", "worker_id", "held_version", "paused_refit_id", "staged", "snapshot", "adapter", "process", "predecessor")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    PREDECESSOR_FIELD_NUMBER: _ClassVar[int]
    model: str
    pool: str
    role: Role
    rank: int
    pool_size: int
    host: str
    device: str
    pid: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorRegistration]
    worker_id: str
    held_version: int
    paused_refit_id: int
    staged: bool
    snapshot: bool
    adapter: bool
    process: ProcessIdentity
    predecessor: ProcessIdentity
    def __init__(self, model: _Optional[str] = ..., pool: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., rank: _Optional[int] = ..., pool_size: _Optional[int] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., pid: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorRegistration, _Mapping]]] = ..., worker_id: _Optional[str] = ..., held_version: _Optional[int] = ..., paused_refit_id: _Optional[int] = ..., staged: _Optional[bool] = ..., snapshot: _Optional[bool] = ..., adapter: _Optional[bool] = ..., process: _Optional[_Union[ProcessIdentity, _Mapping]] = ..., predecessor: _Optional[_Union[ProcessIdentity, _Mapping]] = ...) -> None: ...

class ProcessIdentity(_message.Message):
    __slots__ = ("boot_id", "pid_namespace", "pid", "start_ticks")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    pid_namespace: str
    pid: int
    start_ticks: int
    def __init__(self, boot_id: _Optional[str] = ..., pid_namespace: _Optional[str] = ..., pid: _Optional[int] = ..., start_ticks: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "epoch", "current_version", "slot", "heartbeat_interval_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    current_version: int
    slot: int
    heartbeat_interval_s: float
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., current_version: _Optional[int] = ..., slot: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class UnregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class UnregisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class RefitRequest(_message.Message):
    __slots__ = ("worker_id", "version", "wait", "timeout_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    version: int
    wait: WaitFor
    timeout_s: float
    def __init__(self, worker_id: _Optional[str] = ..., version: _Optional[int] = ..., wait: _Optional[_Union[WaitFor, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RefitResponse(_message.Message):
    __slots__ = ("version", "state", "message", "seconds", "bytes", "served")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: RefitState
    message: str
    seconds: float
    bytes: int
    served: bool
    def __init__(self, version: _Optional[int] = ..., state: _Optional[_Union[RefitState, str]] = ..., message: _Optional[str] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., served: _Optional[bool] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("worker_id", "after_event")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    after_event: int
    def __init__(self, worker_id: _Optional[str] = ..., after_event: _Optional[int] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("event_id", "kind", "model", "pool", "version", "reason", "refit_id")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    kind: EventKind
    model: str
    pool: str
    version: int
    reason: str
    refit_id: int
    def __init__(self, event_id: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., model: _Optional[str] = ..., pool: _Optional[str] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., refit_id: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("worker_id", "event_id", "ok", "message", "moved_tensors")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MOVED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    event_id: int
    ok: bool
    message: str
    moved_tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., event_id: _Optional[int] = ..., ok: _Optional[bool] = ..., message: _Optional[str] = ..., moved_tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("subscribe", "ack")
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    subscribe: SubscribeRequest
    ack: AckRequest
    def __init__(self, subscribe: _Optional[_Union[SubscribeRequest, _Mapping]] = ..., ack: _Optional[_Union[AckRequest, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("model", "tensor", "pool", "rank")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    model: str
    tensor: str
    pool: str
    rank: int
    def __init__(self, model: _Optional[str] = ..., tensor: _Optional[str] = ..., pool: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("json", "text")
    JSON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    json: str
    text: str
    def __init__(self, json: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class SlotInfo(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: str
    def __init__(self, device: _Optional[str] = ...) -> None: ...

class RegisterAgentRequest(_message.Message):
    __slots__ = ("host", "slots", "pid", "agent_id", "batch_execute", "data_plane_address", "links")
    HOST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_EXECUTE_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    host: str
    slots: _containers.RepeatedCompositeFieldContainer[SlotInfo]
    pid: int
    agent_id: str
    batch_execute: bool
    data_plane_address: str
    links: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, host: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[SlotInfo, _Mapping]]] = ..., pid: _Optional[int] = ..., agent_id: _Optional[str] = ..., batch_execute: _Optional[bool] = ..., data_plane_address: _Optional[str] = ..., links: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterAgentResponse(_message.Message):
    __slots__ = ("agent_id", "slot_ids", "heartbeat_interval_s")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    heartbeat_interval_s: float
    def __init__(self, agent_id: _Optional[str] = ..., slot_ids: _Optional[_Iterable[int]] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class AgentStreamRequest(_message.Message):
    __slots__ = ("agent_id",)
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    def __init__(self, agent_id: _Optional[str] = ...) -> None: ...

class ConnectCommand(_message.Message):
    __slots__ = ("epoch", "store_host", "store_port", "world_size", "comm_rank", "transport", "timeout_s", "store_token")
    class CommRankEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMM_RANK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STORE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    store_host: str
    store_port: int
    world_size: int
    comm_rank: _containers.ScalarMap[int, int]
    transport: str
    timeout_s: float
    store_token: str
    def __init__(self, epoch: _Optional[int] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., world_size: _Optional[int] = ..., comm_rank: _Optional[_Mapping[int, int]] = ..., transport: _Optional[str] = ..., timeout_s: _Optional[float] = ..., store_token: _Optional[str] = ...) -> None: ...

class TensorHandle(_message.Message):
    __slots__ = ("index", "memory", "staged", "snapshot")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    index: int
    memory: bytes
    staged: bool
    snapshot: bool
    def __init__(self, index: _Optional[int] = ..., memory: _Optional[bytes] = ..., staged: _Optional[bool] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class LoadProgramCommand(_message.Message):
    __slots__ = ("model", "digest", "slot", "program", "handles")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    model: str
    digest: str
    slot: int
    program: bytes
    handles: _containers.RepeatedCompositeFieldContainer[TensorHandle]
    def __init__(self, model: _Optional[str] = ..., digest: _Optional[str] = ..., slot: _Optional[int] = ..., program: _Optional[bytes] = ..., handles: _Optional[_Iterable[_Union[TensorHandle, _Mapping]]] = ...) -> None: ...

class ExecuteCommand(_message.Message):
    __slots__ = ("model", "digest", "slot", "version", "refit_id", "timeout_s", "slots", "verify", "delta", "lane", "share_weight", "share_piece")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    SHARE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SHARE_PIECE_FIELD_NUMBER: _ClassVar[int]
    model: str
    digest: str
    slot: int
    version: int
    refit_id: int
    timeout_s: float
    slots: _containers.RepeatedScalarFieldContainer[int]
    verify: bool
    delta: _containers.RepeatedCompositeFieldContainer[DeltaCommand]
    lane: int
    share_weight: float
    share_piece: int
    def __init__(self, model: _Optional[str] = ..., digest: _Optional[str] = ..., slot: _Optional[int] = ..., version: _Optional[int] = ..., refit_id: _Optional[int] = ..., timeout_s: _Optional[float] = ..., slots: _Optional[_Iterable[int]] = ..., verify: _Optional[bool] = ..., delta: _Optional[_Iterable[_Union[DeltaCommand, _Mapping]]] = ..., lane: _Optional[int] = ..., share_weight: _Optional[float] = ..., share_piece: _Optional[int] = ...) -> None: ...

class DeltaCommand(_message.Message):
    __slots__ = ("slot", "send", "recv", "allowed", "promote", "max_density")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    RECV_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_FIELD_NUMBER: _ClassVar[int]
    MAX_DENSITY_FIELD_NUMBER: _ClassVar[int]
    slot: int
    send: _containers.RepeatedScalarFieldContainer[int]
    recv: _containers.RepeatedScalarFieldContainer[int]
    allowed: _containers.RepeatedScalarFieldContainer[int]
    promote: int
    max_density: float
    def __init__(self, slot: _Optional[int] = ..., send: _Optional[_Iterable[int]] = ..., recv: _Optional[_Iterable[int]] = ..., allowed: _Optional[_Iterable[int]] = ..., promote: _Optional[int] = ..., max_density: _Optional[float] = ...) -> None: ...

class AbortCommand(_message.Message):
    __slots__ = ("refit_id", "reason")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    refit_id: int
    reason: str
    def __init__(self, refit_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ApplyCommand(_message.Message):
    __slots__ = ("model", "digest", "slots", "version", "refit_id", "timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    digest: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    version: int
    refit_id: int
    timeout_s: float
    def __init__(self, model: _Optional[str] = ..., digest: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ..., refit_id: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AgentCommand(_message.Message):
    __slots__ = ("command_id", "connect", "load", "execute", "abort", "apply")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    connect: ConnectCommand
    load: LoadProgramCommand
    execute: ExecuteCommand
    abort: AbortCommand
    apply: ApplyCommand
    def __init__(self, command_id: _Optional[int] = ..., connect: _Optional[_Union[ConnectCommand, _Mapping]] = ..., load: _Optional[_Union[LoadProgramCommand, _Mapping]] = ..., execute: _Optional[_Union[ExecuteCommand, _Mapping]] = ..., abort: _Optional[_Union[AbortCommand, _Mapping]] = ..., apply: _Optional[_Union[ApplyCommand, _Mapping]] = ...) -> None: ...

class AgentReport(_message.Message):
    __slots__ = ("agent_id", "slot", "command_id", "kind", "refit_id", "bytes_sent", "bytes_received", "bytes_local", "seconds", "message", "more", "checksums", "snapshot_bytes", "snapshot_fallback", "delta", "first_landed_ago_s", "first_landed_bytes", "last_landed_ago_s", "loaded_plans")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOCAL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FIRST_LANDED_AGO_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_LANDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_LANDED_AGO_S_FIELD_NUMBER: _ClassVar[int]
    LOADED_PLANS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    slot: int
    command_id: int
    kind: ReportKind
    refit_id: int
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    seconds: float
    message: str
    more: _containers.RepeatedCompositeFieldContainer[AgentReport]
    checksums: _containers.RepeatedCompositeFieldContainer[MessageChecksum]
    snapshot_bytes: int
    snapshot_fallback: str
    delta: DeltaOutcome
    first_landed_ago_s: float
    first_landed_bytes: int
    last_landed_ago_s: float
    loaded_plans: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_id: _Optional[str] = ..., slot: _Optional[int] = ..., command_id: _Optional[int] = ..., kind: _Optional[_Union[ReportKind, str]] = ..., refit_id: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., bytes_local: _Optional[int] = ..., seconds: _Optional[float] = ..., message: _Optional[str] = ..., more: _Optional[_Iterable[_Union[AgentReport, _Mapping]]] = ..., checksums: _Optional[_Iterable[_Union[MessageChecksum, _Mapping]]] = ..., snapshot_bytes: _Optional[int] = ..., snapshot_fallback: _Optional[str] = ..., delta: _Optional[_Union[DeltaOutcome, _Mapping]] = ..., first_landed_ago_s: _Optional[float] = ..., first_landed_bytes: _Optional[int] = ..., last_landed_ago_s: _Optional[float] = ..., loaded_plans: _Optional[_Iterable[str]] = ...) -> None: ...

class DeltaMessageStat(_message.Message):
    __slots__ = ("message_id", "delta", "changed", "elements", "nbytes", "dense_nbytes")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DENSE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    message_id: int
    delta: bool
    changed: int
    elements: int
    nbytes: int
    dense_nbytes: int
    def __init__(self, message_id: _Optional[int] = ..., delta: _Optional[bool] = ..., changed: _Optional[int] = ..., elements: _Optional[int] = ..., nbytes: _Optional[int] = ..., dense_nbytes: _Optional[int] = ...) -> None: ...

class DeltaOutcome(_message.Message):
    __slots__ = ("base_version", "pending_version", "base_bytes", "encode_s", "apply_s", "sent")
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    base_version: int
    pending_version: int
    base_bytes: int
    encode_s: float
    apply_s: float
    sent: _containers.RepeatedCompositeFieldContainer[DeltaMessageStat]
    def __init__(self, base_version: _Optional[int] = ..., pending_version: _Optional[int] = ..., base_bytes: _Optional[int] = ..., encode_s: _Optional[float] = ..., apply_s: _Optional[float] = ..., sent: _Optional[_Iterable[_Union[DeltaMessageStat, _Mapping]]] = ...) -> None: ...

class MessageChecksum(_message.Message):
    __slots__ = ("message_id", "sent", "checksum")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    message_id: int
    sent: bool
    checksum: int
    def __init__(self, message_id: _Optional[int] = ..., sent: _Optional[bool] = ..., checksum: _Optional[int] = ...) -> None: ...

class AgentReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentHeartbeatRequest(_message.Message):
    __slots__ = ("agent_id",)
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    def __init__(self, agent_id: _Optional[str] = ...) -> None: ...

class AgentHeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
