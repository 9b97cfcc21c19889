"""The resharding planner: every (source box -> destination box) copy, balanced and bucketed.

build_plan intersects each destination box with the source boxes of the same canonical
tensor (after name-map links and tied embeddings), picks a source replica per copy so the
busiest source slot sends as little as possible, and packs copies per (source slot,
destination slot) into bounded messages with rounds. It works on columns: specs are
reduced to geometry ids, canonical tensors with the same geometry sequence form a pattern
whose intersections are computed once, and copies stay NumPy arrays until `program(slot)`.
build_plan tabulates the TensorSpec lists first (table.SpecTable, the Python-bound part);
a controller that keeps one SpecTable per side as workers register calls
build_plan_from_table and skips it. The planner never switches the garbage collector;
a caller planning large clusters wraps its calls in its own gc_pause.GcPause.

Relays (PlanConfig.relay, off by default until every executor honours the rule below): a
destination slot that received a block may forward it to another destination replica of
the same tensor, so the busiest source slots send fewer replica copies (relay.py picks
which). Convention on top of program.py:
- a relay Copy's src_tensor is the plan index of a DESTINATION tensor held on the sending
  slot, reading a region that an earlier message to that slot wrote in full; relays are
  raw wire, between plain-storage destinations of the same dtype, never forwarded again;
- a message with relay copies has a round strictly greater than the round of every message
  whose data it forwards. Executor rule: before packing such a message the slot completes
  all its receives of smaller rounds; local copies whose src_tensor is a destination
  tensor (listed after the others in SlotProgram.local) run after all receives completed;
- a trainer rank's sources are released once every copy reading a source tensor is done;
  relays don't count (`source_slots_of` lists only slots reading source tensors).
Stats: send_imbalance = source_max_send_bytes / ideal_send_bytes, both over source slots
(ideal = bytes leaving source slots / source slots); max_send_bytes is over all slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from refitd.plan import buckets as bk
from refitd.plan.balance import Choices, choose_replicas
from refitd.plan.errors import PlanError
from refitd.plan.layout import FP8_BLOCK, MXFP8, PLAIN, TensorSpec
from refitd.plan.names import Link, NameMap, resolve_links
from refitd.plan.program import SlotProgram
from refitd.plan.programs import CopyCols, Messages, PlanTensors, ProgramIndex
from refitd.plan.relay import RelayCandidates, choose_relays
from refitd.plan.table import Geo, SpecTable
from refitd.plan.wire import FP8_TILE, MXFP8_BLOCK, RAW, dtype_size

__all__ = [
    "Plan",
    "PlanConfig",
    "PlanError",
    "PlanStats",
    "SpecTable",
    "build_plan",
    "build_plan_from_table",
    "plan_digest",
]

WIRE_NAMES = (RAW, MXFP8, FP8_BLOCK)


@dataclass
class PlanConfig:
    """How to plan. fanout: peers a slot sends to concurrently (lanes of the schedule);
    relay: let destination replicas forward blocks (see the module docstring);
    schedule: "lanes" (rounds from `fanout` lanes per source) or "serial" (rounds from a
    schedule in which each slot moves one message at a time, as NCCL on one stream runs
    them: buckets.serial_rounds)."""

    bucket_bytes: int = 64 << 20
    sender_quantization: bool = False
    allow_dtype_cast: bool = False
    tie_embeddings: bool = True
    name_map: NameMap | None = None
    fanout: int = 4
    relay: bool = False
    schedule: str = "lanes"

    def __post_init__(self) -> None:
        if self.schedule not in ("lanes", "serial"):
            raise PlanError(f"unknown schedule {self.schedule!r}; known: lanes, serial")


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Byte and count totals of a plan (bytes are wire bytes, alignment included).

    send_imbalance and ideal_send_bytes are over source slots (see the module docstring);
    relay_bytes/relay_copies: remote copies forwarded by destination slots.
    """

    copies: int
    local_copies: int
    messages: int
    rounds: int
    total_bytes: int
    local_bytes: int
    remote_bytes: int
    source_slots: int
    max_send_bytes: int
    ideal_send_bytes: float
    send_imbalance: float
    max_recv_bytes: int
    source_max_send_bytes: int = 0
    relay_bytes: int = 0
    relay_copies: int = 0


_Geo = Geo


@dataclass(slots=True)
class _Side:
    """Columnar view of one side's specs; canonicals are the groups of `order`."""

    specs: Sequence[TensorSpec]
    base: int
    names: dict[str, int]
    canon: np.ndarray
    geo: np.ndarray
    geos: list[_Geo]
    slot: np.ndarray
    order: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pattern: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def who(self, i: int) -> str:
        s = self.specs[i]
        return f"tensor {s.name!r} (canonical {s.canonical!r}), pool {s.pool!r}, rank {s.rank}"

    def members(self, c: int) -> np.ndarray:
        return self.order[self.start[c] : self.start[c] + self.count[c]]


def _sort_by(*keys: np.ndarray) -> np.ndarray:
    """Stable order by several non-negative integer keys, the first most significant: one
    argsort of a combined key when it fits in int64, else lexsort."""
    combined = np.zeros(keys[0].size, np.int64)
    span = 1
    for k in reversed(keys):
        if not k.size:
            return np.zeros(0, np.int64)
        lo, hi = int(k.min()), int(k.max())
        if lo < 0 or span * (hi + 1) >= 2**62:
            return np.lexsort(keys[::-1])
        combined += k * span
        span *= hi + 1
    return np.argsort(combined, kind="stable")


PIECE_KEY = 1 << 32  # (copy id, row offset of a piece) -> one int64 key


def _sans_pool(g: Geo) -> tuple:
    return (g.global_shape, g.dtype, g.storage, g.local_shape, g.boxes)


