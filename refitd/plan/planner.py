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
which). Convention on top of refitd.plan.program:
- a relay Copy's src_tensor is the plan index of a DESTINATION tensor held on the sending
  slot, reading a region that an earlier message to that slot wrote in full; relays are
  raw wire, between plain-storage destinations of the same dtype, never forwarded again;
- a message with relay copies has a round strictly greater than the round of every message
  whose data it forwards. Executor rule: before packing such a message the slot completes
  all its receives of smaller rounds; local copies whose src_tensor is a destination
  tensor (listed after the others in SlotProgram.local) run after all receives completed;
- a trainer rank's sources are released once every copy reading a source tensor is done;
  relays don't count (`source_slots_of` lists only slots reading source tensors).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refitd.plan.balance import Choices, choose_replicas, unique_rows
from refitd.plan.checks import check_blocks, check_whole_tensors
from refitd.plan.config import PlanConfig
from refitd.plan.copies import CopyTable
from refitd.plan.digest import fingerprint, plan_digest
from refitd.plan.errors import PlanError
from refitd.plan.intersect import Batch, BoxIntersector
from refitd.plan.layout import TensorSpec
from refitd.plan.plan import Plan, PlanStats
from refitd.plan.relay import RelayCandidates, choose_relays
from refitd.plan.rowwise import row_prod
from refitd.plan.sides import Side, group, side_of
from refitd.plan.stamp import PoolStamp
from refitd.plan.stamp_schedule import PoolSlots
from refitd.plan.table import JoinedSpecs, SpecTable

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
    model: str,
    epoch: int,
    sources: SpecTable,
    destinations: SpecTable,
    config: PlanConfig,
    digest: str | None = None,
) -> Plan:
    """build_plan from registrations already in columns (e.g. kept by the controller as
    workers register); the tables must not change while the plan is in use. `digest`: the
    plan_digest of these inputs when the caller has it already (not computed again)."""
    return _build(model, epoch, sources, destinations, config, digest)


def _build(
    model: str,
    epoch: int,
    sources: SpecTable,
    destinations: SpecTable,
    config: PlanConfig,
    digest: str | None = None,
) -> Plan:
    if digest is None:
        digest = fingerprint(model, sources, destinations, config)
    tensors = JoinedSpecs(sources, destinations)
    table, slot_of, stamped, pools = _copies(sources, destinations, tensors, config)
    return Plan(
        model,
        epoch,
        digest,
        tensors,
        table,
        slot_of,
        config,
        sources_count=len(sources),
        pools_stamped=stamped,
        tables=(sources, destinations),
        pools=pools,
    )


def _copies(
    sources: SpecTable,
    destinations: SpecTable,
    tensors: Sequence[TensorSpec],
    config: PlanConfig,
) -> tuple[CopyTable, np.ndarray, int, PoolSlots | None]:
    """(every copy of the plan, relays chosen; the slot of every plan tensor; how many
    destination pools were stamped from one plan, 0: none; their slots where every pool
    reads the same sources, for stamping the schedule too); `tensors`:
    the sides' specs in plan index order. Identical destination pools are planned once
    and stamped (stamp.py) unless relays within a pool would shed clearly less than
    relays across pools. The intersections and choices die here, before the Plan buckets
    the copies: a third of the peak memory at 1,024 ranks, which a fresh plan would fault
    in again."""
    src = side_of(sources, 0)
    dst = side_of(destinations, len(sources))
    stamp = None
    if config.stamp_pools and not config.relay_chain:
        stamp = PoolStamp.of(destinations, dst, src.slot, config.stamp_min_specs)
    if stamp is not None:
        stamped = _side_copies(src, dst, tensors, config, stamp)
        if stamped is not None:
            return stamped
    out = _side_copies(src, dst, tensors, config, None)
    assert out is not None
    return out


def _side_copies(
    src: Side, dst: Side, tensors: Sequence[TensorSpec], config: PlanConfig, stamp: PoolStamp | None
) -> tuple[CopyTable, np.ndarray, int, PoolSlots | None] | None:
    """_copies of the whole destination side, or of its first pool stamped onto the
    others (None: the stamped sources would send too much, PoolStamp.sheds_enough)."""
    n_src = dst.base
    first = dst if stamp is None else stamp.first_side(dst)
    group(src)
    group(first)
    intersector = BoxIntersector(src, first, config)
    batches = intersector.batches()
    choices = [_choices(b, intersector, config) for b in batches]
    cols, _ = choose_replicas(choices, intersector.slots.size)
    del choices
    table, group_of, relayable = _copy_table(batches, cols, n_src)
    rotated = None
    if stamp is not None and not config.relay:
        rotated = stamp.sources(batches, cols)
    del batches, cols
    check_whole_tensors(table, first, config.wires)
    if config.relay and table.src.size:
        fan = 1 if stamp is None else stamp.pools
        _add_relays(intersector, table, group_of, relayable, n_src, fan)
        if stamp is not None:
            nbytes = config.wires.segment_nbytes(table.wire, table.shape, table.ndim, table.esize)
            if not stamp.sheds_enough(table, nbytes, first, src):
                return None
    del group_of, relayable
    pools = None
    if stamp is not None:
        if rotated is None:  # every pool reads the first pool's sources: one schedule
            pools = stamp.pool_slots(dst, table.src.size)
        table = stamp.stamp(table, n_src, rotated)
    check_blocks(table, tensors, config.wires)  # stamped: the first pool's, as all pools
    stamped = 0 if stamp is None else stamp.pools
    return table, np.concatenate([src.slot, dst.slot]), stamped, pools


