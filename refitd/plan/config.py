"""How to plan: PlanConfig, the knobs that shape a plan (and its digest)."""

from __future__ import annotations

from dataclasses import dataclass, field

from refitd.plan.errors import PlanError
from refitd.plan.links import LinkPolicy
from refitd.plan.names import NameMap
from refitd.plan.wire import WireRegistry, default_wires


@dataclass
class PlanConfig:
    """How to plan. fanout: peers a slot sends to concurrently (lanes of the schedule);
    relay: let destination replicas forward blocks (see the module docstring);
    schedule: "lanes" (rounds from `fanout` lanes per source) or "serial" (rounds from a
    schedule in which each slot moves one message at a time, as NCCL on one stream runs
    them: buckets.serial_rounds); relay_chain: a block held by several destination pools
    goes from the sources to the first of them (in registration order), which forwards it
    to the others, instead of every pool forwarding some blocks to the others (relay.py);
    links: the path of every message (links.py; default: all collective); stamp_pools:
    destination pools of one layout are planned once and stamped (stamp.py) when each
    holds at least stamp_min_specs tensors (below, a plan is quick and a few copies per
    slot balance better over all pools at once)."""

    bucket_bytes: int = 64 << 20
    sender_quantization: bool = False
    allow_dtype_cast: bool = False
    tie_embeddings: bool = True
    name_map: NameMap | None = None
    fanout: int = 4
    relay: bool = False
    relay_chain: bool = False
    stamp_pools: bool = True
    stamp_min_specs: int = 4096
    schedule: str = "lanes"
    wires: WireRegistry = field(default_factory=default_wires)
    links: LinkPolicy = field(default_factory=LinkPolicy)

    def __post_init__(self) -> None:
        if self.schedule not in ("lanes", "serial"):
            raise PlanError(f"unknown schedule {self.schedule!r}; known: lanes, serial")