def _side(table: SpecTable, base: int) -> _Side:
    canon, geo, slot = table.columns()
    return _Side(table.specs, base, table.canonical_ids, canon, geo, table.geos, slot)


def _group(side: _Side) -> None:
    """Sort by (canonical, geometry, slot) and give canonicals with the same geometry
    sequence the same pattern id (hashed, then verified exactly)."""
    nc = len(side.names)
    side.order = _sort_by(side.canon, side.geo, side.slot)
    side.count = np.bincount(side.canon, minlength=nc)
    side.start = np.cumsum(side.count) - side.count
    if nc == 0:
        side.pattern = np.zeros(0, np.int64)
        return
    g = side.geo[side.order]
    pos = np.arange(g.size) - np.repeat(side.start, side.count)
    weights = np.random.default_rng(0x5EED).integers(
        1, 2**62, size=int(side.count.max()), dtype=np.int64
    ).astype(np.uint64) | np.uint64(1)
    h = np.add.reduceat((g.astype(np.uint64) + np.uint64(1)) * weights[pos], side.start)
    h ^= side.count.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    _, pat = np.unique(h, return_inverse=True)
    pat = pat.reshape(-1)
    # exact check of every member against its pattern's first canonical
    firsts = np.unique(pat, return_index=True)[1]
    rep = firsts[pat]
    canon_sorted = side.canon[side.order]
    same = (side.count[rep] == side.count).all() and (
        g == g[side.start[rep[canon_sorted]] + pos]
    ).all()
    if not same:
        seen: dict[bytes, int] = {}
        pat = np.array(
            [
                seen.setdefault(g[a : a + n].tobytes(), len(seen))
                for a, n in zip(side.start.tolist(), side.count.tolist(), strict=True)
            ],
            np.int64,
        )
    side.pattern = pat


@dataclass(slots=True)
class _Batch:
    """Copies of one pattern group with the same replica count, before replica choice."""

    dst_spec: np.ndarray  # [N]
    cand_spec: np.ndarray  # [N, R]
    piece: np.ndarray  # [N]
    dst_loc: np.ndarray  # [P, D]
    shape: np.ndarray  # [P, D]
    rep_loc: np.ndarray  # [P, R, D]
    wire: np.ndarray  # [P]
    esize: int
    ndim: int
    klass: np.ndarray  # [P] equal within a link: the same block into replica tensors
    nklass: int
    relayable: np.ndarray  # [P] bool: plain storage of the source dtype, raw wire


def _pad(t: tuple[int, ...], d: int, fill: int) -> list[int]:
    return list(t) + [fill] * (d - len(t))


CASTABLE_DTYPES = ("float64", "float32", "bfloat16", "float16")
CAST_SETTING = (
    "set allow_dtype_cast (refitd serve --allow-dtype-cast, env REFITD_ALLOW_DTYPE_CAST, "
    "config file key allow_dtype_cast; PlanConfig.allow_dtype_cast when planning directly)"
)


def _check_cast(cfg: PlanConfig, src_dtype: str, dst_dtype: str, dst: str, src: str) -> None:
    """A destination of another dtype than its source: allowed only between float dtypes
    (the executor casts those on landing), and only when the configuration turns casts on."""
    what = f"dtype mismatch: {dst} is {dst_dtype}, source {src} is {src_dtype}"
    if src_dtype not in CASTABLE_DTYPES or dst_dtype not in CASTABLE_DTYPES:
        raise PlanError(f"{what}; casts exist only between {', '.join(CASTABLE_DTYPES)}")
    if not cfg.allow_dtype_cast:
        raise PlanError(f"{what}, and dtype casts are off: to land it cast, {CAST_SETTING}")


def _check_cover(side: _Side, members: np.ndarray, geo_ids: list[int], what: str) -> None:
    """The distinct covers of these geometries tile the global tensor exactly."""
    geos = [side.geos[g] for g in geo_ids]
    gshape = geos[0].global_shape
    covers: dict[tuple, int] = {}
    for k, g in enumerate(geos):
        covers.setdefault(g.cover, k)
    boxes = [(k, o, s) for c, k in covers.items() for o, s in c]
    total = int(np.prod(gshape)) if gshape else 1
    vol = sum(int(np.prod(s)) if s else 1 for _, _, s in boxes)
    if len(boxes) > 1 and gshape:
        lo = np.array([o for _, o, _ in boxes])
        hi = lo + np.array([s for _, _, s in boxes])
        a = np.maximum(lo[:, None], lo[None]) < np.minimum(hi[:, None], hi[None])
        hit = a.all(axis=2)
        np.fill_diagonal(hit, False)
        if hit.any():
            i, j = np.argwhere(hit)[0]
            ki, kj = boxes[i][0], boxes[j][0]
            raise PlanError(
                f"overlapping boxes in the {what}: {side.who(int(members[ki]))} holds "
                f"{boxes[i][1:]} and {side.who(int(members[kj]))} holds {boxes[j][1:]} "
                f"of global shape {gshape}"
            )
    if vol != total:
        missing = _first_missing(gshape, [(o, s) for _, o, s in boxes])
        raise PlanError(
            f"holes in the {what}: {side.who(int(members[0]))} and the other shards of "
            f"global shape {gshape} cover {vol} of {total} elements"
            + (
                f"; no shard holds the block at offset {missing[0]} of shape {missing[1]}"
                if missing is not None
                else ""
            )
        )


