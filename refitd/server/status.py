"""The status document: one JSON shape for GetStatus, GET /v1/status and the status page.

Readable at 1,024 ranks: every pool carries a `summary` (ranks per served version, dead and
lagging ranks as compact ranges, hosts and slots counted); agents and slots are aggregated;
each refit has its phases (barrier, pause, transfer, commit); each model has the per-slot
send/receive bytes of its current plan (the bottleneck link). The per-rank table (`ranks`)
is included unless the caller asks for the summary only.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from refitd.plan.wire import dtype_size
from refitd.refit_states import STATE_NAMES
from refitd.server.frontend import StatusSource

if TYPE_CHECKING:
    from refitd.server.members import Pool
    from refitd.server.plan_process import PlanningProcess
    from refitd.server.registry import Registry

PHASES = ("barrier", "pause", "transfer", "commit", "other")


def rank_ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (readable lists of 1,000 ranks)."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _rank_row(c: StatusSource, reg: Registry, rank: int, wid: str) -> dict[str, Any] | None:
    w = reg.workers.get(wid)
    if w is None:
        return None
    return {
        "rank": rank,
        "worker_id": wid,
        "host": w.host,
        "device": w.device,
        "slot": w.slot,
        "pid": w.pid,
        "live": w.live,
        "holds": w.holds,
        "subscribed": bool(c.events.subscribed([wid])),
        "tensors": len(w.specs),
        "bytes": sum(math.prod(s.local_shape) * dtype_size(s.dtype) for s in w.specs),
    }


def _pool_summary(p: Pool, rows: list[dict[str, Any]], committed: int) -> dict[str, Any]:
    """Counts and compact rank lists of one pool."""
    present = {r["rank"] for r in rows}
    dead = sorted(set(range(p.size)) - present) + [r["rank"] for r in rows if not r["live"]]
    dest = p.role == "destination"
    versions = Counter(r["holds"] for r in rows if r["live"]) if dest else Counter()
    lagging = [r["rank"] for r in rows if dest and r["live"] and r["holds"] < committed]
    return {
        "registered": len(rows),
        "size": p.size,
        "live": sum(r["live"] for r in rows),
        "subscribed": sum(r["subscribed"] for r in rows),
        "versions": {str(v): n for v, n in sorted(versions.items(), reverse=True)},
        "dead": rank_ranges(dead),
        "dead_count": len(set(dead)),
        "lagging": rank_ranges(lagging),
        "lagging_count": len(lagging),
        "hosts": len({r["host"] for r in rows}),
        "slots": len({r["slot"] for r in rows}),
        "tensors": sum(r["tensors"] for r in rows),
        "bytes": sum(r["bytes"] for r in rows),
    }


def _plan_traffic(c: StatusSource, model: str) -> dict[str, Any] | None:
    """Per-slot send/receive bytes of the model's most recent plan; the busiest link."""
    cp = c.refits.plans.latest(model)
    if cp is None:
        return None
    send, recv = cp.traffic()
    slots = [{"slot": s, "send": send.get(s, 0), "recv": recv.get(s, 0)} for s in cp.slots]
    top_send = max(slots, key=lambda x: x["send"], default=None)
    top_recv = max(slots, key=lambda x: x["recv"], default=None)
    st = cp.stats
    return {
        "digest": cp.digest,
        "total_bytes": st.total_bytes,
        "remote_bytes": st.remote_bytes,
        "local_bytes": st.local_bytes,
        "relay_bytes": st.relay_bytes,
        "messages": st.messages,
        "links": cp.links,
        "rounds": st.rounds,
        "send_imbalance": st.send_imbalance,
        "bottleneck": {
            "send_slot": top_send["slot"] if top_send else None,
            "send_bytes": top_send["send"] if top_send else 0,
            "recv_slot": top_recv["slot"] if top_recv else None,
            "recv_bytes": top_recv["recv"] if top_recv else 0,
        },
        "slots": slots,
    }


def _planning(p: PlanningProcess | None) -> dict[str, Any] | None:
    """The planning processes' counts and the last one's own times (None: refit plans are
    built in the controller's process)."""
    if p is None:
        return None
    return {"started": p.started, "died": p.died, "last_pid": p.last_pid, **p.last_timings}


