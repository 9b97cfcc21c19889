"""Plans ahead: a model's next refit plan and programs built while its driver is idle.

A refit after a membership change (the first registrations, a replica that joined and caught
up, a rank that came back with another layout) used to build its plan and encode its slot
programs on its own critical path: 2-4 s at 1,024 ranks. Once every pool of the model is
registered and live, a lease-watcher chore flags the model, and its driver thread, when no
refit is pending, builds the Membership of the current epoch (the plan cached by digest)
and encodes every slot's program. The refit that follows finds both ready. The driver is
the model's own thread, so a refit request waits for an ahead build in progress instead
of building the same plan beside it. One try per membership epoch; a failure (an agent
not connected yet, a layout the planner refuses) is left to the refit, which reports it.
"""

from __future__ import annotations

import logging

from refitd.server.errors import ControlError
from refitd.server.refit.membership import Memberships
from refitd.server.refit.run import ModelRefits
from refitd.server.refit.scheduler import Scheduler
from refitd.server.registry import Registry

log = logging.getLogger("refitd.controller")


class PlansAhead:
    """Flags models whose membership settled (`find`, a chore) and builds their next plan
    on the model's driver (`run`)."""

    def __init__(self, registry: Registry, scheduler: Scheduler, memberships: Memberships) -> None:
        self.registry = registry
        self.scheduler = scheduler
        self.memberships = memberships
        self._tried: dict[str, int] = {}  # model -> the last epoch built ahead (or tried)
        self.passes = 0  # `find` passes completed (tests wait on it, not on time)

    def find(self) -> None:
        """Flag every model whose current epoch has no Membership yet and whose pools are
        all registered and live (one source pool)."""
        for name in self.registry.model_names():
            epoch = self._settled(name)
            if epoch is None or self._tried.get(name) == epoch:
                continue
            cached = self.memberships.cached(name)
            if cached is not None and cached.epoch == epoch:
                continue
            m = self.scheduler.model(name)
            with m.cond:
                if not m.plan_ahead:
                    m.plan_ahead = True
                    m.cond.notify()
        self.passes += 1

    def run(self, m: ModelRefits) -> None:
        """Build the model's Membership for its current epoch and every slot's program."""
        reg = self.registry
        with reg.lock:
            model = reg.model(m.name)
            epoch, src = model.epoch, model.source_pool()
        self._tried[m.name] = epoch
        if src is None:
            return
        try:
            ms = self.memberships.ahead(m.name, src.name, src.size)
            for slot in ms.plan.slots:
                ms.plan.load_payload(slot)
        except ControlError as e:
            log.info("model %s: next plan not built ahead (%s); the refit builds it", m.name, e)
            return
        log.info(
            "model %s: next plan built ahead for epoch %d (%d slots)",
            m.name,
            epoch,
            len(ms.plan.slots),
        )

    def ready(self, name: str) -> bool:
        """Whether the model's Membership of its current epoch is cached with every slot's
        program encoded (what a build ahead leaves)."""
        ms = self.memberships.cached(name)
        epoch = self.registry.model(name).epoch
        return ms is not None and ms.epoch == epoch and ms.plan.built_programs == len(ms.plan.slots)

    def _settled(self, name: str) -> int | None:
        """The model's epoch when it has one source pool and every pool is complete and
        live, else None."""
        reg = self.registry
        with reg.lock:
            model = reg.model(name)
            pools = list(model.pools.values())
            sources = [p for p in pools if p.role == "source"]
            if len(sources) != 1 or len(pools) < 2:
                return None
            for p in pools:
                if not p.complete or not all(reg.workers[w].live for w in p.ranks.values()):
                    return None
            return model.epoch
