"""The controller's view of a plan, the adapter to refitd.plan.planner, and the plan cache.

The controller needs from a plan only: its digest, its slots, the program of a slot when
that slot's LoadProgramCommand is sent, the bytes it moves, and which slots read each
source rank's tensors (so a trainer rank's Refit can return once its weights have been
read). Registrations reach the planner as SpecTables kept per model (`ModelTables`, updated
as workers register), so a plan starts from ready integer columns. A refit's plan is built
with every slot's program by a planning process (`process`: plan_process.py), so the
planner never holds this process's interpreter lock; other plans (twin catch-ups, explain)
are built here, a slot's program only when it is first needed
(`ControllerPlan.load_payload`). This module is the only place that calls the planner.
Builds here run inside the caller's GcPause when one is given (the coordinator owns one per
controller): the cyclic garbage collector stays off while any of them runs, in any thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from refitd.plan.errors import PlanError
from refitd.plan.gc_pause import GcPause
from refitd.plan.layout import TensorSpec
from refitd.plan.planner import Plan, PlanConfig, PlanStats, build_plan_from_table, plan_digest
from refitd.plan.program import SlotProgram, decode_program, encode_program
from refitd.plan.table import JoinedSpecs, SpecTable
from refitd.plan.twins import build_twin_plan, pair_twins
from refitd.server.errors import ControlError, precondition
from refitd.server.heap import release_free_heap
from refitd.server.plan_options import PlanOptions, Site, planner_config
from refitd.server.plan_process import ForkedPlan, PlanningProcess, WorkerKey

# What a loaded slot program's handles came from: per worker holding tensors on the slot,
# the identity of its registration (its memory handles change only with it), and the
# staged and snapshot pools among them.
SlotInputs = tuple[tuple[tuple[WorkerKey, str], ...], frozenset[str], frozenset[str]]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadPayload:
    """What a LoadProgramCommand carries for one slot: the serialized SlotProgram and the
    plan indices of the tensors whose memory handles go with it (ControllerPlan.held).
    From a planning process, both are slices of its shared result."""

    program: bytes | memoryview
    tensors: np.ndarray  # plan index of every tensor held on the slot (its handle goes along)


@dataclass
class ControllerPlan:
    """A built plan as the controller uses it. Planned in this process, slot programs are
    built on demand, once; from a planning process (plan_process.py) they arrive built, and
    the planner's Plan object is built again here only for its rare users (`plan`)."""

    digest: str
    model: str
    slots: list[int]
    stats: PlanStats
    tensors: Sequence[TensorSpec]  # plan index -> spec
    gc_pause: GcPause | None = None  # the owner's pause, held while a program is built
    kind: str = "general"  # "twin": built by plan/twins.py (a catch-up of same-layout ranks)
    _plan: Plan | None = None
    _rebuild: Callable[[], Plan] | None = None  # the same plan, built in this process
    _payloads: dict[int, LoadPayload] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _build_lock: threading.Lock = field(default_factory=threading.Lock)
    _holders: dict[int, tuple[WorkerKey, ...]] | None = None
    _readers: dict[WorkerKey, list[int]] | None = None
    _traffic: tuple[dict[int, int], dict[int, int]] | None = None
    _links: dict[str, object] | None = None
    timings: dict[str, float] = field(default_factory=dict)  # a planning process's own

    @classmethod
    def of(cls, plan: Plan, gc_pause: GcPause | None, kind: str = "general") -> ControllerPlan:
        """A plan built in this process."""
        return cls(
            plan.digest, plan.model, plan.slots(), plan.stats, plan.tensors, gc_pause, kind, plan
        )

    @classmethod
    def forked(
        cls,
        fp: ForkedPlan,
        model: str,
        tensors: Sequence[TensorSpec],
        rebuild: Callable[[], Plan],
        gc_pause: GcPause | None,
    ) -> ControllerPlan:
        """A plan and every program built by a planning process (`fp`)."""
        cp = cls(fp.digest, model, fp.slots, fp.stats, tensors, gc_pause, _rebuild=rebuild)
        cp._payloads = {
            s: LoadPayload(fp.program(i), fp.tensor_index(i)) for i, s in enumerate(fp.slots)
        }
        cp._holders, cp._readers = fp.holders, fp.readers
        cp._traffic, cp.timings = (fp.send_bytes, fp.recv_bytes), fp.timings
        cp._links = fp.links
        return cp

    @property
    def links(self) -> dict[str, object]:
        """Messages and bytes per path, local copies, fallbacks (Plan.link_summary)."""
        if self._links is None:
            self._links = self.plan.link_summary()
        return self._links

    @property
    def total_bytes(self) -> int:
        return self.stats.total_bytes

    @property
    def plan(self) -> Plan:
        """The planner's Plan (explain, delta plans). Planned in a planning process, it is
        built again here on first use: the same inputs, so the same plan."""
        with self._build_lock:
            if self._plan is None:
                assert self._rebuild is not None
                with self.gc_pause or contextlib.nullcontext():
                    self._plan = self._rebuild()
            return self._plan

    def readers(self, pool: str, rank: int) -> frozenset[int]:
        """Slots reading source worker (pool, rank): computed for all on the first call
        (a catch-up plan never asks)."""
        if self._readers is not None:
            return frozenset(self._readers.get((pool, rank), ()))
        with self.gc_pause or contextlib.nullcontext():
            return frozenset(self.plan.source_slots_of(pool, rank))

    def holders(self, slot: int) -> tuple[WorkerKey, ...]:
        """(pool, rank) of the workers holding tensors of the plan on `slot`: the workers
        whose memory handles its LoadProgramCommand carries. Computed once per plan."""
        with self._lock:
            if self._holders is None:
                self._holders = self.plan.holders()
            return self._holders.get(slot, ())

    def traffic(self) -> tuple[dict[int, int], dict[int, int]]:
        """(remote bytes each slot sends, remote bytes each slot receives)."""
        if self._traffic is None:
            self._traffic = (self.plan.send_bytes(), self.plan.recv_bytes())
        return self._traffic

    def load_payload(self, slot: int) -> LoadPayload:
        """The slot's program, built and serialized on the first call (memoized: a slot is
        loaded again when its agent restarts). Thread-safe."""
        with self._lock:
            payload = self._payloads.get(slot)
        if payload is not None:
            return payload
        with self.gc_pause or contextlib.nullcontext():
            payload = self._payload(self.plan.program(slot))
        with self._lock:
            fresh = slot not in self._payloads
            payload = self._payloads.setdefault(slot, payload)
            last = fresh and len(self._payloads) == len(self.slots)
        if last:
            # every program is encoded: the index only serves rare paths now (a checksum
            # mismatch report, a delta plan, explain), which rebuild it
            self.plan.release_index()
            release_free_heap()
        return payload

    def _payload(self, prog: SlotProgram) -> LoadPayload:
        """Encoded program and the plan indices of its tensors (those held on its slot:
        the only ones whose memory the slot maps)."""
        return LoadPayload(encode_program(prog), prog.table.index.astype(np.int64))

    def held(self, payload: LoadPayload) -> Iterator[tuple[int, TensorSpec]]:
        """(plan index, spec) of every tensor a slot's load carries a handle for."""
        tensors = self.tensors
        return ((i, tensors[i]) for i in payload.tensors.tolist())

    def program_bytes(self, slot: int) -> bytes:
        return bytes(self.load_payload(slot).program)

    def program(self, slot: int) -> SlotProgram:
        """The slot's program, decoded from the bytes it is loaded with."""
        return decode_program(self.program_bytes(slot), slot)

    @property
    def built_programs(self) -> int:
        with self._lock:
            return len(self._payloads)


