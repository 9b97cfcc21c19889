"""Relays: destination replicas forward blocks they received to other destination replicas.

A destination pool often holds several replicas of a tensor (DP, expert-DP); without relays
the source slot feeding a block sends one copy per replica, so the source slots with the
most layers (uneven PP stages) or the embedding set the pace. With relays a copy may instead
be read from a destination replica that received the same block directly from a source
(depth 1: a relay never forwards a relayed block), so source slots shed bytes onto the
otherwise idle send links of the destination slots. In collocated layouts a destination
slot is also a source slot: it relays only within what keeps it at the common level (its
local copies leave it room), and a plan whose busiest source slot would send more than
without relays keeps no relays (counted per copy: buckets far below a copy's size cut it
into pieces whose alignment padding the count does not see).

Policy: the source slots are levelled down to a common send level T, the smallest level at
which the destination slots can absorb the shed bytes without sending more than a source
slot does (their relay sends stay at most the resulting ideal source send, or T for a slot
that is also a source); every block
keeps at least one direct copy (from its least loaded source); relay senders are chosen
among a block's direct replicas by the same water-filling as source replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refitd.plan.balance import Choices, choose_replicas
from refitd.plan.grouping import dense_index, sum_before_in_runs, unique_groups
from refitd.plan.sides import sort_by

# Share of the destination slots' relay capacity the level may count on: the water-filling
# over each block's few direct replicas cannot spread bytes perfectly.
_CAPACITY_SHARE = 0.98
_SEARCH_STEPS = 48
_TINY_SHARE = 1e-4


@dataclass(slots=True)
class RelayCandidates:
    """Copies after source replica choice (dense slot indices)."""

    src: np.ndarray  # [N] slot of the chosen source
    dst: np.ndarray  # [N] slot of the destination
    nbytes: np.ndarray  # [N] wire bytes
    group: np.ndarray  # [N] equal: the same global block into the same local region of
    #                    same-geometry destination tensors (replicas of each other)
    eligible: np.ndarray  # [N] bool: raw wire, plain storage, same dtype on both ends
    # [N] destination pool order (first registered: 0) when pools chain: the direct copy of
    # a block stays with a member of its group's first pool, the later pools are relayed to
    chain_pool: np.ndarray | None = None
    # copies each direct copy stands for: one per identical pool it is stamped onto
    # (stamp.py); their sources send it `fan` times, each pool relays its own
    fan: int = 1


def choose_relays(c: RelayCandidates, is_source_slot: np.ndarray) -> np.ndarray:
    """Per copy, the index of the copy whose destination region it forwards (its feed), or
    -1 when it stays a direct copy from its source."""
    n_slots = is_source_slot.size
    feed = np.full(c.src.size, -1, dtype=np.int64)
    remote = c.src != c.dst
    load = c.fan * np.bincount(c.src[remote], weights=c.nbytes[remote], minlength=n_slots)
    # a slot that also holds source tensors neither relays nor is relayed to: its send
    # link is a trainer link
    # copies under 1/10^4 of the mean source send move the level by nothing measurable
    # but would cost a water-filling run each (e.g. norms replicated on every slot)
    mean = load[load > 0].mean() / c.fan if load.any() else -1.0
    tiny = c.nbytes < _TINY_SHARE * mean
    cand = np.flatnonzero(remote & c.eligible & ~tiny)
    if cand.size < 2:
        return feed
    g = _Groups.of(c, cand)
    keeper, conv, shed = _keepers_and_shed(c, g, load, is_source_slot)
    if not conv.size:
        return feed
    selected = _shed_copies(c, g, keeper, conv, shed / c.fan)
    if not selected.any():
        return feed
    _relay_senders(c, g, selected, load, is_source_slot, feed)
    return feed


@dataclass(slots=True)
class _Groups:
    """Candidate copies sorted by group: gid per candidate, each group's count and start;
    multi: the candidate's group has at least two members (something to relay)."""

    cand: np.ndarray
    gid: np.ndarray
    gcount: np.ndarray
    gstart: np.ndarray
    multi: np.ndarray

    @staticmethod
    def of(c: RelayCandidates, cand: np.ndarray) -> _Groups:
        cand = cand[np.argsort(c.group[cand], kind="stable")]
        g = c.group[cand]
        first = np.r_[True, g[1:] != g[:-1]]
        gid = np.cumsum(first) - 1
        gcount = np.bincount(gid)
        gstart = np.cumsum(gcount) - gcount
        return _Groups(cand, gid, gcount, gstart, gcount[gid] >= 2)