def _first_missing(
    gshape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A block of the global tensor that no box covers (the first cell of the grid the box
    edges cut), for a hole's error message; None if the grid is too large to enumerate."""
    if not gshape:
        return ((), ()) if not boxes else None
    edges = [
        np.unique(np.array([0, n] + [o[d] for o, _ in boxes] + [o[d] + s[d] for o, s in boxes]))
        for d, n in enumerate(gshape)
    ]
    grid = tuple(e.size - 1 for e in edges)
    if int(np.prod(grid)) > 1 << 22:
        return None
    covered = np.zeros(grid, dtype=bool)
    for o, s in boxes:
        covered[
            tuple(
                slice(int(np.searchsorted(e, a)), int(np.searchsorted(e, a + n)))
                for e, a, n in zip(edges, o, s, strict=True)
            )
        ] = True
    holes = np.argwhere(~covered)
    if not holes.size:
        return None
    cell = holes[0].tolist()
    return (
        tuple(int(e[i]) for e, i in zip(edges, cell, strict=True)),
        tuple(int(e[i + 1] - e[i]) for e, i in zip(edges, cell, strict=True)),
    )


class _Planner:
    """One build: owns the intermediate columns."""

    def __init__(self, src: _Side, dst: _Side, config: PlanConfig) -> None:
        self.src, self.dst, self.config = src, dst, config
        self.slots = np.unique(np.concatenate([src.slot, dst.slot]))
        self.src_slot_idx = np.searchsorted(self.slots, src.slot)
        self.dst_slot_idx = np.searchsorted(self.slots, dst.slot)

    def links(self) -> tuple[np.ndarray, list[tuple[int, int, int, int]], list[Link]]:
        """(rows of (source canonical id, destination canonical id, transform id), the
        transforms, the links that are not plain same-name links). A destination name
        registered in the source and not named by the name map links to itself without
        going through resolve_links (the common case, kept columnar)."""
        dst_names = list(self.dst.names)
        rules = self.config.name_map.index() if self.config.name_map is not None else {}
        sid = list(map(self.src.names.get, dst_names))
        for d in rules:
            if d in self.dst.names:
                sid[self.dst.names[d]] = None
        slow = [i for i, x in enumerate(sid) if x is None]
        links = resolve_links(
            [dst_names[i] for i in slow],
            self.src.names,
            self.config.name_map,
            self.config.tie_embeddings,
        )
        for ln in links:
            if ln.src not in self.src.names:
                i = int(self.dst.members(self.dst.names[ln.dst])[0])
                raise PlanError(
                    f"destination tensor missing in the source: {self.dst.who(i)} needs "
                    f"source tensor {ln.src!r}, which no source rank registered"
                )
        tmap: dict[tuple[int, int, int, int], int] = {(-1, 0, 0, 0): 0}
        rows = [
            (
                self.src.names[ln.src],
                self.dst.names[ln.dst],
                tmap.setdefault((ln.dim, ln.dst_start, ln.src_start, ln.length), len(tmap)),
            )
            for ln in links
        ]
        n = len(dst_names)
        plain = np.ones(n, dtype=bool)
        plain[slow] = False
        ids = np.arange(n)[plain]
        fast = np.stack(
            [
                np.fromiter((x for x in sid if x is not None), np.int64, count=ids.size),
                ids,
                np.zeros(ids.size, np.int64),
            ],
            axis=1,
        )
        lk = np.concatenate([fast, np.array(rows, dtype=np.int64).reshape(-1, 3)])
        return lk, list(tmap), links

    def batches(self) -> list[_Batch]:
        lk, transforms, links = self.links()
        self._check_rules(links)
        n_dp, n_t = int(self.dst.pattern.max()) + 1, len(transforms)
        key = (self.src.pattern[lk[:, 0]] * n_dp + self.dst.pattern[lk[:, 1]]) * n_t + lk[:, 2]
        _, grp = np.unique(key, return_inverse=True)
        grp = grp.reshape(-1)
        order = np.argsort(grp, kind="stable")
        cuts = np.flatnonzero(np.diff(grp[order])) + 1
        out: list[_Batch] = []
        for sel in np.split(order, cuts):
            if sel.size:
                cs, cd, tid = lk[sel, 0], lk[sel, 1], int(lk[sel[0], 2])
                out.extend(self._pattern(cs, cd, transforms[tid]))
        return out

    def _check_rules(self, links: list[Link]) -> None:
        """Each rule's parts plus its declared padding span the destination's dim."""
        rules = self.config.name_map.index() if self.config.name_map is not None else {}
        covered: dict[str, int] = {}
        for ln in links:
            if ln.dim >= 0:
                covered.setdefault(ln.dst, rules[ln.dst].padding if ln.dst in rules else 0)
                covered[ln.dst] += ln.length
        for name, n in covered.items():
            i = int(self.dst.members(self.dst.names[name])[0])
            shape = self.dst.specs[i].global_shape
            dim = next(ln.dim for ln in links if ln.dst == name)
            if dim >= len(shape) or shape[dim] != n:
                raise PlanError(
                    f"name map parts (with declared padding) cover {n} of dim {dim} of "
                    f"{self.dst.who(i)} "
                    f"(global shape {shape})"
                )

    def _pattern(
        self, cs: np.ndarray, cd: np.ndarray, tf: tuple[int, int, int, int]
    ) -> list[_Batch]:
        """Intersections for a group of links sharing geometry; one batch per replica count."""
        src, dst, cfg = self.src, self.dst, self.config
        s_mem = src.members(int(cs[0]))
        d_mem = dst.members(int(cd[0]))
        s_geo = src.geo[s_mem].tolist()
        d_geo = dst.geo[d_mem].tolist()
        g0 = src.geos[s_geo[0]]
        for k, g in enumerate(s_geo):
            sg = src.geos[g]
            if sg.global_shape != g0.global_shape:
                raise PlanError(
                    f"global shapes disagree: {src.who(int(s_mem[0]))} has {g0.global_shape}, "
                    f"{src.who(int(s_mem[k]))} has {sg.global_shape}"
                )
            if sg.dtype != g0.dtype:
                raise PlanError(
                    f"dtype mismatch among source shards: {src.who(int(s_mem[0]))} is "
                    f"{g0.dtype}, {src.who(int(s_mem[k]))} is {sg.dtype}"
                )
        dim, d_start, s_start, length = tf
        gshape = g0.global_shape
        nd = len(gshape)
        by_pool: dict[str, list[int]] = {}
        for k, g in enumerate(d_geo):
            dg = dst.geos[g]
            by_pool.setdefault(dg.pool, []).append(k)
            ok = (
                dg.global_shape == gshape
                if dim < 0
                else (
                    len(dg.global_shape) == nd
                    and all(
                        a == b
                        for j, (a, b) in enumerate(zip(dg.global_shape, gshape, strict=True))
                        if j != dim
                    )
                    and s_start + length <= gshape[dim]
                    and d_start + length <= dg.global_shape[dim]
                )
            )
            if not ok:
                raise PlanError(
                    f"global shapes disagree: {dst.who(int(d_mem[k]))} has "
                    f"{dg.global_shape}, source {src.who(int(s_mem[0]))} has {gshape}"
                    + (f" (name map dim {dim}, rows {s_start}+{length})" if dim >= 0 else "")
                )
            if dg.dtype != g0.dtype:
                _check_cast(cfg, g0.dtype, dg.dtype, dst.who(int(d_mem[k])), src.who(int(s_mem[0])))
        _check_cover(src, s_mem, s_geo, "source")
        for ks in by_pool.values():
            _check_cover(
                dst,
                d_mem[ks],
                [d_geo[k] for k in ks],
                f"destination pool {dst.geos[d_geo[ks[0]]].pool!r}",
            )

        # source covers: replica positions and their local offsets per global box offset
        cover_pos: dict[tuple, list[int]] = {}
        for k, g in enumerate(s_geo):
            cover_pos.setdefault(src.geos[g].cover, []).append(k)
        sboxes = [(c, o, s) for c in cover_pos for o, s in c]
        local_of = [{b.offset: b.local_offset for b in src.geos[g].boxes} for g in s_geo]
        d = max(nd, 1)
        dboxes = [
            (k, j, b)
            for k, g in enumerate(d_geo)
            for j, b in enumerate(dst.geos[g].boxes)
            if all(b.shape)
        ]
        if not dboxes or not sboxes:
            return []
        doff = np.array([_pad(b.offset, d, 0) for _, _, b in dboxes], np.int64)
        dshp = np.array([_pad(b.shape, d, 1) for _, _, b in dboxes], np.int64)
        dloc = np.array([_pad(b.local_offset, d, 0) for _, _, b in dboxes], np.int64)
        lo, hi = doff.copy(), doff + dshp
        shift = np.zeros(d, np.int64)
        if dim >= 0:
            lo[:, dim] = np.maximum(lo[:, dim], d_start)
            hi[:, dim] = np.minimum(hi[:, dim], d_start + length)
            shift[dim] = s_start - d_start
        soff = np.array([_pad(o, d, 0) for _, o, _ in sboxes], np.int64)
        sshp = np.array([_pad(s, d, 1) for _, _, s in sboxes], np.int64)
        ilo = np.maximum((lo + shift)[:, None], soff[None])
        ihi = np.minimum((hi + shift)[:, None], (soff + sshp)[None])
        hit = (ihi > ilo).all(axis=2)
        bi, si = np.nonzero(hit)
        plo, phi = ilo[bi, si], ihi[bi, si]
        # per source box: its replica positions and their local offsets
        s_reps = [cover_pos[c] for c, _, _ in sboxes]
        nrep_s = np.array([len(x) for x in s_reps], np.int64)
        k_of = np.array([k for k, _, _ in dboxes], np.int64)
        j_of = np.array([j for _, j, _ in dboxes], np.int64)
        # klass: (destination geometry, its box, source box) -> the same block. The pool is
        # no part of it: same-geometry tensors of different pools are replicas too (one
        # pool may relay to another).
        shape_ids: dict[tuple, int] = {}
        d_shape = np.array(
            [shape_ids.setdefault(_sans_pool(dst.geos[g]), len(shape_ids)) for g in d_geo],
            np.int64,
        )
        key = (d_shape[k_of[bi]] * (int(j_of.max()) + 1) + j_of[bi]) * len(sboxes) + si
        _, klass = np.unique(key, return_inverse=True)
        klass = klass.reshape(-1)
        nklass = int(klass.max()) + 1 if klass.size else 0
        wire_of = np.array([self._wire(dst.geos[g]) for g in d_geo], np.int64)
        relayable_of = np.array(
            [dst.geos[g].storage == PLAIN and dst.geos[g].dtype == g0.dtype for g in d_geo]
        ) & (wire_of == bk.WIRE_RAW)
        esize = dtype_size(g0.dtype)
        nrep = nrep_s[si]
        out = []
        for r in np.unique(nrep).tolist():
            sel = np.flatnonzero(nrep == r)
            reps_mat = np.zeros((len(sboxes), r), np.int64)
            locs_mat = np.zeros((len(sboxes), r, d), np.int64)
            for x in np.flatnonzero(nrep_s == r).tolist():
                o = sboxes[x][1]
                reps_mat[x] = s_reps[x]
                locs_mat[x] = [_pad(local_of[q][o], d, 0) for q in s_reps[x]]
            b, sb = bi[sel], si[sel]
            dpos = k_of[b]
            reps = reps_mat[sb]
            dst_spec = d_mem_table(dst, cd)[:, dpos]
            cand = s_mem_table(src, cs)[:, reps]
            out.append(
                _Batch(
                    dst_spec=dst_spec.reshape(-1),
                    cand_spec=cand.reshape(-1, r),
                    piece=np.tile(np.arange(sel.size), cs.size),
                    dst_loc=dloc[b] + (plo[sel] - shift - doff[b]),
                    shape=phi[sel] - plo[sel],
                    rep_loc=locs_mat[sb] + (plo[sel] - soff[sb])[:, None, :],
                    wire=wire_of[dpos],
                    esize=esize,
                    ndim=nd,
                    klass=klass[sel],
                    nklass=nklass,
                    relayable=relayable_of[dpos],
                )
            )
        return out

    def _wire(self, g: _Geo) -> int:
        if self.config.sender_quantization and g.storage in (MXFP8, FP8_BLOCK):
            return WIRE_NAMES.index(g.storage)
        return bk.WIRE_RAW


def s_mem_table(side: _Side, cs: np.ndarray) -> np.ndarray:
    """[links, positions] spec indices of each link's canonical (same count for all)."""
    n = int(side.count[cs[0]])
    return side.order[side.start[cs][:, None] + np.arange(n)[None, :]]


d_mem_table = s_mem_table


def _fingerprint(model: str, src: SpecTable, dst: SpecTable, config: PlanConfig) -> str:
    """Digest of everything that shapes a plan: the layout identity (names, layouts, dtypes,
    slots, ranks, config). Not the membership epoch nor memory handles: a restart that keeps
    every layout gets the same digest, so its plan is reused."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((model, config)).encode())
    for side in (src, dst):
        h.update(b"|side|")
        side.digest_into(h)
    return h.hexdigest()


def plan_digest(
    model: str,
    sources: Sequence[TensorSpec] | SpecTable,
    destinations: Sequence[TensorSpec] | SpecTable,
    config: PlanConfig,
) -> str:
    """The key of the plan cache: changes with any layout, name, slot or config change, not
    with memory handles or the membership epoch."""
    return _fingerprint(model, _table(sources), _table(destinations), config)


def _table(specs: Sequence[TensorSpec] | SpecTable) -> SpecTable:
    return specs if isinstance(specs, SpecTable) else SpecTable.from_specs(specs)


def build_plan(
    model: str,
    epoch: int,
    sources: Sequence[TensorSpec],
    destinations: Sequence[TensorSpec],
    config: PlanConfig,
) -> Plan:
    """The whole-cluster plan; raises PlanError on inconsistent registrations."""
    return _build(
        model, epoch, SpecTable.from_specs(sources), SpecTable.from_specs(destinations), config
    )


def build_plan_from_table(
    model: str, epoch: int, sources: SpecTable, destinations: SpecTable, config: PlanConfig
) -> Plan:
    """build_plan from registrations already in columns (e.g. kept by the controller as
    workers register); the tables must not change while the plan is in use."""
    return _build(model, epoch, sources, destinations, config)


def _build(
    model: str, epoch: int, sources: SpecTable, destinations: SpecTable, config: PlanConfig
) -> Plan:
    digest = _fingerprint(model, sources, destinations, config)
    src = _side(sources, 0)
    dst = _side(destinations, len(sources))
    _group(src)
    _group(dst)
    planner = _Planner(src, dst, config)
    batches = planner.batches()
    n_src = len(sources)
    choices = [
        Choices(
            cand=planner.src_slot_idx[b.cand_spec],
            nbytes=b.shape[b.piece].prod(axis=1) * np.where(b.wire[b.piece] == 0, b.esize, 1),
            dst=planner.dst_slot_idx[b.dst_spec],
        )
        for b in batches
    ]
    cols, _ = choose_replicas(choices, planner.slots.size)
    d = max([b.dst_loc.shape[1] for b in batches], default=1)

    def padc(a: np.ndarray, fill: int) -> np.ndarray:
        if a.shape[1] == d:
            return a
        return np.concatenate([a, np.full((a.shape[0], d - a.shape[1]), fill, np.int64)], 1)

    parts = []
    group_base = 0
    for b, col in zip(batches, cols, strict=True):
        n = b.piece.size
        n_links = n // max(b.klass.size, 1)
        link = np.repeat(np.arange(n_links), b.klass.size)
        parts.append(
            (
                b.cand_spec[np.arange(n), col],
                b.dst_spec + n_src,
                padc(b.rep_loc[b.piece, col], 0),
                padc(b.dst_loc[b.piece], 0),
                padc(b.shape[b.piece], 1),
                np.full(n, b.ndim, np.int64),
                b.wire[b.piece],
                np.full(n, b.esize, np.int64),
                group_base + link * b.nklass + b.klass[b.piece],
                b.relayable[b.piece],
            )
        )
        group_base += n_links * b.nklass
    tensors = sources.specs + destinations.specs
    slot_all = np.concatenate([src.slot, dst.slot])
    if parts:
        cols_all = [np.concatenate(c) for c in zip(*parts, strict=True)]
    else:
        z = np.zeros(0, np.int64)
        cols_all = [z, z, z.reshape(0, d), z.reshape(0, d), z.reshape(0, d), z, z, z, z]
        cols_all.append(np.zeros(0, bool))
    group, relayable = cols_all[8], cols_all[9]
    n_copies = cols_all[0].size
    table = _CopyTable(*cols_all[:8], feed=np.full(n_copies, -1, np.int64), cid=np.arange(n_copies))
    _check_blocks(table, tensors)
    if config.relay and n_copies:
        _add_relays(planner, table, group, relayable, n_src)
    return Plan(
        model,
        epoch,
        digest,
        tensors,
        table,
        slot_all,
        config,
        sources_count=n_src,
        tables=(sources, destinations),
    )


def _add_relays(
    planner: _Planner, table: _CopyTable, group: np.ndarray, relayable: np.ndarray, n_src: int
) -> None:
    """Turn some copies into relays (see relay.py): their source becomes the destination
    region of their feed copy."""
    all_slot_idx = np.concatenate([planner.src_slot_idx, planner.dst_slot_idx])
    is_source = np.zeros(planner.slots.size, dtype=bool)
    is_source[planner.src_slot_idx] = True
    feed = choose_relays(
        RelayCandidates(
            src=all_slot_idx[table.src],
            dst=all_slot_idx[table.dst],
            nbytes=bk.segment_nbytes(table.wire, table.shape, table.ndim, table.esize),
            group=group,
            eligible=relayable,
        ),
        is_source,
    )
    r = np.flatnonzero(feed >= 0)
    table.feed[r] = feed[r]
    table.src[r] = table.dst[feed[r]]
    table.src_loc[r] = table.dst_loc[feed[r]]


@dataclass(slots=True)
class _Messages:
    """Copies of one kind (direct or relay), sorted and bucketed into messages."""

    copies: _CopyTable
    copy_bytes: np.ndarray  # [C]
    start: np.ndarray  # [M] first copy of each message
    end: np.ndarray  # [M]
    round: np.ndarray  # [M]
    src: np.ndarray  # [M] source slot
    dst: np.ndarray  # [M] destination slot
    nbytes: np.ndarray  # [M]
    round_of_copy: np.ndarray  # [copies before splitting] last round carrying it
    piece_key: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # sorted
    piece_round: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def need_of(self, feed: np.ndarray, step: np.ndarray | None) -> np.ndarray:
        """Round after which a relay piece may go: after the round of the feed's piece
        with the same rows (a copy cut along dim 0 is cut the same way for its relays, so
        piece k is forwarded while piece k+1 is still on the wire), else after the feed's
        last piece."""
        need = self.round_of_copy[feed] + 1
        if step is None or not self.piece_key.size:
            return need
        key = feed * PIECE_KEY + step
        i = np.minimum(np.searchsorted(self.piece_key, key), self.piece_key.size - 1)
        hit = self.piece_key[i] == key
        return np.where(hit, self.piece_round[i] + 1, need)

    def pair_last_round(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Per (src, dst) slot pair, the last round of its messages here (-1 if none)."""
        if not self.src.size:
            return np.full(src.size, -1, np.int64)
        big = int(max(self.src.max(), self.dst.max(), src.max(), dst.max())) + 1
        key = self.src * big + self.dst
        order = np.lexsort((self.round, key))
        k, r = key[order], self.round[order]
        last = np.r_[k[1:] != k[:-1], True]
        k, r = k[last], r[last]
        q = src * big + dst
        i = np.minimum(np.searchsorted(k, q), k.size - 1)
        return np.where(k[i] == q, r[i], -1)


@dataclass(slots=True)
class _CopyTable:
    """Copies as columns. feed: the copy (cid) whose destination region a relay reads, -1
    for a copy from a source tensor; cid: the copy's index before bucket splitting."""

    src: np.ndarray
    dst: np.ndarray
    src_loc: np.ndarray
    dst_loc: np.ndarray
    shape: np.ndarray
    ndim: np.ndarray
    wire: np.ndarray
    esize: np.ndarray
    feed: np.ndarray
    cid: np.ndarray

    def take(self, idx: np.ndarray) -> _CopyTable:
        return _CopyTable(*(getattr(self, f)[idx] for f in self.__slots__))


def _check_blocks(t: _CopyTable, tensors: list[TensorSpec]) -> None:
    """With a quantized wire every copy carries whole blocks of its destination."""
    q = np.flatnonzero(t.wire != bk.WIRE_RAW)
    if not q.size:
        return
    for i in q.tolist():  # few distinct tensors in practice; clarity over speed here
        nd = int(t.ndim[i])
        spec = tensors[int(t.dst[i])]
        block = (MXFP8_BLOCK,) if t.wire[i] == bk.WIRE_MXFP8 else (FP8_TILE, FP8_TILE)
        dims = list(range(nd))[-len(block) :] if nd >= 2 else list(range(nd))
        for dd in dims:
            off, n, full = int(t.dst_loc[i, dd]), int(t.shape[i, dd]), spec.local_shape[dd]
            if off % block[-1] or (n % block[-1] and off + n != full):
                raise PlanError(
                    f"quantized block not whole: copy into tensor {spec.name!r}, pool "
                    f"{spec.pool!r}, rank {spec.rank} covers [{off}, {off + n}) of dim {dd} "
                    f"(local size {full}), not whole {WIRE_NAMES[int(t.wire[i])]} blocks of "
                    f"{block[-1]}; the source layout splits a block"
                )


class Plan:
    """A whole-cluster plan: columnar copies, messages and rounds; SlotPrograms on demand."""

    def __init__(
        self,
        model: str,
        epoch: int,
        digest: str,
        tensors: list[TensorSpec],
        table: _CopyTable,
        slot_of_tensor: np.ndarray,
        config: PlanConfig,
        sources_count: int,
        tables: tuple[SpecTable, SpecTable] | None = None,
    ) -> None:
        self.model, self.epoch, self.digest, self.tensors = model, epoch, digest, tensors
        self.config = config
        self._n_src = sources_count
        self._tables = tables
        self._slot_of = slot_of_tensor
        slots = np.unique(slot_of_tensor)
        self._dense = np.searchsorted(slots, slot_of_tensor)
        s_slot = slot_of_tensor[table.src]
        d_slot = slot_of_tensor[table.dst]
        local = s_slot == d_slot
        nb = bk.segment_nbytes(table.wire, table.shape, table.ndim, table.esize)
        # local copies from source tensors first; local relays run after all receives
        lidx = np.flatnonzero(local)
        lidx = lidx[np.argsort(table.feed[lidx] >= 0, kind="stable")]
        self._local = table.take(lidx)
        local_bytes = int(nb[local].sum())
        relay = table.feed >= 0
        any_relay = bool(relay.any())
        direct = self._messages(table, nb, ~local & ~relay, slots, None, any_relay)
        relays = self._messages(table, nb, ~local & relay, slots, direct, False)
        n_direct = direct.copies.src.size
        if any_relay:
            self._remote = _CopyTable(
                *(
                    np.concatenate([getattr(direct.copies, f), getattr(relays.copies, f)])
                    for f in _CopyTable.__slots__
                )
            )
        else:
            self._remote = direct.copies
        ms = np.concatenate([direct.start, relays.start + n_direct])
        me = np.concatenate([direct.end, relays.end + n_direct])
        m_round = np.concatenate([direct.round, relays.round])
        m_src = np.concatenate([direct.src, relays.src])
        m_dst = np.concatenate([direct.dst, relays.dst])
        m_bytes = np.concatenate([direct.nbytes, relays.nbytes])
        m_order = _sort_by(m_round, m_src, m_dst)
        self._m_start, self._m_end = ms[m_order], me[m_order]
        self._m_round = m_round[m_order]
        self._m_src, self._m_dst = m_src[m_order], m_dst[m_order]
        self._m_bytes = m_bytes[m_order]
        rnb = np.concatenate([direct.copy_bytes, relays.copy_bytes])
        remote_bytes = int(rnb.sum())
        dense = self._dense
        send = np.bincount(dense[self._remote.src], weights=rnb, minlength=slots.size)
        recv = np.bincount(dense[self._remote.dst], weights=rnb, minlength=slots.size)
        is_source = np.zeros(slots.size, dtype=bool)
        is_source[dense[:sources_count]] = True
        n_src_slots = int(is_source.sum())
        src_send = send[is_source]
        ideal = float(src_send.sum()) / n_src_slots if n_src_slots else 0.0
        src_max = int(src_send.max()) if src_send.size else 0
        self.stats = PlanStats(
            copies=int(self._local.src.size + self._remote.src.size),
            local_copies=int(self._local.src.size),
            messages=int(ms.size),
            rounds=int(m_round.max()) + 1 if m_round.size else 0,
            total_bytes=remote_bytes + local_bytes,
            local_bytes=local_bytes,
            remote_bytes=remote_bytes,
            source_slots=n_src_slots,
            max_send_bytes=int(send.max()) if send.size else 0,
            ideal_send_bytes=ideal,
            send_imbalance=src_max / ideal if ideal else 1.0,
            max_recv_bytes=int(recv.max()) if recv.size else 0,
            source_max_send_bytes=src_max,
            relay_bytes=int(relays.copy_bytes.sum()),
            relay_copies=int(relays.copies.src.size),
        )
        self._send_load = send
        self._recv_load = recv
        self._all_slots = slots
        self._readers: dict[tuple[str, int], list[int]] | None = None
        self._index: ProgramIndex | None = None

    def _messages(
        self,
        table: _CopyTable,
        nb: np.ndarray,
        mask: np.ndarray,
        slots: np.ndarray,
        feeds: _Messages | None,
        need_rounds: bool,
    ) -> _Messages:
        """Split, sort and bucket the selected remote copies; rounds per message.

        Direct copies (feeds None): each source's peers over `fanout` lanes. Relays: a
        message's round is above the round of every message that wrote what it forwards
        (and above the pair's direct messages), and a pair's messages take successive
        rounds.
        """
        cfg = self.config
        rows, step, len0 = self._split(table, np.flatnonzero(mask), nb)
        rs = self._slot_of[table.src[rows]]
        rd = self._slot_of[table.dst[rows]]
        if step is None:
            rnb = nb[rows]
        else:
            shape = table.shape[rows]
            shape[:, 0] = len0
            rnb = bk.segment_nbytes(table.wire[rows], shape, table.ndim[rows], table.esize[rows])
        if feeds is None:
            order = _sort_by(rs, rd, table.dst[rows])
        else:
            need = feeds.need_of(table.feed[rows], step)
            order = _sort_by(rs, rd, need, table.dst[rows])
            need = need[order]
        t = table.take(rows[order])
        if step is not None:
            t.src_loc[:, 0] += step[order]
            t.dst_loc[:, 0] += step[order]
            t.shape[:, 0] = len0[order]
        rs, rd, rnb = rs[order], rd[order], rnb[order]
        if not rs.size:
            z = np.zeros(0, np.int64)
            return _Messages(t, rnb, z, z, z, z, z, z, np.zeros(table.src.size, np.int64))
        pair_first = np.r_[0, np.flatnonzero((np.diff(rs) != 0) | (np.diff(rd) != 0)) + 1]
        pair_end = np.r_[pair_first[1:], rs.size]
        ms, me, mp = bk.pack(pair_first, pair_end, rnb, cfg.bucket_bytes)
        p_src, p_dst = rs[pair_first], rd[pair_first]
        p_msgs = np.bincount(mp, minlength=pair_first.size)
        k = np.arange(mp.size) - (np.cumsum(p_msgs) - p_msgs)[mp]
        if feeds is None and cfg.schedule == "serial":
            m_round = bk.serial_rounds(
                self._dense[t.src[pair_first]],
                self._dense[t.dst[pair_first]],
                mp,
                np.add.reduceat(rnb, ms) if ms.size else rnb[:0],
                slots.size,
            )
        elif feeds is None:
            p_round = bk.assign_rounds(
                self._dense[t.src[pair_first]],
                self._dense[t.dst[pair_first]],
                p_msgs,
                slots.size,
                cfg.fanout,
            )
            m_round = p_round[mp] + k
        else:
            m_need = np.maximum.reduceat(need, ms)
            after = feeds.pair_last_round(p_src, p_dst) + 1
            m_round = bk.successive_rounds(np.maximum(m_need, after[mp]), mp, k)
        csum = np.r_[0, np.cumsum(rnb)]
        round_of_copy = np.zeros(table.src.size if need_rounds else 0, np.int64)
        if need_rounds:  # the last round carrying each copy (its pieces may be several)
            piece_round = np.repeat(m_round, me - ms)
            o = np.argsort(t.cid, kind="stable")
            cid = t.cid[o]
            first = np.r_[0, np.flatnonzero(np.diff(cid)) + 1]
            round_of_copy[cid[first]] = np.maximum.reduceat(piece_round[o], first)
        out = _Messages(
            t, rnb, ms, me, m_round, p_src[mp], p_dst[mp], csum[me] - csum[ms], round_of_copy
        )
        if need_rounds and step is not None:  # rounds of the pieces of cut copies
            key = t.cid * PIECE_KEY + step[order]
            o = np.argsort(key, kind="stable")
            out.piece_key, out.piece_round = key[o], piece_round[o]
        return out

    def _split(
        self, t: _CopyTable, idx: np.ndarray, nb: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Cut copies larger than a bucket along dim 0 (whole blocks when quantized):
        (the table row of every piece, its row offset along dim 0, its length there), or
        (idx, None, None) when nothing is cut."""
        nbi = nb[idx]
        big = (nbi > self.config.bucket_bytes) & (t.ndim[idx] >= 1)
        if not big.any():
            return idx, None, None
        rows = t.shape[idx, 0]
        row_bytes = nbi // np.maximum(rows, 1)
        pieces, per = bk.split_rows(
            rows,
            row_bytes,
            bk.split_granularity(t.wire[idx], t.ndim[idx]),
            self.config.bucket_bytes,
        )
        pieces = np.where(big, pieces, 1)
        rep = np.repeat(np.arange(idx.size), pieces)
        k = np.arange(rep.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        step = np.where(big, per, 0)[rep] * k
        len0 = np.where(big[rep], np.minimum(per[rep], rows[rep] - step), rows[rep])
        return idx[rep], step, len0

    def slots(self) -> list[int]:
        """Every slot that holds a registered tensor (source or destination)."""
        return self._all_slots.tolist()

    def source_slots_of(self, pool: str, rank: int) -> list[int]:
        """Slots that read the tensors of source worker (pool, rank); relays, which read
        destination tensors, don't count. Computed for all workers on the first call."""
        if self._readers is None:
            used = np.unique(np.concatenate([self._remote.src, self._local.src]))
            used = used[used < self._n_src]
            readers: dict[tuple[str, int], set[int]] = {}
            for i, slot in zip(used.tolist(), self._slot_of[used].tolist(), strict=True):
                t = self.tensors[i]
                readers.setdefault((t.pool, t.rank), set()).add(slot)
            self._readers = {k: sorted(v) for k, v in readers.items()}
        return list(self._readers.get((pool, rank), []))

    def message_columns(self) -> dict[str, np.ndarray]:
        """Every remote message as columns, row = message id: src and dst slot, round, wire
        bytes, relay (it forwards received blocks). For tools such as the link model."""
        return {
            "src": self._m_src.copy(),
            "dst": self._m_dst.copy(),
            "round": self._m_round.copy(),
            "nbytes": self._m_bytes.copy(),
            "relay": self._remote.feed[self._m_start] >= 0,
        }

    def send_bytes(self) -> dict[int, int]:
        """Remote bytes each slot sends."""
        return {int(s): int(b) for s, b in zip(self._all_slots, self._send_load, strict=True)}

    def recv_bytes(self) -> dict[int, int]:
        """Remote bytes each slot receives."""
        return {int(s): int(b) for s, b in zip(self._all_slots, self._recv_load, strict=True)}

    @property
    def source_count(self) -> int:
        """`tensors[:source_count]` are source specs, the rest destination specs."""
        return self._n_src

    def program_index(self) -> ProgramIndex:
        """Per-slot positions of all messages and copies, built once per plan."""
        if self._index is None:
            tables = self._tables or (
                SpecTable.from_specs(self.tensors[: self._n_src]),
                SpecTable.from_specs(self.tensors[self._n_src :]),
            )
            counts = (self._n_src, len(self.tensors) - self._n_src)
            tensors = PlanTensors.of(tables, counts, self._slot_of, self._remote.shape.shape[1])
            d = tensors.local_shape.shape[1]

            def cols(t: _CopyTable) -> CopyCols:
                def pad(a: np.ndarray, fill: int) -> np.ndarray:
                    extra = d - a.shape[1]
                    return (
                        a if extra <= 0 else np.pad(a, ((0, 0), (0, extra)), constant_values=fill)
                    )

                return CopyCols(
                    t.src,
                    t.dst,
                    pad(t.src_loc, 0),
                    pad(t.dst_loc, 0),
                    pad(t.shape, 1),
                    t.ndim,
                    t.wire,
                )

            msgs = Messages(
                self._m_round,
                self._m_src,
                self._m_dst,
                self._m_start,
                self._m_end,
                self._m_bytes,
            )
            self._index = ProgramIndex(
                self.digest, cols(self._remote), cols(self._local), msgs, tensors
            )
        return self._index

    def program(self, slot: int) -> SlotProgram:
        """What the transfer process of `slot` executes (columns), messages ordered by
        (round, id)."""
        return self.program_index().program(slot)

    def programs(self, slots: Sequence[int] | None = None) -> dict[int, SlotProgram]:
        """The programs of `slots` (default: every slot), from one index pass."""
        index = self.program_index()
        return {s: index.program(s) for s in (self.slots() if slots is None else slots)}
