"""A plan's messages as the delta policy sees them (computed once per plan digest).

Per message: its id, source slot and whether it is delta-capable (every copy lands without
conversion: refitd.plan.wire.delta_capable; not into a staged pool, whose staging buffer is
not the memory the version log speaks of; no relay copy, which forwards what this refit
delivers and so runs in the executor after the delta path); and the destination workers ((pool, rank)) each message writes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from refitd.plan.layout import TensorSpec
from refitd.plan.planner import Plan
from refitd.plan.wire import delta_capable
from refitd.server.delta_policy import MessageColumns


@dataclass(frozen=True)
class PlanDelta:
    mids: np.ndarray  # int64 [messages]
    dst_slot: np.ndarray  # int64 [messages]
    columns: MessageColumns  # pair_worker indexes `workers`
    workers: list[tuple[str, int]]  # (pool, rank) of destination workers
    layout_key: str  # same for plans of the same layout (epochs and worker ids aside)

    def capable_by_slot(self) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """(slot -> capable message ids it sends, slot -> those it receives)."""
        sends: dict[int, list[int]] = {}
        recvs: dict[int, list[int]] = {}
        cols = self.columns
        for k in np.flatnonzero(cols.capable).tolist():
            mid = int(self.mids[k])
            sends.setdefault(int(cols.src_slot[k]), []).append(mid)
            recvs.setdefault(int(self.dst_slot[k]), []).append(mid)
        return sends, recvs


def plan_delta(plan: Plan, staged_pools: Collection[str]) -> PlanDelta:
    """The plan's message columns for the delta policy (module docstring)."""
    mids, src, dst, capable = [], [], [], []
    pm, pw = [], []
    workers: dict[tuple[str, int], int] = {}
    key = hashlib.sha256()
    for slot in plan.slots():
        program = plan.program(slot)
        tensors = program.tensors
        dest_here = {c.dst_tensor for m in program.recvs for c in m.copies}
        dest_here |= {c.dst_tensor for c in program.local}
        key.update(repr((slot, program.sends, program.recvs, program.local)).encode())
        key.update(repr(sorted((i, _layout(t)) for i, t in tensors.items())).encode())
        for m in program.sends:
            k = len(mids)
            mids.append(int(m.id))
            src.append(int(m.src_slot))
            dst.append(int(m.dst_slot))
            ok = True
            seen: set[int] = set()
            for c in m.copies:
                s, d = tensors[c.src_tensor], tensors[c.dst_tensor]
                ok = ok and d.pool not in staged_pools and c.src_tensor not in dest_here
                ok = ok and delta_capable(c.wire, s.dtype, d.storage, d.dtype)
                w = workers.setdefault((d.pool, d.rank), len(workers))
                if w not in seen:
                    seen.add(w)
                    pm.append(k)
                    pw.append(w)
            capable.append(ok)
    cols = MessageColumns(
        np.array(src, dtype=np.int64),
        np.array(capable, dtype=bool),
        np.array(pm, dtype=np.int64),
        np.array(pw, dtype=np.int64),
    )
    return PlanDelta(
        np.array(mids, dtype=np.int64),
        np.array(dst, dtype=np.int64),
        cols,
        list(workers),
        key.hexdigest()[:32],
    )


def _layout(t: TensorSpec) -> tuple:
    """What of a tensor spec is layout (not the worker that registered it)."""
    return (t.pool, t.rank, t.slot, t.name, t.dtype, t.storage, t.local_shape, t.boxes)
