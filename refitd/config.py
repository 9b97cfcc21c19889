"""refitd settings: one pydantic-settings model read from flags, REFITD_* env vars and a file.

Precedence, highest first: command-line flags, REFITD_* environment variables, the TOML
config file (path from --config or REFITD_CONFIG), the defaults documented on each field.
Everything binds to 127.0.0.1 unless told otherwise. The controller, the node agent, the
client CLI and the demo all build their Settings through `load_settings` /
`settings_from_args` so they agree on names and defaults.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from refitd.credentials import resolve_token, store_secret
from refitd.slot_protocol import DEFAULTS as SLOT  # a slot's timeouts and sizes

CONFIG_ENV = "REFITD_CONFIG"
MiB = 1 << 20


def default_data_dir() -> Path:
    """$XDG_STATE_HOME/refitd, else ~/.local/state/refitd: where the SQLite state lives."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "refitd"


class Settings(BaseSettings):
    """Every tunable of the controller, node agent and client, with its default."""

    model_config = SettingsConfigDict(env_prefix="REFITD_", extra="forbid", validate_default=True)

    # --- addresses
    host: str = Field("127.0.0.1", description="address the controller binds (gRPC, HTTP, store)")
    advertise_host: str = Field(
        "", description="address agents use to reach the rendezvous store (default: host)"
    )
    grpc_port: int = Field(50151, ge=0, le=65535, description="controller gRPC port (0: any)")
    http_port: int = Field(50152, ge=0, le=65535, description="ops HTTP port (0: any)")
    store_port: int = Field(0, ge=0, le=65535, description="rendezvous TCPStore port (0: any)")
    controller: str = Field(
        "127.0.0.1:50151", description="HOST:PORT of the controller (agents, clients, CLI)"
    )
    # --- data plane of the node agent (docs/multihost.md)
    data_plane_address: str = Field(
        "",
        description="address this host's transfer processes listen on for peers (default: "
        "the local address of the route to the controller; never hostname resolution)",
    )
    data_plane_interface: str = Field(
        "",
        description="network interface of the data plane (its IPv4 address; Gloo binds it); "
        "takes precedence over data_plane_address and GLOO_SOCKET_IFNAME",
    )
    rdma_protocol: str = Field(
        "tcp",
        description="protocol of the rdma path (Mooncake Transfer Engine, refitd[rdma]): rdma "
        "(one-sided RDMA WRITEs; needs an RDMA device) or tcp (the same writes over TCP)",
    )
    rdma_auto: bool = Field(
        False,
        description="let links=auto take the rdma path between agents that both set it over "
        "TCP (rdma_protocol=tcp); with rdma_protocol=rdma (an RDMA fabric) auto takes it anyway. "
        "Over plain TCP the collective path (Gloo) is usually faster than Mooncake's writes",
    )
    rdma_devices: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="RDMA devices of the rdma path ('mlx5_0,mlx5_1'; default: every device "
        "under /sys/class/infiniband)",
    )
    rdma_landing_bytes: int = Field(
        SLOT.rdma_landing_bytes, ge=0, description="cap on a destination slot's host memory "
        "for landing short-row messages of the rdma path packed (the rest land row by row)",
    )  # fmt: skip
    # --- embedded agent / slots
    cpu_slots: int = Field(2, ge=0, description="CPU device slots of the embedded local agent")
    devices: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="explicit device slots of the local agent ('cpu:0,cuda:0'); "
        "overrides cpu_slots",
    )
    embedded_agent: bool = Field(True, description="`refitd serve` also runs the local agent")
    transport: str = Field("gloo", description="refit communicator backend: gloo or nccl")
    links: str = Field(
        "auto",
        description="path of each link (source slot -> destination slot): auto (mapped "
        "memory between slots of one host, rdma where both agents offer it, else the "
        "communicator), or one of collective, mapped, rdma forced; a link that cannot take a "
        "forced path goes collective and the plan counts it (docs/architecture.md)",
    )
    rendezvous: bool = Field(True, description="host the data-plane rendezvous TCPStore")
    store_token: str = Field(
        "",
        description="key prefix of the rendezvous store (default: derived from auth_token)",
    )
    # --- state
    data_dir: Path = Field(
        default_factory=default_data_dir, description="directory of the SQLite state (WAL)"
    )
    # --- data plane sizing
    bucket_bytes: int = Field(64 * MiB, gt=0, description="largest message of a plan")
    staging_bytes: int = Field(
        SLOT.staging_bytes, gt=0, description="cap on staging buffers per slot"
    )
    snapshot_bytes: int = Field(
        SLOT.snapshot_bytes,
        ge=0,
        description="cap on the snapshot of a slot's sources (pools registered with snapshot); "
        "above it the slot reads live trainer memory and the refit's record says so",
    )
    sender_quantization: bool = Field(
        False,
        description="quantize on the sender for quantized storage (the storage's own format "
        "on the wire)",
    )
    relay: bool = Field(
        True, description="destination replicas forward blocks they received (fewer source sends)"
    )
    plan_ahead: bool = Field(
        True,
        description="build a model's next plan and slot programs once its pools are all "
        "registered and live, while no refit is pending (the refit then finds them ready)",
    )
    plan_process: bool = Field(
        True,
        description="build refit plans and their slot programs in a forked planning "
        "process, off the controller's interpreter lock (false: in the controller's process)",
    )
    plan_timeout_s: float = Field(
        120.0,
        gt=0,
        description="how long a planning process may take before it is killed; the plan is "
        "then built in the controller's process",
    )
    relay_chain: bool = Field(
        False,
        description="with relays and several destination pools: the first pool receives "
        "every block from the sources and forwards it to the others (one flow per link), "
        "instead of each pool forwarding some (docs/multihost.md)",
    )
    plan_schedule: str = Field(
        "auto",
        description="rounds of a plan: lanes (each source sends to 4 peers at once), serial "
        "(each slot moves one message at a time), or auto: serial without relays for nccl, "
        "lanes (relays as set) for gloo (docs/simulate.md)",
    )
    allow_dtype_cast: bool = Field(
        False,
        description="let a destination hold another float dtype than its source (BF16, FP16, "
        "FP32, FP64): values land cast, rounded to nearest even; off: a mismatch fails the plan",
    )
    # --- timeouts (seconds), one per refit phase
    barrier_timeout_s: float = Field(60.0, gt=0, description="all trainer ranks ask for v")
    connect_timeout_s: float = Field(
        SLOT.connect_timeout_s, gt=0, description="communicator (re)connect"
    )
    load_timeout_s: float = Field(SLOT.load_timeout_s, gt=0, description="slot programs loaded")
    pause_timeout_s: float = Field(30.0, gt=0, description="destination workers ack PAUSE")
    transfer_timeout_s: float = Field(
        SLOT.transfer_timeout_s, gt=0, description="every slot reports DONE"
    )
    commit_timeout_s: float = Field(30.0, gt=0, description="destination workers ack COMMIT")
    refit_wait_timeout_s: float = Field(600.0, gt=0, description="default Refit RPC wait")
    rpc_timeout_s: float = Field(
        SLOT.rpc_timeout_s, gt=0, description="client-side unary RPC deadline"
    )
    # --- refit policy (version safety)
    early_pause: bool = Field(
        True,
        description="pause destination pools when the first trainer rank asks (overlaps the "
        "PAUSE handshake with the barrier; weights are untouched until all ranks asked)",
    )
    refit_retries: int = Field(
        2, ge=0, description="retries of a refit that failed after writing (pool stays paused)"
    )
    refit_retry_budget_s: float = Field(
        30.0, ge=0, description="time after a failed attempt within which retries may start"
    )
    verify_checksums: bool = Field(
        False,
        description="verify landed versions: per-message checksums of sources and of what "
        "landed, compared by the controller (a mismatch fails the attempt)",
    )
    model_weights: str = Field(
        "",
        description="each model's share of a link while refits of several models cross it "
        'at once, as name=weight pairs ("policy=3,critic=1"); unnamed models weigh 1',
    )
    pool_every: str = Field(
        "",
        description="destination pools refit on their own cadence, as model/pool=k pairs "
        '("dsv3/draft=4"): such a pool takes part in a version only when it holds none yet '
        "or k versions passed since the one it holds; it keeps serving that one otherwise",
    )
    delta_refits: bool = Field(
        False,
        description="send only the elements that changed since the last committed version "
        "where every destination provably holds it (docs/delta.md); others go dense",
    )
    delta_max_density: float = Field(
        0.4, ge=0, le=1, description="a refit or message with more changed elements goes dense"
    )
    delta_probe_every: int = Field(
        8, ge=1, description="after a refit went dense by density, measure again this often"
    )
    delta_speed_rule: bool = Field(
        True,
        description="go dense while the last delta refit took longer than the last dense one "
        "(a link faster than the codec); measured again every delta_probe_every refits",
    )
    # --- liveness
    heartbeat_interval_s: float = Field(
        2.5,
        gt=0,
        description="worker/agent heartbeat period (handed out at most a third of the lease: "
        "heartbeat_period_s); 1,024 ranks at 1 s were 1,000 calls a second",
    )
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="lease: dead after this silence")
    # --- controller internals
    grpc_workers: int = Field(
        8192,
        ge=8,
        description="threads for the controller's calls that block (registrations, status, "
        "SQLite), started on demand; streams and the refit's calls run on the server's event "
        "loop and hold none",
    )
    grpc_max_pending: int = Field(
        16384,
        ge=64,
        description="calls the gRPC core holds while no handler has picked them up yet; above "
        "it new calls are refused (CANCELLED), from twice it all of them: 1,024 ranks "
        "heartbeating once a second through a registration burst queue thousands",
    )
    max_message_bytes: int = Field(256 * MiB, gt=0, description="gRPC max message size")
    plan_cache_size: int = Field(16, ge=1, description="plans kept (LRU, keyed by digest)")
    history_size: int = Field(50, ge=1, description="last refits shown in status")
    log_level: str = Field("info", description="debug, info, warning, error")
    # --- security (docs/security.md)
    tls_cert: str = Field(
        "", description="PEM certificate of the controller (gRPC and HTTP serve TLS when set)"
    )
    tls_key: str = Field("", description="PEM private key of tls_cert")
    tls_ca: str = Field(
        "",
        description="PEM CA bundle: clients verify the controller with it; with "
        "require_client_cert the controller verifies client certificates with it",
    )
    require_client_cert: bool = Field(
        False, description="mutual TLS: refuse clients without a certificate signed by tls_ca"
    )
    tls_client_cert: str = Field(
        "", description="PEM client certificate agents, workers and the CLI present (mTLS)"
    )
    tls_client_key: str = Field("", description="PEM private key of tls_client_cert")
    tls_server_name: str = Field(
        "", description="name clients expect in the controller's certificate (default: host)"
    )
    auth_token: str = Field(
        "", description="bearer token required for mutating RPCs and the status page"
    )
    auth_token_file: str = Field(
        "", description="file holding the bearer token (used when auth_token is empty)"
    )

    @field_validator("devices", "rdma_devices", mode="before")
    @classmethod
    def _split_devices(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [d.strip() for d in v.split(",") if d.strip()]
        return v

    @field_validator("transport")
    @classmethod
    def _known_transport(cls, v: str) -> str:
        if v not in ("gloo", "nccl"):
            raise ValueError(f"transport must be gloo or nccl, got {v!r}")
        return v

    @field_validator("links")
    @classmethod
    def _known_links(cls, v: str) -> str:
        if v not in ("auto", "collective", "mapped", "rdma"):
            raise ValueError(f"links must be auto, collective, mapped or rdma, got {v!r}")
        return v

    @field_validator("rdma_protocol")
    @classmethod
    def _known_rdma_protocol(cls, v: str) -> str:
        if v not in ("tcp", "rdma"):
            raise ValueError(f"rdma_protocol must be tcp or rdma, got {v!r}")
        return v

    @field_validator("model_weights", "pool_every")
    @classmethod
    def _check_pairs(cls, v: str, info: ValidationInfo) -> str:
        (parse_model_weights if info.field_name == "model_weights" else parse_pool_every)(v)
        return v

    def model_weight(self, model: str) -> float:
        """The model's weight on shared links (model_weights; 1 when not named)."""
        return parse_model_weights(self.model_weights).get(model, 1.0)

    def pool_cadence(self, model: str, pool: str) -> int:
        """Every how many versions the model's pool takes part (pool_every; 1 when not named)."""
        return parse_pool_every(self.pool_every).get((model, pool), 1)

    @field_validator("plan_schedule")
    @classmethod
    def _known_schedule(cls, v: str) -> str:
        if v not in ("auto", "lanes", "serial"):
            raise ValueError(f"plan_schedule must be auto, lanes or serial, got {v!r}")
        return v

    @model_validator(mode="after")
    def _check_security(self) -> Settings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ValueError("tls_client_cert and tls_client_key must be given together")
        if self.require_client_cert and not (self.tls_cert and self.tls_ca):
            raise ValueError("require_client_cert needs tls_cert, tls_key and tls_ca")
        if not self.store_token:
            # Rendezvous keys unguessable without the bearer token (docs/security.md).
            token = resolve_token(self.auth_token, self.auth_token_file)
            self.store_token = store_secret(token)
        return self

    @property
    def heartbeat_period_s(self) -> float:
        """The heartbeat period handed to workers and agents: the setting, at most a third
        of the lease, so a lease always spans several beats."""
        return min(self.heartbeat_interval_s, self.heartbeat_timeout_s / 3)

    @property
    def store_host(self) -> str:
        """Address agents dial for the rendezvous store."""
        return self.advertise_host or self.host

    def local_devices(self) -> list[str]:
        """Device slots of the embedded agent: `devices`, else cpu:0..cpu_slots-1."""
        return list(self.devices) or [f"cpu:{i}" for i in range(self.cpu_slots)]


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Settings from overrides (flags) > REFITD_* env > TOML file > defaults.

    The file is `config_file`, else $REFITD_CONFIG, else none. A missing file named
    explicitly is an error (a typo must not silently fall back to defaults).
    """
    path = config_file or os.environ.get(CONFIG_ENV) or None
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")

    class _Sourced(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
            if path is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(path)))
            return tuple(sources)

    sourced = _Sourced(**overrides)
    return Settings.model_construct(**sourced.model_dump())


def parse_model_weights(text: str) -> dict[str, float]:
    """ "a=3,b=1" -> {"a": 3.0, "b": 1.0}; a malformed pair or a weight <= 0 is refused."""
    out: dict[str, float] = {}
    for pair in (p.strip() for p in text.split(",")):
        if not pair:
            continue
        name, sep, value = pair.rpartition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = 0.0
        if not sep or not name.strip() or not weight > 0:
            raise ValueError(f"model_weights: {pair!r} is not name=weight with a weight > 0")
        out[name.strip()] = weight
    return out


def parse_pool_every(text: str) -> dict[tuple[str, str], int]:
    """ "m/draft=4" -> {("m", "draft"): 4}; a malformed pair or k < 1 is refused."""
    out: dict[tuple[str, str], int] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        where, _, value = pair.rpartition("=")
        model, _, pool = where.strip().rpartition("/")
        if not (model and pool and value.strip().isdigit() and int(value) >= 1):
            raise ValueError(f"pool_every: {pair!r} is not model/pool=k with a whole k >= 1")
        out[(model, pool)] = int(value)
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_settings_arguments(
    parser: argparse.ArgumentParser, fields: list[str] | None = None
) -> None:
    """Add --config and one flag per Settings field (or per name in `fields`).

    Flags default to None (not given) so env and file values are not masked.
    """
    if not any("--config" in a.option_strings for a in parser._actions):
        parser.add_argument("--config", default=None, help=f"TOML config file (or ${CONFIG_ENV})")
    for name, info in Settings.model_fields.items():
        if fields is not None and name not in fields:
            continue
        help_ = f"{info.description} (env REFITD_{name.upper()})"
        if info.annotation is bool:
            parser.add_argument(
                _flag(name),
                dest=name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_,
            )
        else:
            parser.add_argument(_flag(name), dest=name, default=None, help=help_)


def settings_from_args(args: argparse.Namespace, **extra: Any) -> Settings:
    """Settings from parsed flags (those given), env, the config file and defaults."""
    overrides = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if getattr(args, name, None) is not None
    }
    overrides.update(extra)
    return load_settings(getattr(args, "config", None), **overrides)
