"""Prometheus metrics of one controller, on a registry the controller owns (not the global)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1)


class ControllerMetrics:
    """Refit counters and histograms, membership gauges, per-slot throughput."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.refits_started = Counter(
            "refitd_refits_started", "Refits started", ["model"], registry=r
        )
        self.refits_committed = Counter(
            "refitd_refits_committed", "Refits committed", ["model"], registry=r
        )
        self.refits_failed = Counter("refitd_refits_failed", "Refits failed", ["model"], registry=r)
        self.refits_superseded = Counter(
            "refitd_refits_superseded",
            "Refit versions coalesced into newer",
            ["model"],
            registry=r,
        )
        self.refit_bytes = Counter(
            "refitd_refit_bytes", "Bytes moved by committed refits", ["model"], registry=r
        )
        self.refit_duration = Histogram(
            "refitd_refit_duration_seconds",
            "Refit duration, barrier complete to committed",
            ["model"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.control_overhead = Histogram(
            "refitd_control_overhead_seconds",
            "Controller time outside the transfer (start: barrier to last execute sent; "
            "end: last done to committed)",
            ["model", "part"],
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.plans_built = Counter(
            "refitd_plans_built",
            "Plans built for refits and catch-ups (kind: refit; ahead: for the next refit before "
            "it asked; catch_up); a restart that keeps every layout reuses the cached plan and "
            "builds none",
            ["model", "kind"],
            registry=r,
        )
        self.programs_sent = Counter(
            "refitd_programs_sent",
            "LoadProgramCommands sent to slots (a slot whose plan and worker registrations "
            "did not change keeps its program)",
            ["model"],
            registry=r,
        )
        self.workers = Gauge(
            "refitd_registered_workers", "Registered workers", ["model", "pool"], registry=r
        )
        self.slots = Gauge("refitd_registered_slots", "Registered device slots", registry=r)
        self.agents = Gauge("refitd_connected_agents", "Agents with an open stream", registry=r)
        self.slot_bytes = Counter(
            "refitd_slot_bytes", "Bytes sent+received+copied by a slot", ["slot"], registry=r
        )
        self.slot_throughput = Gauge(
            "refitd_slot_throughput_bytes_per_second",
            "Throughput of a slot in its last refit",
            ["slot"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
