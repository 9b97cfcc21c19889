"""The planner's config as the controller gives it: `PlanOptions` (from Settings) and the
links' sites (each slot's host, device kind and offered paths, from the registry), made
into one `PlanConfig` (`planner_config`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refitd.plan.layout import TensorSpec
from refitd.plan.links import LinkPolicy, SlotSite
from refitd.plan.planner import PlanConfig
from refitd.plan.table import SpecTable

Site = tuple[int, str, str, tuple[str, ...]]  # (slot, host, device kind, paths offered)


@dataclass(frozen=True)
class PlanOptions:
    """The plan configuration the controller passes on (from Settings). schedule "auto"
    resolves by transport (`planner_schedule`); links: the links policy (the slots' sites
    come with each plan: `make_plan`)."""

    bucket_bytes: int
    sender_quantization: bool = False
    relay: bool = True
    relay_chain: bool = False
    allow_dtype_cast: bool = False
    schedule: str = "auto"
    transport: str = "gloo"
    links: str = "collective"


def planner_schedule(schedule: str, transport: str, relay: bool) -> tuple[str, bool]:
    """(PlanConfig.schedule, PlanConfig.relay) for the plan_schedule setting. "auto": under
    NCCL a slot moves one chunk at a time, so serial rounds without relays (1.13x the bound
    against 3.42x for lanes with relays, docs/simulate.md); Gloo posts every chunk at once
    and keeps lanes with relays as set."""
    if schedule != "auto":
        return schedule, relay
    return ("serial", False) if transport == "nccl" else ("lanes", relay)


def table_slots(
    sources: Sequence[TensorSpec] | SpecTable, destinations: Sequence[TensorSpec] | SpecTable
) -> list[int]:
    """Every slot holding a tensor of the two sides (whose sites a plan's links need)."""
    slots: set[int] = set()
    for side in (sources, destinations):
        if isinstance(side, SpecTable):
            slots.update(np.unique(side.columns()[2]).tolist())
        else:
            slots.update(s.slot for s in side)
    return sorted(slots)


def planner_config(options: PlanOptions, sites: Sequence[Site] = ()) -> PlanConfig:
    """The planner's config of these options, with the links of `sites` (the slots' hosts,
    device kinds and offered paths)."""
    schedule, relay = planner_schedule(options.schedule, options.transport, options.relay)
    links = LinkPolicy.of(options.links, [SlotSite(*s) for s in sites])
    return PlanConfig(
        bucket_bytes=options.bucket_bytes,
        sender_quantization=options.sender_quantization,
        relay=relay,
        relay_chain=options.relay_chain,
        allow_dtype_cast=options.allow_dtype_cast,
        schedule=schedule,
        links=links,
    )