def _choices(b: Batch, intersector: BoxIntersector, config: PlanConfig) -> Choices:
    """A batch's copies for replica choice: links whose members sit on the same slots
    share their candidate sets, and so do pieces read from the same source box (one set
    per such link class and distinct candidate row: a replicated tensor's thousands of
    pieces have a few)."""
    slots, link_cls = unique_rows(intersector.src_slot_idx[b.link_src])
    cand, piece_row = unique_rows(b.cand_pos)
    p = cand.shape[0]
    return Choices(
        sets=slots[:, cand].reshape(-1, b.cand_pos.shape[1]),
        cls=(link_cls.reshape(-1, 1) * p + piece_row).reshape(-1),
        nbytes=row_prod(np.take(b.shape, b.piece, axis=0))
        * config.wires.element_bytes(b.wire[b.piece], b.esize),
        dst=intersector.dst_slot_idx[b.dst_spec],
    )


def _copy_table(
    batches: list[Batch], cols: list[np.ndarray], n_src: int
) -> tuple[CopyTable, np.ndarray, np.ndarray]:
    """The chosen copies of every batch as one table: (the table, each copy's replica
    group (the same block into replica tensors), whether it may be relayed). Each batch
    is written into the table's columns where it goes (no per-batch column copied again:
    at 4,096 ranks the table is millions of rows)."""
    d = max([b.dst_loc.shape[1] for b in batches], default=1)
    n_copies = sum(b.piece.size for b in batches)
    src, dst, group_of = (np.empty(n_copies, np.int64) for _ in range(3))
    src_loc, dst_loc = np.zeros((n_copies, d), np.int64), np.zeros((n_copies, d), np.int64)
    shape = np.ones((n_copies, d), np.int64)
    ndim, wire, esize = (np.empty(n_copies, np.int8) for _ in range(3))
    relayable = np.empty(n_copies, bool)
    at = group_base = 0
    for b, col in zip(batches, cols, strict=True):
        n = b.piece.size
        rows, w = slice(at, at + n), b.dst_loc.shape[1]
        n_links = n // max(b.klass.size, 1)
        link = np.repeat(np.arange(n_links), b.klass.size)
        src[rows] = b.chosen_src(col)
        np.add(b.dst_spec, n_src, out=dst[rows])
        src_loc[rows, :w] = b.rep_loc[b.piece, col]
        for out, column in ((dst_loc, b.dst_loc), (shape, b.shape)):
            if w == d:  # contiguous rows: gathered in place
                np.take(column, b.piece, axis=0, out=out[rows], mode="clip")
            else:
                out[rows, :w] = np.take(column, b.piece, axis=0)
        ndim[rows], esize[rows] = b.ndim, b.esize
        wire[rows] = b.wire[b.piece]
        group_of[rows] = group_base + link * b.nklass + b.klass[b.piece]
        relayable[rows] = b.relayable[b.piece]
        group_base += n_links * b.nklass
        at += n
    feed = np.full(n_copies, -1, np.int64)
    table = CopyTable(
        src, dst, src_loc, dst_loc, shape, ndim, wire, esize, feed, np.arange(n_copies)
    )
    return table, group_of, relayable


def _add_relays(
    intersector: BoxIntersector,
    table: CopyTable,
    group: np.ndarray,
    relayable: np.ndarray,
    n_src: int,
    fan: int,
) -> None:
    """Turn some copies into relays (see relay.py): their source becomes the destination
    region of their feed copy."""
    chain_pool = None
    if intersector.config.relay_chain:
        order: dict[str, int] = {}
        pool_of_geo = np.array(
            [order.setdefault(g.pool, len(order)) for g in intersector.dst.geos], np.int64
        )
        chain_pool = pool_of_geo[intersector.dst.geo[table.dst - n_src]]
    all_slot_idx = np.concatenate([intersector.src_slot_idx, intersector.dst_slot_idx])
    is_source = np.zeros(intersector.slots.size, dtype=bool)
    is_source[intersector.src_slot_idx] = True
    feed = choose_relays(
        RelayCandidates(
            src=all_slot_idx[table.src],
            dst=all_slot_idx[table.dst],
            nbytes=intersector.config.wires.segment_nbytes(
                table.wire, table.shape, table.ndim, table.esize
            ),
            group=group,
            eligible=relayable,
            chain_pool=chain_pool,
            fan=fan,
        ),
        is_source,
    )
    r = np.flatnonzero(feed >= 0)
    table.feed[r] = feed[r]
    table.src[r] = table.dst[feed[r]]
    table.src_loc[r] = table.dst_loc[feed[r]]
