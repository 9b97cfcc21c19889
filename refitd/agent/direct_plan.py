"""A minimal planner for the data plane's own tests and benchmark: box intersection, the
source replica picked round-robin, copies bucketed per (source slot, destination slot).

No balancing, no name maps, no validation beyond what the executor needs: the real planner
is refitd.plan.planner. This exists so the executor can be exercised independently of it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from refitd.plan.layout import TensorSpec
from refitd.plan.program import Copy, Message, SlotProgram, message_nbytes
from refitd.plan.wire import RAW, segment_nbytes


def _intersect(
    o1: tuple[int, ...], s1: tuple[int, ...], o2: tuple[int, ...], s2: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(a, b) for a, b in zip(o1, o2, strict=True))
    hi = tuple(min(a + x, b + y) for a, x, b, y in zip(o1, s1, o2, s2, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def direct_programs(
    sources: Sequence[TensorSpec],
    destinations: Sequence[TensorSpec],
    digest: str = "direct",
    bucket_bytes: int = 64 << 20,
    wire: str = RAW,
) -> dict[int, SlotProgram]:
    """SlotProgram per slot moving every destination box from the sources (by canonical)."""
    tensors: list[TensorSpec] = [*sources, *destinations]
    index = {id(s): i for i, s in enumerate(tensors)}
    by_name: dict[str, list[TensorSpec]] = defaultdict(list)
    for s in sources:
        by_name[s.canonical].append(s)
    copies: dict[tuple[int, int], list[Copy]] = defaultdict(list)
    for n, d in enumerate(destinations):
        for db in d.boxes:
            candidates = by_name.get(d.canonical, [])
            hits = []
            for s in candidates:
                for sb in s.boxes:
                    inter = _intersect(db.offset, db.shape, sb.offset, sb.shape)
                    if inter is not None:
                        hits.append((s, sb, inter))
            # one source per global block: replicas hold identical boxes; pick round-robin
            groups: dict[tuple, list] = defaultdict(list)
            for h in hits:
                groups[h[2]].append(h)
            for k, (_, options) in enumerate(sorted(groups.items())):
                s, sb, (off, shape) = options[(n + k) % len(options)]
                src_off = tuple(
                    lo + o - so for lo, o, so in zip(sb.local_offset, off, sb.offset, strict=True)
                )
                dst_off = tuple(
                    lo + o - do for lo, o, do in zip(db.local_offset, off, db.offset, strict=True)
                )
                copies[(s.slot, d.slot)].append(
                    Copy(index[id(s)], src_off, index[id(d)], dst_off, shape, wire)
                )
            if not groups:
                raise ValueError(f"destination {d.name!r} rank {d.rank}: no source for {db}")
    specs = dict(enumerate(tensors))
    slots = sorted({s.slot for s in tensors})
    local: dict[int, list[Copy]] = defaultdict(list)
    sends: dict[int, list[Message]] = defaultdict(list)
    recvs: dict[int, list[Message]] = defaultdict(list)
    next_id = 0
    for (ss, ds), cs in sorted(copies.items()):
        if ss == ds:
            local[ss] += cs
            continue
        buckets: list[list[Copy]] = [[]]
        size = 0
        for c in cs:
            n = segment_nbytes(c.wire, c.shape, specs[c.src_tensor].dtype)
            if buckets[-1] and size + n > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(c)
            size += n
        for r, b in enumerate(buckets):
            m = Message(next_id, r, ss, ds, tuple(b), message_nbytes(tuple(b), specs))
            next_id += 1
            sends[ss].append(m)
            recvs[ds].append(m)
    out: dict[int, SlotProgram] = {}
    for slot in slots:
        used: set[int] = set()
        for c in local[slot]:
            used |= {c.src_tensor, c.dst_tensor}
        for m in sends[slot] + recvs[slot]:
            for c in m.copies:
                used |= {c.src_tensor, c.dst_tensor}
        key = lambda m: (m.round, m.id)  # noqa: E731
        out[slot] = SlotProgram(
            digest=digest,
            slot=slot,
            tensors={i: specs[i] for i in sorted(used)},
            sends=tuple(sorted(sends[slot], key=key)),
            recvs=tuple(sorted(recvs[slot], key=key)),
            local=tuple(local[slot]),
        )
    return out
