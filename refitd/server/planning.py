"""The controller's view of a plan, the one adapter to refitd.plan.planner, and the plan cache.

The controller needs from a plan only: its digest, the SlotProgram of every slot (shipped
to agents), the bytes it moves, and which slots read each source rank's tensors (so a
trainer rank's Refit can return once its weights have been read). `make_plan` and
`make_digest` are the only places that call the planner.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from refitd.plan.layout import TensorSpec
from refitd.plan.program import SlotProgram
from refitd.server.errors import precondition


@dataclass(frozen=True)
class PlanOptions:
    """The plan configuration the controller passes on (from Settings)."""

    bucket_bytes: int
    wire: str = "raw"


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


def _planner_config(options: PlanOptions) -> object:
    from refitd.plan.planner import PlanConfig

    return PlanConfig(bucket_bytes=options.bucket_bytes, wire=options.wire)


def planner_available() -> bool:
    try:
        import refitd.plan.planner  # noqa: F401
    except ImportError:
        return False
    return True


def make_digest(
    model: str,
    epoch: int,
    sources: list[TensorSpec],
    destinations: list[TensorSpec],
    options: PlanOptions,
) -> str:
    """Plan digest of (model, epoch, layouts, config): the plan cache key."""
    if planner_available():
        from refitd.plan.planner import plan_digest

        return plan_digest(model, epoch, sources, destinations, _planner_config(options))
    h = hashlib.sha256(repr((model, epoch, sources, destinations, options)).encode())
    return "interim-" + h.hexdigest()[:32]


def make_plan(
    model: str,
    epoch: int,
    sources: list[TensorSpec],
    destinations: list[TensorSpec],
    options: PlanOptions,
) -> ControllerPlan:
    """Build the plan through refitd.plan.planner; PlanError -> FAILED_PRECONDITION."""
    digest = make_digest(model, epoch, sources, destinations, options)
    if not planner_available():
        # TODO(planner): refitd.plan.planner has not landed; until it does every slot of the
        # membership gets an empty program so the control plane can run. Remove then.
        return _interim_plan(digest, sources, destinations)
    from refitd.plan.errors import PlanError
    from refitd.plan.planner import build_plan

    try:
        plan = build_plan(model, epoch, sources, destinations, _planner_config(options))
    except PlanError as e:
        raise precondition(f"plan of model {model!r} epoch {epoch}: {e}") from e
    programs = _programs_of(plan)
    return ControllerPlan(
        digest=digest,
        programs=programs,
        total_bytes=sum(m.nbytes for p in programs.values() for m in p.sends)
        + sum(_local_bytes(p) for p in programs.values()),
        readers=_readers(programs),
    )


def _programs_of(plan: object) -> dict[int, SlotProgram]:
    progs = getattr(plan, "programs", None)
    if callable(progs):
        progs = progs()
    if isinstance(progs, dict):
        return dict(progs)
    return {p.slot: p for p in progs}  # type: ignore[union-attr]


def _local_bytes(p: SlotProgram) -> int:
    from refitd.plan.program import message_nbytes

    return message_nbytes(p.local, p.tensors) if p.local else 0


def _readers(programs: dict[int, SlotProgram]) -> dict[tuple[str, int], frozenset[int]]:
    """(source pool, rank) -> the slots whose sends or local copies read that rank."""
    out: dict[tuple[str, int], set[int]] = {}
    for slot, p in programs.items():
        used = {c.src_tensor for m in p.sends for c in m.copies} | {c.src_tensor for c in p.local}
        for i in used:
            spec = p.tensors[i]
            out.setdefault((spec.pool, spec.rank), set()).add(slot)
    return {k: frozenset(v) for k, v in out.items()}


def _interim_plan(
    digest: str, sources: list[TensorSpec], destinations: list[TensorSpec]
) -> ControllerPlan:
    slots = sorted({s.slot for s in sources} | {s.slot for s in destinations})
    programs = {s: SlotProgram(digest, s, {}, (), (), ()) for s in slots}
    readers: dict[tuple[str, int], set[int]] = {}
    for s in sources:
        readers.setdefault((s.pool, s.rank), set()).add(s.slot)
    return ControllerPlan(digest, programs, 0, {k: frozenset(v) for k, v in readers.items()})


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