def slot_inputs(
    plan: ControllerPlan,
    slot: int,
    identity: Callable[[WorkerKey], str],
    staged: frozenset[str],
    snapshot: frozenset[str],
) -> SlotInputs:
    """What slot's LoadProgramCommand depends on beyond the plan digest: the registration
    identity (`identity`, e.g. worker id and registration time) of every worker holding
    its tensors, and which of their pools are staged or snapshot."""
    holders = plan.holders(slot)
    pools = {pool for pool, _ in holders}
    return (
        tuple((k, identity(k)) for k in holders),
        staged & pools,
        snapshot & pools,
    )


def stale_slots(
    plan: ControllerPlan,
    loaded: Callable[[int], SlotInputs | None],
    identity: Callable[[WorkerKey], str],
    staged: frozenset[str] = frozenset(),
    snapshot: frozenset[str] = frozenset(),
) -> dict[int, SlotInputs]:
    """Slots of `plan` whose program must be (re)sent, with their current inputs: those
    that never loaded this digest (`loaded(slot)` is None) or loaded it with other inputs
    (a worker on the slot registered again: new memory handles). The others keep theirs."""
    out: dict[int, SlotInputs] = {}
    for slot in plan.slots:
        now = slot_inputs(plan, slot, identity, staged, snapshot)
        if loaded(slot) != now:
            out[slot] = now
    return out


def _table(specs: Sequence[TensorSpec] | SpecTable) -> SpecTable:
    return specs if isinstance(specs, SpecTable) else SpecTable.from_specs(specs)


def make_digest(
    model: str,
    sources: Sequence[TensorSpec] | SpecTable,
    destinations: Sequence[TensorSpec] | SpecTable,
    options: PlanOptions,
    sites: Sequence[Site] = (),
) -> str:
    """Plan digest of (model, layouts, config with the links of `sites`), the plan cache
    key: the layout identity. A restart that re-registers the same layouts (new memory
    handles, new epoch) on the same slots with the same offers hits it."""
    return plan_digest(model, sources, destinations, planner_config(options, sites))


