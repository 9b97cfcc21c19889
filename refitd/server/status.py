"""The status document: one JSON shape for GetStatus, GET /v1/status and the status page."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from refitd.plan.wire import dtype_size
from refitd.server.refits import STATE_NAMES

if TYPE_CHECKING:
    from refitd.server.controller import Controller


def status_document(c: Controller, model_filter: str = "") -> dict[str, Any]:
    """Models (epochs, versions, pools, ranks), agents, slots and the last refits."""
    reg = c.registry
    with reg.lock:
        models = []
        for m in sorted(reg.models.values(), key=lambda m: m.name):
            if model_filter and m.name != model_filter:
                continue
            running = c.refits.running(m.name)
            pools = []
            for p in sorted(m.pools.values(), key=lambda p: (p.role != "source", p.name)):
                ranks = []
                for rank, wid in sorted(p.ranks.items()):
                    w = reg.workers.get(wid)
                    if w is None:
                        continue
                    ranks.append(
                        {
                            "rank": rank,
                            "worker_id": wid,
                            "host": w.host,
                            "device": w.device,
                            "slot": w.slot,
                            "pid": w.pid,
                            "live": w.live,
                            "subscribed": bool(c.refits.events.subscribed([wid])),
                            "tensors": len(w.specs),
                            "bytes": sum(
                                math.prod(s.local_shape) * dtype_size(s.dtype) for s in w.specs
                            ),
                        }
                    )
                pools.append(
                    {
                        "name": p.name,
                        "role": p.role,
                        "mode": "staged" if p.staged else "in_place",
                        "size": p.size,
                        "registered": len(p.ranks),
                        "ranks": ranks,
                    }
                )
            models.append(
                {
                    "name": m.name,
                    "epoch": m.epoch,
                    "committed_version": m.committed_version,
                    "running": None
                    if running is None
                    else {"version": running.version, "state": STATE_NAMES[running.state]},
                    "versions": c.db.versions(m.name, 10),
                    "pools": pools,
                }
            )
        agents = [
            {
                "agent_id": a.agent_id,
                "host": a.host,
                "pid": a.pid,
                "data_plane_address": a.data_plane_address,
                "connected": c.refits.agents.connected(a.agent_id),
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
                "connected": bool(s.agent_id) and c.refits.agents.connected(s.agent_id or ""),
            }
            for s in sorted(reg.slots.values(), key=lambda s: s.slot_id)
        ]
    refits = [
        r.to_json()
        for r in reversed(c.refits.history)
        if not model_filter or r.model == model_filter
    ]
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
            },
        },
        "models": models,
        "agents": agents,
        "slots": slots,
        "refits": refits,
    }
