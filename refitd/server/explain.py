"""The controller side of `refitd explain` and GET /v1/explain: the model's current plan
(the cached one its next refit replays, built now when none is cached), explained by
refitd.plan.explain. The server never touches tensor bytes: this reads plan metadata only."""

from __future__ import annotations

from typing import Any

from refitd.plan.errors import PlanError
from refitd.plan.explain import explain, format_explanations
from refitd.server.errors import not_found, precondition
from refitd.server.frontend import PlanSource
from refitd.server.plan_options import table_slots
from refitd.server.planning import ControllerPlan, make_digest, make_plan


def current_plan(c: PlanSource, model: str) -> tuple[ControllerPlan, bool]:
    """(plan, current): the plan of the model's current registrations (the digest a refit
    computes, so a cached plan is shared with the refit path), or, while the model has no
    source or destination pool registered (a trainer between runs), its last cached plan
    (current False)."""
    reg = c.registry
    with reg.lock:
        m = reg.models.get(model)
        if m is None:
            raise not_found(f"model {model!r} is not registered")
        src, dests = m.source_pool(), m.destination_pools()
        if src is None or not dests or not all(p.ranks for p in (src, *dests)):
            last = c.refits.plans.latest(model)
            if last is None:
                raise precondition(
                    f"model {model!r} has no source and destination pools to plan, and no "
                    "earlier plan is cached"
                )
            return last, False
        src_workers = [reg.workers[w] for _, w in sorted(src.ranks.items())]
        dest_workers = [reg.workers[w] for p in dests for _, w in sorted(p.ranks.items())]
        epoch, tables = m.epoch, m.tables
        sources, destinations = tables.snapshot(
            lambda: (
                [t for w in src_workers for t in w.specs],
                [t for w in dest_workers for t in w.specs],
            )
        )
    try:
        options = c.refits.plan_options
        sites = reg.slot_sites(table_slots(sources, destinations))
        digest = make_digest(model, sources, destinations, options, sites)
        plan = c.refits.plans.get(digest)
        if plan is None:
            plan = make_plan(
                model, epoch, sources, destinations, options, digest=digest, sites=sites
            )
            c.refits.plans.put(plan)
    finally:
        with reg.lock:
            tables.release()
    return plan, True


def explain_document(
    c: PlanSource, model: str, tensor: str, pool: str = "", rank: int | None = None
) -> tuple[dict[str, Any], str]:
    """(JSON document, compact text) of the shards of `tensor` in the current plan."""
    plan, current = current_plan(c, model)
    try:
        shards = explain(plan.plan, tensor, pool or None, rank)
    except PlanError as e:
        raise not_found(str(e)) from e
    doc = {
        "model": model,
        "digest": plan.digest,
        "current": current,  # False: the last cached plan (pools unregistered since)
        "tensor": tensor,
        "shards": [s.to_json() for s in shards],
    }
    text = format_explanations(shards)
    if not current:
        text = f"(last plan {plan.digest[:12]}: the model's pools are not all registered)\n{text}"
    return doc, text
