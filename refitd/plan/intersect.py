"""Box intersection: every (source box -> destination box) block of linked canonicals.

Links (names.resolve_links: name maps, tied embeddings) pair source and destination
canonical tensors; links whose two sides share geometry patterns are intersected once
(_pattern) and the result repeated per link, one Batch per source replica count.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import numpy as np

from refitd.plan.checks import check_cast, check_cover
from refitd.plan.config import PlanConfig
from refitd.plan.errors import PlanError
from refitd.plan.grouping import dense_index, unique_groups
from refitd.plan.names import Link, resolve_links
from refitd.plan.sides import Side, member_table
from refitd.plan.table import Geo
from refitd.plan.wire import PLAIN, RAW_CODE, dtype_size


@dataclass(slots=True)
class Batch:
    """Copies of one pattern group with the same replica count, before replica choice."""

    dst_spec: np.ndarray  # [N], N = L links x P pieces, link-major
    link_src: np.ndarray  # [L, M] source spec at each member position, per link
    cand_pos: np.ndarray  # [P, R] member positions holding each piece's replicas
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

    def chosen_src(self, col: np.ndarray) -> np.ndarray:
        """[N] source spec of every copy, given the chosen candidate column per copy."""
        link = np.arange(self.piece.size) // max(self.cand_pos.shape[0], 1)
        return self.link_src[link, self.cand_pos[self.piece, col]]


def _pad(t: tuple[int, ...], d: int, fill: int) -> list[int]:
    return list(t) + [fill] * (d - len(t))


class BoxIntersector:
    """One plan build's box intersection: slots, name links, the intersected blocks per
    pattern (one Batch per replica count) and their wires; owns the intermediate columns."""

    def __init__(self, src: Side, dst: Side, config: PlanConfig) -> None:
        self.src, self.dst, self.config = src, dst, config
        self.slot_of = np.concatenate([src.slot, dst.slot])
        self.slots, self.dense = dense_index(self.slot_of)
        self.src_slot_idx = self.dense[: src.slot.size]
        self.dst_slot_idx = self.dense[src.slot.size :]

    def links(self) -> tuple[np.ndarray, list[tuple[int, int, int, int]], list[Link]]:
        """(rows of (source canonical id, destination canonical id, transform id), the
        transforms, the links that are not plain same-name links). A destination name
        registered in the source and not named by the name map links to itself without
        going through resolve_links (the common case, kept columnar)."""
        dst_names = list(self.dst.names)
        rules = self.config.name_map.index() if self.config.name_map is not None else {}
        n = len(dst_names)
        sid = np.fromiter(map(self.src.names.get, dst_names, repeat(-1, n)), np.int64, n)
        for d in rules:
            if d in self.dst.names:
                sid[self.dst.names[d]] = -1
        plain = sid >= 0
        slow = np.flatnonzero(~plain).tolist()
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
        ids = np.flatnonzero(plain)
        fast = np.stack([sid[ids], ids, np.zeros(ids.size, np.int64)], axis=1)
        lk = np.concatenate([fast, np.array(rows, dtype=np.int64).reshape(-1, 3)])
        return lk, list(tmap), links

    def batches(self) -> list[Batch]:
        lk, transforms, links = self.links()
        self._check_rules(links)
        n_dp, n_t = int(self.dst.pattern.max()) + 1, len(transforms)
        key = (self.src.pattern[lk[:, 0]] * n_dp + self.dst.pattern[lk[:, 1]]) * n_t + lk[:, 2]
        _, _, grp = unique_groups(key)
        order = np.argsort(grp, kind="stable")
        cuts = np.flatnonzero(np.diff(grp[order])) + 1
        out: list[Batch] = []
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
    ) -> list[Batch]:
        """Intersections for a group of links sharing geometry; one batch per replica count."""
        s_mem = self.src.members(int(cs[0]))
        d_mem = self.dst.members(int(cd[0]))
        s_geo = self.src.geo[s_mem].tolist()
        d_geo = self.dst.geo[d_mem].tolist()
        self._check_pattern(s_mem, d_mem, s_geo, d_geo, tf)
        hits = _Hits.of(self.src, self.dst, s_geo, d_geo, tf)
        if hits is None:
            return []
        return self._batches(hits, cs, cd, s_geo, d_geo)

    def _check_pattern(
        self,
        s_mem: np.ndarray,
        d_mem: np.ndarray,
        s_geo: list[int],
        d_geo: list[int],
        tf: tuple[int, int, int, int],
    ) -> None:
        """Shapes and dtypes agree across shards and sides, casts are allowed, and each
        side's boxes tile the global tensor."""
        src, dst, cfg = self.src, self.dst, self.config
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
                check_cast(cfg, g0.dtype, dg.dtype, dst.who(int(d_mem[k])), src.who(int(s_mem[0])))
        check_cover(src, s_mem, s_geo, "source")
        for ks in by_pool.values():
            check_cover(
                dst,
                d_mem[ks],
                [d_geo[k] for k in ks],
                f"destination pool {dst.geos[d_geo[ks[0]]].pool!r}",
            )

    def _batches(
        self, h: _Hits, cs: np.ndarray, cd: np.ndarray, s_geo: list[int], d_geo: list[int]
    ) -> list[Batch]:
        """The hits repeated for every link of the group, one Batch per replica count."""
        src, dst = self.src, self.dst
        g0 = src.geos[s_geo[0]]
        d = h.doff.shape[1]
        local_of = [{b.offset: b.local_offset for b in src.geos[g].boxes} for g in s_geo]
        wire_of = np.array([self._wire(dst.geos[g], g0.dtype) for g in d_geo], np.int64)
        relayable_of = np.array(
            [dst.geos[g].storage == PLAIN and dst.geos[g].dtype == g0.dtype for g in d_geo]
        ) & (wire_of == RAW_CODE)
        esize = dtype_size(g0.dtype)
        nrep_s = np.array([len(x) for x in h.s_reps], np.int64)
        nrep = nrep_s[h.si]
        out = []
        for r in np.unique(nrep).tolist():
            sel = np.flatnonzero(nrep == r)
            reps_mat = np.zeros((len(h.s_reps), r), np.int64)
            locs_mat = np.zeros((len(h.s_reps), r, d), np.int64)
            for x in np.flatnonzero(nrep_s == r).tolist():
                reps_mat[x] = h.s_reps[x]
                locs_mat[x] = [_pad(local_of[q][h.s_origin[x]], d, 0) for q in h.s_reps[x]]
            b, sb = h.bi[sel], h.si[sel]
            dpos = h.k_of[b]
            plo = h.plo[sel]
            out.append(
                Batch(
                    dst_spec=member_table(dst, cd)[:, dpos].reshape(-1),
                    link_src=member_table(src, cs),
                    cand_pos=reps_mat[sb],
                    piece=np.tile(np.arange(sel.size), cs.size),
                    dst_loc=h.dloc[b] + (plo - h.shift - h.doff[b]),
                    shape=h.phi[sel] - plo,
                    rep_loc=locs_mat[sb] + (plo - h.soff[sb])[:, None, :],
                    wire=wire_of[dpos],
                    esize=esize,
                    ndim=len(g0.global_shape),
                    klass=h.klass[sel],
                    nklass=h.nklass,
                    relayable=relayable_of[dpos],
                )
            )
        return out

    def _wire(self, g: Geo, src_dtype: str) -> int:
        """The wire code of copies into a destination of geometry g: with sender
        quantization, the registered wire whose parts its storage keeps (if that wire
        takes the source dtype), else raw."""
        wires = self.config.wires
        if self.config.sender_quantization:
            code = wires.for_storage(g.storage)
            if code is not None and wires.formats[code].accepts(src_dtype):
                return code
        return RAW_CODE