def make_plan(
    model: str,
    epoch: int,
    sources: Sequence[TensorSpec] | SpecTable,
    destinations: Sequence[TensorSpec] | SpecTable,
    options: PlanOptions,
    gc_pause: GcPause | None = None,
    digest: str | None = None,
    process: PlanningProcess | None = None,
    sites: Sequence[Site] = (),
) -> ControllerPlan:
    """Build the plan through refitd.plan.planner; PlanError -> FAILED_PRECONDITION.
    In this process, no slot program is built here (see ControllerPlan.load_payload) and
    the plan keeps `gc_pause` for them; with `process`, a planning process builds the plan
    and every program (plan_process.py). `digest`: make_digest of the same inputs, when
    the caller has it; `sites`: the slots' hosts, device kinds and offered paths (the
    links' paths)."""
    src, dst = _table(sources), _table(destinations)
    what = f"plan of model {model!r} epoch {epoch}"
    if process is None:
        return _controller_plan(
            lambda c: build_plan_from_table(model, epoch, src, dst, c, digest),
            what,
            options,
            gc_pause,
            "general",
            sites,
        )
    config = planner_config(options, sites)
    n_src, n_dst = len(src), len(dst)
    try:
        fp = process.build(model, epoch, src, dst, config, digest)
    except PlanError as e:
        raise precondition(f"{what}: {e}") from e
    except ControlError as e:  # the child died or overran: this refit plans here instead
        log.warning("%s: %s; planning in the controller's process instead", what, e.message)
        return make_plan(model, epoch, src, dst, options, gc_pause, digest, sites=sites)

    def rebuild() -> Plan:  # the tables as they were: they may have grown since
        return build_plan_from_table(
            model, epoch, _prefix(src, n_src), _prefix(dst, n_dst), config, fp.digest
        )

    cp = ControllerPlan.forked(fp, model, JoinedSpecs(src, dst), rebuild, gc_pause)
    _say_fallback(cp, what, options)
    return cp


def _prefix(table: SpecTable, n: int) -> SpecTable:
    """The table's first n rows (the table itself while it has no more)."""
    return table if len(table) == n else SpecTable.from_specs(table.specs[:n])


def make_twin_plan(
    model: str,
    epoch: int,
    pairs: Sequence[tuple[SpecTable, SpecTable]],
    options: PlanOptions,
    gc_pause: GcPause | None = None,
    sites: Sequence[Site] = (),
) -> ControllerPlan:
    """A twin plan (refitd.plan.twins: each pair's second worker copied whole from its
    first) as the controller uses it; PlanError -> FAILED_PRECONDITION."""
    return _controller_plan(
        lambda c: build_twin_plan(model, epoch, pairs, c),
        f"twin plan of model {model!r} epoch {epoch}",
        options,
        gc_pause,
        "twin",
        sites,
    )


def _controller_plan(
    build: Callable[[PlanConfig], Plan],
    what: str,
    options: PlanOptions,
    gc_pause: GcPause | None,
    kind: str,
    sites: Sequence[Site] = (),
) -> ControllerPlan:
    """`build` run with the options' planner config inside the pause; PlanError ->
    FAILED_PRECONDITION starting with `what`."""
    with gc_pause or contextlib.nullcontext():
        try:
            plan = build(planner_config(options, sites))
        except PlanError as e:
            raise precondition(f"{what}: {e}") from e
    cp = ControllerPlan.of(plan, gc_pause, kind)
    _say_fallback(cp, what, options)
    return cp


def _say_fallback(cp: ControllerPlan, what: str, options: PlanOptions) -> None:
    """Log the links of a forced path that fell back to collective (the plan counts them)."""
    fallback = cp.links.get("fallback")
    if fallback:
        log.warning("%s: links %s fell back to collective: %s", what, options.links, fallback)


def make_catch_up_plan(
    model: str,
    epoch: int,
    holders: Sequence[SpecTable],
    behind: Sequence[SpecTable],
    options: PlanOptions,
    gc_pause: GcPause | None = None,
    sites: Sequence[Site] = (),
) -> ControllerPlan:
    """The plan copying the committed version from replicas that hold it (`holders`, one
    table per worker) into the ranks `behind`: each rank behind copied whole from a holder
    of its layout when every one has such a twin (a new or restarted replica of an existing
    layout: plan/twins.py, no box intersection), else through the general planner."""
    twins = pair_twins(holders, behind)
    if twins is not None:
        pairs = [(holders[i], behind[j]) for i, j in twins]
        return make_twin_plan(model, epoch, pairs, options, gc_pause, sites)
    sources, destinations = SpecTable.from_tables(holders), SpecTable.from_tables(behind)
    return make_plan(model, epoch, sources, destinations, options, gc_pause, sites=sites)


class PlanCache:
    """Plans by digest, least recently used evicted beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[str, ControllerPlan] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.built = 0  # plans built by the owner (counted by it: `count_built`)
        self.programs_sent = 0  # LoadProgramCommands the owner sent

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

    def latest(self, model: str) -> ControllerPlan | None:
        """The most recently used plan of `model` (no hit or miss counted)."""
        with self._lock:
            return next((p for p in reversed(self._plans.values()) if p.model == model), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)