def _keepers_and_shed(
    c: RelayCandidates, g: _Groups, load: np.ndarray, is_source_slot: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keeper mask over the candidates, the convertible copies, the bytes each slot sheds).

    One member of each group stays direct (the keeper, a relay sender); keepers are
    water-filled over the members' destination slots by the bytes each group is expected
    to relay: first as if every other member were relayed, then with each source's shed
    fraction at the chosen level."""
    n_slots = is_source_slot.size
    hub = np.zeros(n_slots, dtype=bool)
    hub[c.dst[g.cand[g.multi]]] = True
    weight = c.nbytes[g.cand].astype(np.float64)
    may_keep = _may_keep(c, g)
    level = 0.0
    for step in range(2):
        keeper = _keepers(c, g, may_keep, weight, load)
        conv = g.cand[g.multi & ~keeper]
        conv_bytes = c.fan * np.bincount(c.src[conv], weights=c.nbytes[conv], minlength=n_slots)
        if step == 0:
            level = _level(load, conv_bytes, is_source_slot, hub, c.fan)
            shed = np.clip(load - level, 0, conv_bytes)
            # in 1/16 steps: few distinct weights keep the water-filling runs few
            frac = np.ceil(16 * shed / np.maximum(conv_bytes, 1)) / 16
            weight = c.nbytes[g.cand] * frac[c.src[g.cand]]
    return keeper, conv, np.clip(load - level, 0, conv_bytes)


def _shed_copies(
    c: RelayCandidates, g: _Groups, keeper: np.ndarray, conv: np.ndarray, shed: np.ndarray
) -> np.ndarray:
    """Mask over all copies: those that become relays. Per source slot, a prefix of its
    convertible copies up to its shed bytes: first one member of every group, then a
    second one..., groups in a hashed order, so every keeper relays alike."""
    gid = g.gid
    pos = np.arange(g.cand.size) - g.gstart[gid]
    nth = np.empty(c.src.size, dtype=np.int64)
    kpos = np.full(g.gcount.size, -1, dtype=np.int64)
    kpos[gid[keeper]] = pos[keeper]
    rank = pos - (pos > kpos[gid])
    nth[g.cand] = (rank + gid) % np.maximum(g.gcount[gid] - 1, 1)  # rotated: no replica first
    src, nth_c, nb = c.src[conv], nth[conv], c.nbytes[conv]
    # buckets of (source, nth), numbered in that order by counting (no sort of the
    # copies): those wholly below a source's shed bytes are all taken, those wholly above
    # none; only the copies of the bucket astride it need their order
    n_nth = int(nth_c.max()) + 1
    keys, bucket = dense_index(src * n_nth + nth_c)
    b_src = keys // n_nth
    b_bytes = np.bincount(bucket, weights=nb).astype(np.int64)  # exact below 2**53 bytes
    b_before = sum_before_in_runs(b_bytes, np.r_[True, b_src[1:] != b_src[:-1]])
    limit = shed[b_src] - 0.5
    selected = np.zeros(c.src.size, dtype=bool)
    selected[conv[(b_before + b_bytes < limit)[bucket]]] = True
    astride = (b_before < limit) & (b_before + b_bytes >= limit)
    part = np.flatnonzero(astride[bucket])
    if part.size:
        part_conv = conv[part]
        mix = _hashed(c.group[part_conv])
        fine = sort_by(src[part], nth_c[part], mix, part_conv, unique=True)
        part, part_conv = part[fine], part_conv[fine]
        bk = bucket[part]
        before = b_before[bk] + sum_before_in_runs(nb[part], np.r_[True, bk[1:] != bk[:-1]])
        selected[part_conv[before < limit[bk]]] = True
    return selected


def _hashed(group: np.ndarray) -> np.ndarray:
    """A 24-bit hash of each group id: groups in a hashed order."""
    return ((group.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)).astype(
        np.int64
    )


def _relay_senders(
    c: RelayCandidates,
    g: _Groups,
    selected: np.ndarray,
    load: np.ndarray,
    is_source_slot: np.ndarray,
    feed: np.ndarray,
) -> None:
    """Fill `feed` for the selected copies: each one's relay sender is water-filled over its
    group's direct members; nothing is relayed if a source slot would end up sending more."""
    n_slots = is_source_slot.size
    sel_mask = selected[g.cand]
    direct = g.multi & ~sel_mask
    dcount = np.bincount(g.gid[direct], minlength=g.gcount.size)
    dstart = np.cumsum(dcount) - dcount
    direct_list = g.cand[direct]
    sel = g.cand[sel_mask]
    sel_gid = g.gid[sel_mask]
    r_of = dcount[sel_gid]
    shed_load = load - c.fan * np.bincount(c.src[sel], weights=c.nbytes[sel], minlength=n_slots)
    batches: list[Choices] = []
    starts: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    # one batch per direct member count r, its copies in candidate order; the copies of a
    # group share one candidate set (the group's direct members' slots): [groups, r], not
    # [copies, r], which at thousands of replicas is quadratic in them
    by_r = np.argsort(r_of, kind="stable")
    cuts = np.flatnonzero(np.diff(r_of[by_r])) + 1
    for pick in np.split(by_r, cuts):
        r = int(r_of[pick[0]])
        groups, group_row = unique_groups(sel_gid[pick])[::2]
        first = dstart[groups]
        sets = c.dst[direct_list[first[:, None] + np.arange(r)[None, :]]]
        batches.append(Choices(sets, group_row, c.nbytes[sel[pick]], c.dst[sel[pick]]))
        starts.append(first[group_row])
        rows.append(sel[pick])
    cols, after = choose_replicas(batches, n_slots, shed_load)
    for start, idx, col in zip(starts, rows, cols, strict=True):
        feed[idx] = direct_list[start + col]
    if after[is_source_slot].max(initial=0) > load[is_source_slot].max(initial=0):
        feed[:] = -1  # relay senders that also send as sources could not absorb it


