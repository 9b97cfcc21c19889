"""The controller process: gRPC (Refit, AgentControl, health, reflection), ops HTTP, the
rendezvous store, the SQLite state and the refit coordinator, started and stopped together.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.security import ServerSecurity
from refitd.server.database import StateDB
from refitd.server.grpc_service import AgentControlService, RefitService, service_handler
from refitd.server.heap import keep_plan_heap
from refitd.server.http import HttpServer
from refitd.server.loop import ServerLoop
from refitd.server.metrics import ControllerMetrics
from refitd.server.readiness import LocalAgent, Readiness
from refitd.server.refit.coordinator import RefitCoordinator
from refitd.server.registry import Registry
from refitd.server.rendezvous import RendezvousStore
from refitd.server.streams import AgentHub, EventHub, GatherBoard

log = logging.getLogger("refitd.controller")

SWITCH_INTERVAL_S = 0.0005
SERVICE_NAMES = tuple(
    pb.DESCRIPTOR.services_by_name[n].full_name for n in ("Refit", "AgentControl")
)


class Controller:
    """One refitd controller. `start()` binds everything; `stop()` releases everything.
    It implements what its front ends need of it (the protocols of server/frontend.py)."""

    def __init__(self, settings: Settings, local_agent: LocalAgent | None = None) -> None:
        """`local_agent`: the node agent this process runs (`refitd serve`), which
        readiness waits for."""
        keep_plan_heap()
        self.settings = settings
        self.security = ServerSecurity.from_settings(settings)
        self.stopping = False
        self.started_monotonic = time.monotonic()
        self.metrics = ControllerMetrics()
        self.db = StateDB(settings.data_dir)
        self.registry = Registry(self.db)
        self.store: RendezvousStore | None = None
        # The gRPC server's loop, and the controller's streams on it: workers' events and
        # agents' commands.
        self.loop = ServerLoop(settings.grpc_workers)
        self.board = GatherBoard()
        self.events = EventHub(self.board, self.loop.soon)
        self.agents = AgentHub(self.board, self.loop.soon)
        # Taken right after the restore: the members it waits for are the restored ones.
        self.ready = Readiness(
            self.registry, self.events, settings.heartbeat_timeout_s, local_agent
        )
        self.refits: RefitCoordinator
        self.grpc_server: grpc.aio.Server | None = None
        self.http: HttpServer | None = None
        self.health = health.aio.HealthServicer()
        self.grpc_port = 0
        self._stopped = threading.Event()

    # --- addresses
    @property
    def grpc_address(self) -> str:
        return f"{self.settings.host}:{self.grpc_port}"

    @property
    def http_address(self) -> str:
        return f"{self.settings.host}:{self.http.port}" if self.http else ""

    @property
    def store_address_str(self) -> str:
        return f"{self.store.host}:{self.store.port}" if self.store else ""

    def start(self) -> Controller:
        s = self.settings
        # Latency over throughput: a refit's critical path hops between gRPC threads, and
        # CPython's default 5 ms GIL switch interval would add up to 5 ms per hop.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        if s.rendezvous:
            self.store = RendezvousStore.start(s.host, s.store_port)
        store_addr = (s.store_host, self.store.port) if self.store else None
        self.refits = RefitCoordinator(
            s,
            self.registry,
            self.db,
            self.metrics,
            store_addr,
            self.board,
            self.events,
            self.agents,
        )
        self.loop.start()
        self.grpc_server = self.loop.run(self._serve_grpc(), timeout_s=30)
        self.http = HttpServer(self, s.host, s.http_port)
        self.http.start()
        self.refresh_gauges()
        log.info(
            "controller: gRPC %s, HTTP %s, store %s, state %s",
            self.grpc_address,
            self.http_address,
            self.store_address_str or "off",
            self.db.path,
        )
        return self

    async def _serve_grpc(self) -> grpc.aio.Server:
        """The gRPC server on the loop: Refit, AgentControl, health and reflection."""
        s = self.settings
        opts = [
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.server.max_pending_requests", s.grpc_max_pending),
            ("grpc.server.max_pending_requests_hard_limit", 2 * s.grpc_max_pending),
        ]
        server = grpc.aio.server(options=opts)
        token = self.security.token
        server.add_generic_rpc_handlers(
            (
                service_handler("Refit", RefitService(self, self.loop), token),
                service_handler("AgentControl", AgentControlService(self, self.loop), token),
            )
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                *SERVICE_NAMES,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.grpc_port = self.security.add_port(server, f"{s.host}:{s.grpc_port}")
        if self.grpc_port == 0:
            raise RuntimeError(f"cannot bind gRPC on {s.host}:{s.grpc_port}")
        await server.start()
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return server

    async def _stop_grpc(self, server: grpc.aio.Server, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await server.stop(grace_s)

    def readiness(self) -> dict[str, bool]:
        """Whether the controller is ready to refit, check by check (refitd.server.readiness)."""
        checks = {
            "grpc": self.grpc_server is not None and not self.stopping,
            "database": self.db.healthy(),
        }
        if self.settings.rendezvous:
            checks["rendezvous"] = self.store is not None and self.store.alive()
        return {**checks, **self.ready.checks()}

    def refresh_gauges(self) -> None:
        pools, slots, agents = self.registry.gauges()
        self.metrics.workers.clear()
        for (model, pool), ranks in pools.items():
            self.metrics.workers.labels(model, pool).set(ranks)
        self.metrics.slots.set(slots)
        self.metrics.agents.set(agents)

    def stop(self, grace_s: float = 2.0) -> None:
        if self.stopping:
            return
        self.stopping = True
        if self.http:
            self.http.stop()
        if self.grpc_server:
            try:
                self.loop.run(self._stop_grpc(self.grpc_server, grace_s), grace_s + 3)
            except Exception:
                log.exception("stopping the gRPC server")
        self.loop.stop()
        if hasattr(self, "refits"):
            self.refits.stop()
        if self.store:
            self.store.stop()
        self.db.close()
        self._stopped.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until stopped (or timeout); True when stopped."""
        return self._stopped.wait(timeout_s)

    def __enter__(self) -> Controller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
