"""Twin plans: workers filled tensor by tensor from workers that hold the same layout.

A destination worker whose registrations equal a source worker's apart from where they live
(`SpecTable.layout_signature`: names, canonical tensors, shapes, dtypes, storage and boxes,
in the same order; not the pool, rank or slot) is its twin's copy: each of its local tensors
is copied whole from the twin's tensor in the same position. A catch-up of a new or
restarted replica from a replica of the same layout is such a transfer. Every rank behind
receives its whole shard whatever the plan, so one sender per receiver already meets the
receive bound, and the plan skips box intersection, replica choice and relays (for a
kimi-k2 replica of 128 ranks the general planner takes about a second to find the same
bytes). Plain storage only: a quantized persistent layout goes through build_plan.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from refitd.plan.config import PlanConfig
from refitd.plan.copies import CopyTable
from refitd.plan.errors import PlanError
from refitd.plan.plan import Plan
from refitd.plan.rowwise import row_prod
from refitd.plan.table import SpecTable
from refitd.plan.wire import PLAIN, RAW_CODE, dtype_size


def build_twin_plan(
    model: str,
    epoch: int,
    pairs: Sequence[tuple[SpecTable, SpecTable]],
    config: PlanConfig,
) -> Plan:
    """The plan filling each pair's destination worker (second) from its source worker
    (first), tensor by tensor; PlanError naming the first pair whose layouts differ. The
    worker tables are read as they are (never joined): the plan's tensors are the source
    workers' rows, then the destination workers', in pair order."""
    if not pairs:
        raise PlanError("twin plan: no (source, destination) worker pair given")
    for src_w, dst_w in pairs:
        _check_pair(src_w, dst_w)
    workers = [s for s, _ in pairs] + [t for _, t in pairs]
    d = max(len(g.local_shape) for w in workers for g in w.geos)
    d = max(d, 1)
    shape, ndim, esize, slot = [], [], [], []
    for w in workers:
        _, geo, w_slot = w.columns()
        shape.append(np.array([_padded(g.local_shape, d) for g in w.geos], np.int64)[geo])
        ndim.append(np.array([len(g.local_shape) for g in w.geos], np.int8)[geo])
        esize.append(np.array([dtype_size(g.dtype) for g in w.geos], np.int8)[geo])
        slot.append(w_slot)
    n = sum(len(s) for s, _ in pairs)
    shapes = np.concatenate(shape[: len(pairs)])
    rows = np.flatnonzero(row_prod(shapes) > 0)  # empty shards move nothing
    zeros = np.zeros((rows.size, d), np.int64)
    table = CopyTable(
        src=rows,
        dst=rows + n,
        src_loc=zeros,
        dst_loc=zeros.copy(),
        shape=shapes[rows],
        ndim=np.concatenate(ndim[: len(pairs)])[rows],
        wire=np.full(rows.size, RAW_CODE, np.int8),
        esize=np.concatenate(esize[: len(pairs)])[rows],
        feed=np.full(rows.size, -1, np.int64),
        cid=np.arange(rows.size),
    )
    return Plan(
        model,
        epoch,
        _digest(model, pairs, config),
        [t for w in workers for t in w.specs],
        table,
        np.concatenate(slot),
        config,
        sources_count=n,
        tables=workers,
    )


def _padded(shape: tuple[int, ...], d: int) -> list[int]:
    return list(shape) + [1] * (d - len(shape))


def _digest(model: str, pairs: Sequence[tuple[SpecTable, SpecTable]], config: PlanConfig) -> str:
    """The twin plan's digest: model, config, and per pair both workers' layout signatures
    and where they live (pool, rank, slot)."""
    h = hashlib.blake2b(b"twin|" + repr((model, config)).encode(), digest_size=16)
    for pair in pairs:
        for w in pair:
            first = w.specs[0]
            h.update(w.layout_signature())
            h.update(repr((first.pool, first.rank, first.slot)).encode())
    return h.hexdigest()


def _check_pair(src: SpecTable, dst: SpecTable) -> None:
    """Same layout on both workers, plain storage."""
    if not src.specs or not dst.specs:
        raise PlanError("twin plan: a worker of a pair registered no tensors")
    if src.layout_signature() != dst.layout_signature():
        s, t = src.specs[0], dst.specs[0]
        raise PlanError(
            f"twin plan: rank {t.rank} of pool {t.pool!r} does not hold the layout of rank "
            f"{s.rank} of pool {s.pool!r} (tensors, shapes, dtypes, storage or boxes differ)"
        )
    if not _plain(src):
        storage = next(g.storage for g in src.geos if g.storage != PLAIN)
        raise PlanError(
            f"twin plan: rank {src.specs[0].rank} of pool {src.specs[0].pool!r} keeps "
            f"{storage} storage; twins copy plain tensors only"
        )


def _plain(worker: SpecTable) -> bool:
    return all(g.storage == PLAIN for g in worker.geos)


def pair_twins(
    holders: Sequence[SpecTable], behind: Sequence[SpecTable]
) -> list[tuple[int, int]] | None:
    """(holder index, behind index) for every worker behind, each given a holder of its
    layout (holders of one layout taken in turn, so a pool of replicas spreads the sends),
    or None when some worker behind has no holder of its layout."""
    by_layout: dict[bytes, list[int]] = {}
    for i, h in enumerate(holders):
        if h.specs and _plain(h):
            by_layout.setdefault(h.layout_signature(), []).append(i)
    used: dict[bytes, int] = {}
    pairs = []
    for j, b in enumerate(behind):
        sig = b.layout_signature()
        cands = by_layout.get(sig)
        if not cands or not b.specs:
            return None
        k = used.get(sig, 0)
        used[sig] = k + 1
        pairs.append((cands[k % len(cands)], j))
    return pairs
