"""A plan's messages as the delta policy sees them (computed once per plan digest).

Per message: its id, source slot and whether it is delta-capable (every copy lands without
conversion: refitd.plan.wire.delta_capable; not into a staged pool, whose staging buffer is
not the memory the version log speaks of; no relay copy, which forwards what this refit
delivers and so runs in the executor after the delta path; not on a one-sided path, whose
sender writes the destination's memory in place: such a message goes dense, counted as
`link` in the ledger); and the destination workers
((pool, rank)) each message writes. Read from the slot programs' columns: a receiving slot's
program knows its destination tensors, a sending slot's which copies are relays.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from refitd.plan.links import ONE_SIDED
from refitd.plan.planner import Plan
from refitd.plan.program import DTYPES
from refitd.plan.wire import delta_capable
from refitd.server.delta.policy import DeltaMessageColumns


@dataclass(frozen=True)
class PlanDelta:
    mids: np.ndarray  # int64 [messages]
    dst_slot: np.ndarray  # int64 [messages]
    columns: DeltaMessageColumns  # pair_worker indexes `workers`
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
    mids, src, dst, capable, one_sided = [], [], [], [], []
    pm, pw = [], []
    workers: dict[tuple[str, int], int] = {}
    relays: set[int] = set()
    key = hashlib.sha256()
    for slot in plan.slots():
        p = plan.program(slot)
        tensors = p.tensors
        key.update(repr((slot, p.sends, p.recvs, p.local, sorted(tensors.items()))).encode())
        src_dtype = p.copies.src_dtype
        dests = {c.dst_tensor for m in p.recvs for c in m.copies}
        dests |= {c.dst_tensor for c in p.local}
        relays |= {int(m.id) for m in p.sends if any(c.src_tensor in dests for c in m.copies)}
        row = sum(len(m.copies) for m in p.sends)  # receive copy rows follow the sends'
        for m in p.recvs:
            k = len(mids)
            mids.append(int(m.id))
            src.append(int(m.src_slot))
            dst.append(int(m.dst_slot))
            one_sided.append(m.path in ONE_SIDED)
            ok = m.path not in ONE_SIDED
            seen: set[int] = set()
            for cp in m.copies:
                d = tensors[cp.dst_tensor]
                sdt = DTYPES[int(src_dtype[row])]
                row += 1
                ok = ok and d.pool not in staged_pools
                ok = ok and delta_capable(cp.wire, sdt, d.storage, d.dtype)
                w = workers.setdefault((d.pool, d.rank), len(workers))
                if w not in seen:
                    seen.add(w)
                    pm.append(k)
                    pw.append(w)
            capable.append(ok)
    mid_arr = np.array(mids, dtype=np.int64)
    ok_arr = np.array(capable, dtype=bool) & ~np.isin(mid_arr, np.array(sorted(relays)))
    cols = DeltaMessageColumns(
        np.array(src, dtype=np.int64),
        ok_arr,
        np.array(pm, dtype=np.int64),
        np.array(pw, dtype=np.int64),
        np.array(one_sided, dtype=bool),
    )
    return PlanDelta(mid_arr, np.array(dst, dtype=np.int64), cols, list(workers),
                     key.hexdigest()[:32])  # fmt: skip