def refit_phases(r: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of one refit record (barrier, pause, transfer, commit, other)."""
    total = max(0.0, (r.get("ended_at") or 0.0) - (r.get("started_at") or 0.0))
    sent, done = r.get("executes_sent_at"), r.get("transfer_done_at")
    phases = {
        "barrier": float(r.get("barrier_s") or 0.0),
        "pause": float(r.get("pause_s") or 0.0) + float(r.get("staged_pause_s") or 0.0),
        "transfer": max(0.0, done - sent) if sent is not None and done is not None else 0.0,
        "commit": float(r.get("control_end_s") or 0.0),
    }
    phases["other"] = max(0.0, total - sum(phases.values()))
    return phases


def _models(c: StatusSource, model_filter: str, with_ranks: bool) -> list[dict[str, Any]]:
    reg = c.registry
    models = []
    for m in sorted(reg.models.values(), key=lambda m: m.name):
        if model_filter and m.name != model_filter:
            continue
        running = c.refits.running(m.name)
        pending = c.refits.pending(m.name)
        pools = []
        for p in sorted(m.pools.values(), key=lambda p: (p.role != "source", p.name)):
            rows = [
                row
                for rank, wid in sorted(p.ranks.items())
                if (row := _rank_row(c, reg, rank, wid)) is not None
            ]
            # a pool on its own cadence lags only behind the version its ranks last took
            every = c.settings.pool_cadence(m.name, p.name) if p.role == "destination" else 1
            held = [r["holds"] for r in rows if r["live"]]
            due = m.committed_version if every == 1 else max(held, default=0)
            pool: dict[str, Any] = {
                "name": p.name,
                "role": p.role,
                "mode": "staged" if p.staged else "adapter" if p.adapter else "in_place",
                "size": p.size,
                "registered": len(p.ranks),
                "summary": _pool_summary(p, rows, due),
            }
            if p.role == "destination":
                pool["version"] = min(held, default=0)  # what every live rank serves
                pool["every"] = every
            if with_ranks:
                pool["ranks"] = rows
            pools.append(pool)
        models.append(
            {
                "name": m.name,
                "epoch": m.epoch,
                "committed_version": m.committed_version,
                "weight": c.settings.model_weight(m.name),
                "running": None
                if running is None
                else {"version": running.version, "state": STATE_NAMES[running.state]},
                "pending": pending,
                "versions": c.db.versions(m.name, 10),
                "pools": pools,
                "plan": _plan_traffic(c, m.name),
            }
        )
    return models


def status_document(
    c: StatusSource, model_filter: str = "", with_ranks: bool = True
) -> dict[str, Any]:
    """Models (epochs, versions, pools with summaries, ranks unless `with_ranks` is off,
    plan traffic), agents and slots (listed and aggregated) and the last refits."""
    reg = c.registry
    with reg.lock:
        models = _models(c, model_filter, with_ranks)
        agents = [
            {
                "agent_id": a.agent_id,
                "host": a.host,
                "pid": a.pid,
                "data_plane_address": a.data_plane_address,
                "links": list(a.links),
                "connected": c.agents.connected(a.agent_id),
                "slots": list(a.slot_ids),
            }
            for a in sorted(reg.agents.values(), key=lambda a: (a.host, a.agent_id))
        ]
        slots = [
            {
                "slot": s.slot_id,
                "host": s.host,
                "device": s.device,
                "agent_id": s.agent_id,
                "connected": bool(s.agent_id) and c.agents.connected(s.agent_id or ""),
            }
            for s in sorted(reg.slots.values(), key=lambda s: s.slot_id)
        ]
    refits = []
    for r in reversed(c.refits.history):
        if model_filter and r.model != model_filter:
            continue
        row = r.to_json()
        row["phases"] = refit_phases(row)
        refits.append(row)
    return {
        "controller": {
            "grpc": c.grpc_address,
            "http": c.http_address,
            "store": c.store_address_str,
            "uptime_s": time.monotonic() - c.started_monotonic,
            "data_dir": str(c.settings.data_dir),
            "plan_cache": {
                "plans": len(c.refits.plans),
                "capacity": c.refits.plans.capacity,
                "hits": c.refits.plans.hits,
                "misses": c.refits.plans.misses,
                "built": c.refits.plans.built,
                "programs_sent": c.refits.plans.programs_sent,
                "planning_process": _planning(c.refits.planner),
            },
        },
        "models": models,
        "agents": agents,
        "slots": slots,
        "summary": {
            "agents": len(agents),
            "agents_connected": sum(a["connected"] for a in agents),
            "agents_disconnected": [a["agent_id"] for a in agents if not a["connected"]],
            "hosts": len({a["host"] for a in agents}),
            "slots": len(slots),
            "slots_connected": sum(s["connected"] for s in slots),
            "slot_kinds": dict(Counter(s["device"].split(":")[0] for s in slots)),
        },
        "refits": refits,
    }
