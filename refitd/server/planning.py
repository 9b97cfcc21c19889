"""The controller's view of a plan, the adapter to refitd.plan.planner, and the plan cache.

The controller needs from a plan only: its digest, the SlotProgram of every slot (shipped
to agents), the bytes it moves, and which slots read each source rank's tensors (so a
trainer rank's Refit can return once its weights have been read). `make_plan` and
`make_digest` are the only places that call the planner.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from refitd.plan.errors import PlanError
from refitd.plan.layout import TensorSpec
from refitd.plan.planner import PlanConfig, build_plan, plan_digest
from refitd.plan.program import SlotProgram
from refitd.server.errors import precondition


@dataclass(frozen=True)
class PlanOptions:
    """The plan configuration the controller passes on (from Settings)."""

    bucket_bytes: int
    sender_quantization: bool = False
    relay: bool = True


@dataclass
class ControllerPlan:
    """A built plan as the controller uses it."""

    digest: str
    programs: dict[int, SlotProgram]
    total_bytes: int
    readers: dict[tuple[str, int], frozenset[int]]  # (source pool, rank) -> slots reading it
    encoded: dict[int, bytes] = field(default_factory=dict)  # slot -> program bytes, memoized

    @property
    def slots(self) -> list[int]:
        return sorted(self.programs)

    def program_bytes(self, slot: int) -> bytes:
        data = self.encoded.get(slot)
        if data is None:
            data = self.encoded[slot] = self.programs[slot].to_bytes()
        return data


def _planner_config(options: PlanOptions) -> PlanConfig:
    return PlanConfig(
        bucket_bytes=options.bucket_bytes,
        sender_quantization=options.sender_quantization,
        relay=options.relay,
    )


def make_digest(
    model: str,
    epoch: int,
    sources: list[TensorSpec],
    destinations: list[TensorSpec],
    options: PlanOptions,
) -> str:
    """Plan digest of (model, epoch, layouts, config): the plan cache key."""
    return plan_digest(model, epoch, sources, destinations, _planner_config(options))


def make_plan(
    model: str,
    epoch: int,
    sources: list[TensorSpec],
    destinations: list[TensorSpec],
    options: PlanOptions,
) -> ControllerPlan:
    """Build the plan through refitd.plan.planner; PlanError -> FAILED_PRECONDITION."""
    try:
        plan = build_plan(model, epoch, sources, destinations, _planner_config(options))
    except PlanError as e:
        raise precondition(f"plan of model {model!r} epoch {epoch}: {e}") from e
    programs = {slot: plan.program(slot) for slot in plan.slots()}
    ranks = {(t.pool, t.rank) for t in sources}
    return ControllerPlan(
        digest=plan.digest,
        programs=programs,
        total_bytes=plan.stats.total_bytes,
        readers={(pool, rank): frozenset(plan.source_slots_of(pool, rank)) for pool, rank in ranks},
    )


class PlanCache:
    """Plans by digest, least recently used evicted beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[str, ControllerPlan] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, digest: str) -> ControllerPlan | None:
        with self._lock:
            plan = self._plans.get(digest)
            if plan is None:
                self.misses += 1
                return None
            self._plans.move_to_end(digest)
            self.hits += 1
            return plan

    def put(self, plan: ControllerPlan) -> None:
        with self._lock:
            self._plans[plan.digest] = plan
            self._plans.move_to_end(plan.digest)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)
