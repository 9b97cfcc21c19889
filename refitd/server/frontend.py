"""What the controller's front ends need of it: one `typing.Protocol` per front end, which
`Controller` implements. The gRPC services, ops HTTP, the status document and explain
depend on these, never on the Controller class, so controller.py imports them and none of
them imports it back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from refitd.config import Settings
    from refitd.security import ServerSecurity
    from refitd.server.database import StateDB
    from refitd.server.metrics import ControllerMetrics
    from refitd.server.readiness import Readiness
    from refitd.server.refit.coordinator import RefitCoordinator
    from refitd.server.registry import Registry
    from refitd.server.streams import AgentHub, EventHub


@runtime_checkable
class PlanSource(Protocol):
    """What explain reads: the registrations and the plan cache."""

    @property
    def registry(self) -> Registry: ...

    @property
    def refits(self) -> RefitCoordinator: ...


@runtime_checkable
class StatusSource(PlanSource, Protocol):
    """What the status document reads: members, streams, refits, versions and addresses."""

    @property
    def settings(self) -> Settings: ...

    @property
    def events(self) -> EventHub: ...

    @property
    def agents(self) -> AgentHub: ...

    @property
    def db(self) -> StateDB: ...

    @property
    def grpc_address(self) -> str: ...

    @property
    def http_address(self) -> str: ...

    @property
    def store_address_str(self) -> str: ...

    @property
    def started_monotonic(self) -> float: ...


@runtime_checkable
class ServiceBackend(StatusSource, Protocol):
    """What the gRPC services (Refit, AgentControl) call: the status, and the gauges after
    a membership change."""

    def refresh_gauges(self) -> None: ...


@runtime_checkable
class OpsBackend(StatusSource, Protocol):
    """What ops HTTP serves: the status, readiness, metrics, and the security settings."""

    @property
    def security(self) -> ServerSecurity: ...

    @property
    def metrics(self) -> ControllerMetrics: ...

    @property
    def ready(self) -> Readiness: ...

    def readiness(self) -> dict[str, bool]: ...

    def refresh_gauges(self) -> None: ...
