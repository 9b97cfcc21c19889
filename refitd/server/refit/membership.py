"""Membership: what a refit of (model, epoch) needs from the registry, and its plan.

A Membership is computed once per membership epoch (a change of membership bumps the
epoch, so a cached one is never stale) from a registry snapshot and the plan cache. The
plan is cached by its layout digest, not the epoch: a restart that keeps every layout
reuses it (the agent commander then reloads only the slots whose workers registered again). This
module is the one place that maps a plan's slots to the node agents that hold them
(`slot_owners`), for refits and catch-ups alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from refitd.plan.gc_pause import GcPause
from refitd.plan.layout import TensorSpec
from refitd.plan.table import SpecTable
from refitd.server.errors import precondition
from refitd.server.members import Worker
from refitd.server.metrics import ControllerMetrics
from refitd.server.plan_options import PlanOptions, table_slots
from refitd.server.plan_process import PlanningProcess
from refitd.server.planning import (
    ControllerPlan,
    PlanCache,
    make_catch_up_plan,
    make_digest,
    make_plan,
)
from refitd.server.refit.run import RefitRun
from refitd.server.registry import Registry
from refitd.server.streams import AgentHub, EventHub


@dataclass(frozen=True)
class SlotOwners:
    """The node agents holding a plan's slots."""

    by_agent: dict[str, list[int]]  # agent id -> its slots in the plan
    batch_agents: frozenset[str]  # agents that take one ExecuteCommand for all their slots
    incarnations: dict[int, int]  # slot -> incarnation of the agent holding it


@dataclass
class Membership:
    """What a refit of (model, epoch) needs from the registry, computed once per epoch."""

    model: str
    epoch: int
    plan: ControllerPlan
    dest_workers: list[Worker]
    owners: SlotOwners
    readers: dict[int, frozenset[int]]  # source rank -> slots reading it
    members: frozenset[str]  # destination workers and agents: losing one fails the refit
    staged_pools: frozenset[str] = frozenset()  # written through staging, applied at the end
    snapshot_pools: frozenset[str] = frozenset()  # sources copied to a snapshot, then released
    source_pool: str = ""  # the pool whose ranks `readers` counts
    adapter_pools: frozenset[str] = frozenset()  # written into a spare adapter slot: no pause
    # destination pools on their own cadence left out of this refit: pool -> version it keeps
    kept: tuple[tuple[str, int], ...] = ()

    @property
    def by_agent(self) -> dict[str, list[int]]:
        return self.owners.by_agent

    @property
    def links(self) -> dict[str, object]:
        """Messages and bytes per path of the plan (the refit record shows it)."""
        return self.plan.links

    @property
    def batch_agents(self) -> frozenset[str]:
        return self.owners.batch_agents

    def in_place(self) -> list[Worker]:
        """Destination workers written in place by the transfer (paused before it)."""
        quiet = self.staged_pools | self.adapter_pools
        return [w for w in self.dest_workers if w.pool not in quiet]

    def staged(self) -> list[Worker]:
        """Destination workers of staged pools (paused only for the apply)."""
        return [w for w in self.dest_workers if w.pool in self.staged_pools]


def slot_owners(
    registry: Registry, slots: Sequence[int], connected: Callable[[str], bool]
) -> SlotOwners:
    """Slot -> agent mapping of a plan; FAILED_PRECONDITION naming the first slot without
    a connected node agent."""
    by_agent: dict[str, list[int]] = {}
    batch: set[str] = set()
    incarnations: dict[int, int] = {}
    for slot, owner, agent in registry.slot_agents(slots):
        if agent is None or not connected(agent.agent_id):
            where = f"{owner.device} of host {owner.host!r}" if owner else "?"
            raise precondition(f"slot {slot} ({where}) of the plan has no connected node agent")
        by_agent.setdefault(agent.agent_id, []).append(slot)
        incarnations[slot] = agent.incarnation
        if agent.batch_execute:
            batch.add(agent.agent_id)
    return SlotOwners(by_agent, frozenset(batch), incarnations)