def _may_keep(c: RelayCandidates, g: _Groups) -> np.ndarray:
    """Mask over g.cand: the members that may keep their group's direct copy (all, or
    with chained pools those of the group's first pool)."""
    if c.chain_pool is None:
        return np.ones(g.cand.size, dtype=bool)
    pool = c.chain_pool[g.cand]
    return pool == np.minimum.reduceat(pool, g.gstart)[g.gid]


def _keepers(
    c: RelayCandidates, g: _Groups, may_keep: np.ndarray, weight: np.ndarray, load: np.ndarray
) -> np.ndarray:
    """Mask over g.cand (grouped): the member of each group that stays direct, chosen
    among those that `may_keep` by water-filling each group's expected relay bytes (its
    members' weights less one member's share) over their destination slots, on top of
    their own sends."""
    keeper = np.zeros(g.cand.size, dtype=bool)
    total = np.bincount(g.gid, weights=weight, minlength=g.gcount.size)
    ok = np.flatnonzero(may_keep)
    n_ok = np.bincount(g.gid[ok], minlength=g.gcount.size)
    ok_start = np.cumsum(n_ok) - n_ok
    batches: list[Choices] = []
    rows: list[np.ndarray] = []
    multi = g.gcount >= 2
    for r in np.unique(n_ok[multi]).tolist():
        gs = np.flatnonzero(multi & (n_ok == r))
        pos = ok[ok_start[gs][:, None] + np.arange(r)[None, :]]
        n = g.gcount[gs]
        nbytes = np.rint(total[gs] * (n - 1) / n).astype(np.int64)
        batches.append(Choices.of_rows(c.dst[g.cand[pos]], nbytes, np.full(gs.size, -1)))
        rows.append(pos)
    cols, _ = choose_replicas(batches, load.size, load)
    for pos, col in zip(rows, cols, strict=True):
        keeper[pos[np.arange(pos.shape[0]), col]] = True
    return keeper


def _level(
    load: np.ndarray, conv: np.ndarray, is_source: np.ndarray, hub: np.ndarray, fan: int
) -> float:
    """The lowest common send level of the source slots whose shed bytes the relay-capable
    destination slots can absorb while sending no more than a source slot; never below what
    a source slot cannot shed. `fan`: the hubs stand for as many identical pools, each
    relaying its share."""
    n_src = max(int(is_source.sum()), 1)

    def feasible(t: float) -> bool:
        shed = np.clip(load - t, 0, conv)
        after = load - shed
        ideal = after[is_source].sum() / n_src
        cap = np.clip(np.where(is_source, t, ideal) - after, 0, None)[hub].sum()
        return bool(shed.sum() <= _CAPACITY_SHARE * cap * fan)

    lo, hi = 0.0, float(load.max(initial=0.0))
    for _ in range(_SEARCH_STEPS):
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    floor = float((load - conv)[is_source].max(initial=0.0))
    return max(hi, floor)