@dataclass(slots=True)
class _Hits:
    """Every (destination box, source box) pair of a pattern that overlaps, in global
    coordinates padded to d dims: bi/si index the destination/source boxes, [plo, phi) the
    overlap (in source coordinates: shifted by `shift` under a name-map part)."""

    doff: np.ndarray  # [B, d] destination box offsets
    dloc: np.ndarray  # [B, d] their local offsets
    soff: np.ndarray  # [S, d] source box offsets
    shift: np.ndarray  # [d]
    bi: np.ndarray
    si: np.ndarray
    plo: np.ndarray
    phi: np.ndarray
    k_of: np.ndarray  # [B] destination position of each destination box
    s_reps: list[list[int]]  # [S] source positions holding each source box
    s_origin: list[tuple[int, ...]]  # [S] each source box's global offset
    klass: np.ndarray  # per hit: equal for the same block into replica tensors
    nklass: int

    @staticmethod
    def of(
        src: Side, dst: Side, s_geo: list[int], d_geo: list[int], tf: tuple[int, int, int, int]
    ) -> _Hits | None:
        """The overlaps of a pattern, None when either side has no non-empty box."""
        dim, d_start, s_start, length = tf
        nd = len(src.geos[s_geo[0]].global_shape)
        # source covers: replica positions per distinct cover, one entry per cover box
        cover_of = {g: src.geos[g].cover for g in set(s_geo)}  # a few geometries
        cover_pos: dict[tuple, list[int]] = {}
        for k, g in enumerate(s_geo):
            cover_pos.setdefault(cover_of[g], []).append(k)
        sboxes = [(c, o, s) for c in cover_pos for o, s in c]
        d = max(nd, 1)
        dboxes = [
            (k, j, b)
            for k, g in enumerate(d_geo)
            for j, b in enumerate(dst.geos[g].boxes)
            if all(b.shape)
        ]
        if not dboxes or not sboxes:
            return None
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
        k_of = np.array([k for k, _, _ in dboxes], np.int64)
        j_of = np.array([j for _, j, _ in dboxes], np.int64)
        # klass: (destination geometry, its box, source box) -> the same block. The pool is
        # no part of it: same-geometry tensors of different pools are replicas too (one
        # pool may relay to another).
        shape_ids: dict[tuple, int] = {}
        d_shape = np.array(
            [shape_ids.setdefault(dst.geos[g].sans_pool(), len(shape_ids)) for g in d_geo],
            np.int64,
        )
        key = (d_shape[k_of[bi]] * (int(j_of.max()) + 1) + j_of[bi]) * len(sboxes) + si
        _, klass = np.unique(key, return_inverse=True)
        klass = klass.reshape(-1)
        return _Hits(
            doff=doff,
            dloc=dloc,
            soff=soff,
            shift=shift,
            bi=bi,
            si=si,
            plo=ilo[bi, si],
            phi=ihi[bi, si],
            k_of=k_of,
            s_reps=[cover_pos[c] for c, _, _ in sboxes],
            s_origin=[o for _, o, _ in sboxes],
            klass=klass,
            nklass=int(klass.max()) + 1 if klass.size else 0,
        )