class Memberships:
    """Builds and caches the Membership of each model's current epoch."""

    def __init__(
        self,
        registry: Registry,
        agents: AgentHub,
        events: EventHub,
        plans: PlanCache,
        plan_options: PlanOptions,
        gc_pause: GcPause,
        metrics: ControllerMetrics,
        process: PlanningProcess | None = None,
        flip_timeout_s: float = 30.0,
        cadence: Callable[[str, str], int] | None = None,
    ) -> None:
        self.registry = registry
        self.cadence = cadence  # (model, pool) -> every how many versions it takes part
        self.flip_timeout_s = flip_timeout_s  # adapter pools: the wait for their flips
        self.process = process  # builds refit plans off this process's interpreter lock
        self.metrics = metrics
        self.agents = agents
        self.events = events
        self.plans = plans
        self.plan_options = plan_options
        self.gc_pause = gc_pause
        self._cache: dict[str, Membership] = {}

    def cached(self, model: str) -> Membership | None:
        """The last Membership built for `model` (any epoch)."""
        return self._cache.get(model)

    def source_pool_complete(self, run: RefitRun) -> bool:
        return self.registry.pool_complete(run.model, run.source_pool)

    def for_run(self, run: RefitRun) -> Membership:
        """The cached Membership of the model's epoch, checked for liveness, else built.
        Adapter pools first finish flipping to their last COMMIT: each registers its old
        slot as the spare the refit writes (a refit never writes a slot being served)."""
        flipping = self.registry.await_flips(run.model, self.flip_timeout_s)
        if flipping:
            raise precondition(
                f"{', '.join(w.describe() for w in flipping)} of adapter pools did not register "
                f"a spare adapter slot within {self.flip_timeout_s:g}s of its last COMMIT (the "
                "engine still reads its previous slot); nothing was written"
            )
        model = self.registry.model(run.model)
        kept = self.kept(run.model, run.version)
        ms = self._cache.get(run.model)
        if (
            ms is None
            or ms.epoch != model.epoch
            or ms.source_pool != run.source_pool
            or ms.kept != kept
        ):
            ms = self._build(run.model, run.source_pool, run.pool_size, "refit", kept)
            self._cache[run.model] = ms
        for agent_id in ms.by_agent:
            if not self.agents.connected(agent_id):
                slots = ms.by_agent[agent_id]
                raise precondition(
                    f"slots {slots} of the plan have no connected node agent (agent {agent_id})"
                )
        subscribed = set(self.events.subscribed(w.worker_id for w in ms.dest_workers))
        for w in ms.dest_workers:
            if w.worker_id not in subscribed:
                raise precondition(
                    f"{w.describe()} is not subscribed: it cannot pause, so its weights cannot "
                    "be written"
                )
        run.detail["digest"] = ms.plan.digest
        run.detail["links"] = ms.links
        if ms.kept:
            run.detail["kept"] = dict(ms.kept)
        return ms

    def kept(self, model: str, version: int) -> tuple[tuple[str, int], ...]:
        """The destination pools on a cadence that a refit of `version` leaves out, with the
        version each keeps serving: a pool takes part when a rank holds nothing, or once
        `cadence` versions passed since the version its ranks hold."""
        if self.cadence is None:
            return ()
        reg = self.registry
        out = []
        with reg.lock:
            m = reg.model(model)
            for p in m.destination_pools():
                every = self.cadence(model, p.name)
                held = [reg.workers[w].holds for w in p.ranks.values() if w in reg.workers]
                holds = min(held, default=0)
                if every > 1 and holds > 0 and version - holds < every:
                    out.append((p.name, holds))
        return tuple(sorted(out))

    def ahead(self, model: str, source_pool: str, pool_size: int) -> Membership:
        """Build (and cache) the Membership of the model's current epoch before any refit
        asks for it: its plan counts as built "ahead" (refit/ahead.py)."""
        kept = self.kept(model, self.registry.committed_version(model) + 1)
        ms = self._build(model, source_pool, pool_size, "ahead", kept)
        self._cache[model] = ms
        return ms

    def plan(
        self,
        model: str,
        epoch: int,
        sources: Sequence[TensorSpec] | SpecTable,
        destinations: Sequence[TensorSpec] | SpecTable,
        kind: str = "refit",
    ) -> ControllerPlan:
        """The plan of these layouts, from the cache (by layout digest) or built (and
        cached, counted as `kind`); `epoch` is only recorded in a plan built now. The
        links' paths come from the slots' hosts and their agents' offers (part of the
        digest)."""
        sites = self.registry.slot_sites(table_slots(sources, destinations))
        digest = make_digest(model, sources, destinations, self.plan_options, sites)
        plan = self.plans.get(digest)
        if plan is None:
            plan = make_plan(
                model, epoch, sources, destinations, self.plan_options, self.gc_pause, digest,
                self.process, sites,
            )  # fmt: skip
            self.plans.put(plan)
            self.built(model, kind)
        return plan

    def catch_up_plan(
        self, model: str, epoch: int, holders: list[SpecTable], behind: list[SpecTable]
    ) -> ControllerPlan:
        """A catch-up's plan (replicas -> the ranks behind, one table per worker), built
        each time (`make_catch_up_plan`)."""
        sites = self.registry.slot_sites(
            {s for t in [*holders, *behind] for s in t.columns()[2].tolist()}
        )
        plan = make_catch_up_plan(
            model, epoch, holders, behind, self.plan_options, self.gc_pause, sites
        )
        self.built(model, "catch_up")
        return plan

    def built(self, model: str, kind: str) -> None:
        """Count a plan built (kind: refit, ahead or catch_up), in /metrics and /v1/status."""
        self.metrics.plans_built.labels(model, kind).inc()
        self.plans.built += 1

    def _build(
        self,
        name: str,
        source_pool: str,
        pool_size: int,
        kind: str,
        kept: tuple[tuple[str, int], ...] = (),
    ) -> Membership:
        """Preconditions, then the plan (cached by digest) and what a refit from
        `source_pool` (of `pool_size` ranks) into every destination pool but the `kept`
        ones needs."""
        reg = self.registry
        with reg.lock:
            model = reg.model(name)
            src = model.pools.get(source_pool)
            if src is None or not src.complete:
                have = sorted(src.ranks) if src else []
                raise precondition(
                    f"source pool {source_pool!r} of model {name!r} has ranks {have} "
                    f"of {pool_size} registered"
                )
            left_out = {pool for pool, _ in kept}
            dests = [p for p in model.destination_pools() if p.name not in left_out]
            if not dests:
                raise precondition(f"model {name!r} has no destination pool registered")
            for p in [src, *dests]:
                if not p.complete:
                    missing = sorted(set(range(p.size)) - set(p.ranks))
                    raise precondition(
                        f"destination pool {p.name!r} of model {name!r} misses ranks "
                        f"{missing} of {p.size}"
                    )
                stale = [r for r, w in p.ranks.items() if not reg.workers[w].live]
                if stale:
                    raise precondition(
                        f"ranks {sorted(stale)} of pool {p.name!r} have not re-registered "
                        f"since the controller restarted"
                    )
            src_workers = [reg.workers[w] for _, w in sorted(src.ranks.items())]
            dest_workers = [reg.workers[w] for p in dests for _, w in sorted(p.ranks.items())]
            epoch = model.epoch
            tables = model.tables
            if kept:  # the model's tables hold every pool: this refit's specs, listed
                specs: tuple[Sequence[TensorSpec], Sequence[TensorSpec]] = (
                    [t for w in src_workers for t in w.specs],
                    [t for w in dest_workers for t in w.specs],
                )
            else:
                specs = tables.snapshot(
                    lambda: (
                        [t for w in src_workers for t in w.specs],
                        [t for w in dest_workers for t in w.specs],
                    )
                )
        try:
            plan = self.plan(name, epoch, *specs, kind)
        finally:
            if not kept:
                with reg.lock:
                    tables.release()
        owners = slot_owners(reg, plan.slots, self.agents.connected)
        readers = {rank: plan.readers(source_pool, rank) for rank in range(pool_size)}
        members = frozenset([*(w.worker_id for w in dest_workers), *owners.by_agent])
        return Membership(
            name,
            epoch,
            plan,
            dest_workers,
            owners,
            readers,
            members,
            frozenset(p.name for p in dests if p.staged),
            frozenset([src.name] if src.snapshot else []),
            source_pool,
            frozenset(p.name for p in dests if p.adapter),
            kept,
        )

    def for_catch_up(
        self, model: str, epoch: int, plan: ControllerPlan, behind: list[Worker]
    ) -> Membership:
        """The Membership of a catch-up into `behind` (no source ranks read)."""
        owners = slot_owners(self.registry, plan.slots, self.agents.connected)
        members = frozenset([*(w.worker_id for w in behind), *owners.by_agent])
        return Membership(model, epoch, plan, behind, owners, {}, members)
