"""The controller's view of a plan, the adapter to refitd.plan.planner, and the plan cache.

The controller needs from a plan only: its digest, its slots, the program of a slot when
that slot's LoadProgramCommand is sent, the bytes it moves, and which slots read each
source rank's tensors (so a trainer rank's Refit can return once its weights have been
read). Registrations reach the planner as SpecTables kept per model (`ModelTables`, updated
as workers register), so a plan starts from ready integer columns; a slot's program is
built and serialized only when it is first needed (`ControllerPlan.load_payload`). This
module is the only place that calls the planner. Plan and program builds run inside the
caller's GcPause when one is given (the coordinator owns one per controller): the cyclic
garbage collector stays off while any of them runs, in any thread, and comes back after.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from refitd.plan.errors import PlanError
from refitd.plan.gc_pause import GcPause
from refitd.plan.layout import TensorSpec
from refitd.plan.links import LinkPolicy, SlotSite
from refitd.plan.planner import Plan, PlanConfig, build_plan_from_table, plan_digest
from refitd.plan.program import SlotProgram, encode_program
from refitd.plan.table import SpecTable
from refitd.plan.twins import build_twin_plan, pair_twins
from refitd.server.errors import precondition

log = logging.getLogger("refitd.controller")
WorkerKey = tuple[str, int]  # (pool, rank)
Site = tuple[int, str, str, tuple[str, ...]]  # (slot, host, device kind, paths offered)
# What a loaded slot program's handles came from: per worker holding tensors on the slot,
# the identity of its registration (its memory handles change only with it), and the
# staged and snapshot pools among them.
SlotInputs = tuple[tuple[tuple[WorkerKey, str], ...], frozenset[str], frozenset[str]]


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


@dataclass(frozen=True)
class LoadPayload:
    """What a LoadProgramCommand carries for one slot: the serialized SlotProgram and the
    plan indices of the tensors whose memory handles go with it (ControllerPlan.held)."""

    program: bytes
    tensors: np.ndarray  # plan index of every tensor held on the slot (its handle goes along)


@dataclass
class ControllerPlan:
    """A built plan as the controller uses it; slot programs are built on demand, once."""

    digest: str
    slots: list[int]
    total_bytes: int
    plan: Plan
    gc_pause: GcPause | None = None  # the owner's pause, held while a program is built
    kind: str = "general"  # "twin": built by plan/twins.py (a catch-up of same-layout ranks)
    _payloads: dict[int, LoadPayload] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _holders: dict[int, tuple[WorkerKey, ...]] | None = None
    _links: dict[str, object] | None = None

    @property
    def links(self) -> dict[str, object]:
        """Messages and bytes per path, local copies, fallbacks (Plan.link_summary)."""
        if self._links is None:
            self._links = self.plan.link_summary()
        return self._links

    def readers(self, pool: str, rank: int) -> frozenset[int]:
        """Slots reading source worker (pool, rank): computed for all on the first call
        (a catch-up plan never asks)."""
        with self.gc_pause or contextlib.nullcontext():
            return frozenset(self.plan.source_slots_of(pool, rank))

    def holders(self, slot: int) -> tuple[WorkerKey, ...]:
        """(pool, rank) of the workers holding tensors of the plan on `slot`: the workers
        whose memory handles its LoadProgramCommand carries. Computed once per plan."""
        with self._lock:
            if self._holders is None:
                self._holders = _slot_holders(self.plan)
            return self._holders.get(slot, ())

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
        tensors = self.plan.tensors
        return ((i, tensors[i]) for i in payload.tensors.tolist())

    def program_bytes(self, slot: int) -> bytes:
        return self.load_payload(slot).program

    @property
    def built_programs(self) -> int:
        with self._lock:
            return len(self._payloads)


def _slot_holders(plan: Plan) -> dict[int, tuple[WorkerKey, ...]]:
    """slot -> sorted (pool, rank) of the workers registering tensors on it, in one pass
    over the tensor list."""
    out: dict[int, set[WorkerKey]] = {}
    for t in plan.tensors:
        out.setdefault(t.slot, set()).add((t.pool, t.rank))
    return {slot: tuple(sorted(keys)) for slot, keys in out.items()}


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_MAP_ABOVE = 1 << 30  # blocks of this size and more get their own mapping
_TRIM_ABOVE = 64 << 20  # free memory kept at the top of the heap


def keep_plan_heap() -> None:
    """Have glibc serve NumPy's large blocks (up to 1 GiB) from its heap and keep up to
    64 MB free at its top (mallopt; nothing elsewhere). A plan allocates and frees arrays
    of tens of MB by the hundred; mapped afresh each time (glibc's default above 32 MB),
    every one faults in zeroed pages: 80-150k faults per plan at 1,024 ranks, a tenth of
    its time. Kept in the heap, the pages are reused; release_free_heap hands the rest
    back once the programs are encoded. Process-wide: the controller sets it at start."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MAP_ABOVE)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)


def release_free_heap() -> None:
    """Give the heap's free memory back to the OS (glibc's malloc_trim; nothing elsewhere).
    glibc keeps freed NumPy blocks under its growing mmap threshold (up to 32 MB) in its
    arenas, so a plan's transient peak and its released program index (240 MB at 1,024
    ranks) would stay in the controller's RSS for good. A few milliseconds."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)


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


def _planner_config(options: PlanOptions, sites: Sequence[Site] = ()) -> PlanConfig:
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
    return plan_digest(model, sources, destinations, _planner_config(options, sites))


def make_plan(
    model: str,
    epoch: int,
    sources: Sequence[TensorSpec] | SpecTable,
    destinations: Sequence[TensorSpec] | SpecTable,
    options: PlanOptions,
    gc_pause: GcPause | None = None,
    digest: str | None = None,
    sites: Sequence[Site] = (),
) -> ControllerPlan:
    """Build the plan through refitd.plan.planner; PlanError -> FAILED_PRECONDITION.
    No slot program is built here (see ControllerPlan.load_payload); the plan keeps
    `gc_pause` for them. `digest`: make_digest of the same inputs, when the caller has it;
    `sites`: the slots' hosts, device kinds and offered paths (the links' paths)."""
    src, dst = _table(sources), _table(destinations)
    return _controller_plan(
        lambda c: build_plan_from_table(model, epoch, src, dst, c, digest),
        f"plan of model {model!r} epoch {epoch}",
        options,
        gc_pause,
        "general",
        sites,
    )


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
            plan = build(_planner_config(options, sites))
        except PlanError as e:
            raise precondition(f"{what}: {e}") from e
    cp = ControllerPlan(
        digest=plan.digest,
        slots=plan.slots(),
        total_bytes=plan.stats.total_bytes,
        plan=plan,
        gc_pause=gc_pause,
        kind=kind,
    )
    fallback = cp.links.get("fallback")
    if fallback:
        log.warning("%s: links %s fell back to collective: %s", what, options.links, fallback)
    return cp


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
            return next((p for p in reversed(self._plans.values()) if p.plan.model == model), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)
