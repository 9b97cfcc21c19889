"""Plan explanation: which source ranks and boxes feed one destination shard, and how.

`explain(plan, tensor, pool, rank)` reads a built Plan through its public structure
(`tensors`, `source_count`, `program(slot)`) and lists, per matching destination shard,
every copy into it: the source rank and the block of its canonical tensor, where it lands
locally, bytes on the wire, wire format, round, and whether it comes direct, by relay
(another destination replica forwards it) or as a local copy on the same slot, and the
path of its message (refitd.plan.links: mapped, rdma, collective; local for a local copy).
`lines()` gives the compact text form used by `refitd explain`:

    S(trainer:0)[0:125, 0:64] -> R[0:125, 0:64]  16.0 KiB raw  round 0  direct  mapped  msg 3  slot 0->4

Errors name the unknown tensor, pool or rank (PlanError).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from refitd.plan.errors import PlanError
from refitd.plan.layout import TensorSpec
from refitd.plan.links import LOCAL
from refitd.plan.planner import Plan
from refitd.plan.program.columns import Copy, SlotProgram
from refitd.plan.wire import segment_nbytes

Ranges = tuple[tuple[int, int], ...]  # [lo, hi) per dim


@dataclass(frozen=True, slots=True)
class Feed:
    """One copy into the destination shard."""

    source: str  # "pool:rank" of the source worker (the original one for relays)
    source_tensor: str
    source_canonical: str
    source_box: Ranges  # global coordinates in the source canonical tensor
    dest_box: Ranges  # local coordinates in the destination tensor
    nbytes: int
    wire: str
    round: int | None  # None: a local copy (no message)
    route: str  # "direct" | "relay" | "local"
    src_slot: int
    dst_slot: int
    via: str = ""  # relay: "pool:rank" of the destination replica that forwards it
    path: str = LOCAL  # the message's path (links.PATHS), "local" for a local copy
    message: int | None = None  # the message id (None: a local copy)

    def line(self) -> str:
        rnd = "local" if self.round is None else f"round {self.round}"
        via = f" via {self.via}" if self.via else ""
        msg = "" if self.message is None else f"  msg {self.message}"
        return (
            f"S({self.source})[{_fmt(self.source_box)}] -> R[{_fmt(self.dest_box)}]  "
            f"{_size(self.nbytes)} {self.wire}  {rnd}  {self.route}{via}  {self.path}{msg}  "
            f"slot {self.src_slot}->{self.dst_slot}"
        )


@dataclass(frozen=True, slots=True)
class ShardExplanation:
    """A destination shard (one registration of one rank) and the copies that fill it."""

    model: str
    pool: str
    rank: int
    tensor: str
    canonical: str
    local_shape: tuple[int, ...]
    dtype: str
    storage: str
    slot: int
    feeds: tuple[Feed, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.feeds)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["nbytes"] = self.nbytes
        out["lines"] = self.lines()
        return out

    def lines(self) -> list[str]:
        sources = sorted({f.source for f in self.feeds})
        head = (
            f"{self.pool}:{self.rank} {self.tensor} (canonical {self.canonical}, local "
            f"{'x'.join(map(str, self.local_shape))} {self.dtype}"
            f"{'' if self.storage == 'plain' else ' ' + self.storage}, slot {self.slot}): "
            f"{len(self.feeds)} copies from {len(sources)} source ranks, {_size(self.nbytes)}"
        )
        return [head, *("  " + f.line() for f in self.feeds)]


def _fmt(r: Ranges) -> str:
    return ", ".join(f"{lo}:{hi}" for lo, hi in r)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _to_global(spec: TensorSpec, local: Sequence[int], shape: Sequence[int]) -> Ranges:
    """A local region of a spec in global coordinates (the box that holds it)."""
    for b in spec.boxes:
        if all(
            lo <= o and o + n <= lo + bn
            for o, n, lo, bn in zip(local, shape, b.local_offset, b.shape, strict=True)
        ):
            return tuple(
                (g + o - lo, g + o - lo + n)
                for o, n, lo, g in zip(local, shape, b.local_offset, b.offset, strict=True)
            )
    return tuple((o, o + n) for o, n in zip(local, shape, strict=True))  # not in one box


def _who(spec: TensorSpec) -> str:
    return f"{spec.pool}:{spec.rank}"


def _matches(spec: TensorSpec, tensor: str) -> bool:
    n = spec.name
    return (
        n == tensor
        or spec.canonical == tensor
        or n.startswith((tensor + "@", tensor + "["))  # engine registrations of one parameter
    )


def _select(plan: Plan, tensor: str, pool: str | None, rank: int | None) -> list[int]:
    dests = range(plan.source_count, len(plan.tensors))
    hits = [i for i in dests if _matches(plan.tensors[i], tensor)]
    if not hits:
        names = sorted({plan.tensors[i].name for i in dests})
        close = difflib.get_close_matches(tensor, names, n=3) if len(names) < 20000 else []
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise PlanError(f"model {plan.model!r} has no destination tensor {tensor!r}{hint}")
    if pool is not None:
        pools = sorted({plan.tensors[i].pool for i in hits})
        hits = [i for i in hits if plan.tensors[i].pool == pool]
        if not hits:
            raise PlanError(
                f"tensor {tensor!r} of model {plan.model!r} has no shard in pool {pool!r} "
                f"(pools holding it: {', '.join(pools)})"
            )
    if rank is not None:
        ranks = sorted({plan.tensors[i].rank for i in hits})
        hits = [i for i in hits if plan.tensors[i].rank == rank]
        if not hits:
            where = f" in pool {pool!r}" if pool is not None else ""
            raise PlanError(
                f"tensor {tensor!r} of model {plan.model!r} has no shard on rank {rank}{where} "
                f"(ranks holding it: {ranks[0]}..{ranks[-1]}, {len(ranks)} ranks)"
            )
    return hits


def explain(
    plan: Plan, tensor: str, pool: str | None = None, rank: int | None = None
) -> list[ShardExplanation]:
    """Every destination shard of `tensor` (registration name, its engine pieces, or
    canonical name), optionally of one pool and rank, with the copies that fill it."""
    programs: dict[int, SlotProgram] = {}

    def program(slot: int) -> SlotProgram:
        if slot not in programs:
            programs[slot] = plan.program(slot)
        return programs[slot]

    out = []
    for i in _select(plan, tensor, pool, rank):
        spec = plan.tensors[i]
        prog = program(spec.slot)
        feeds = [
            _feed(plan, program, c, m.round, m.src_slot, spec.slot, m.path, m.id)
            for m in prog.recvs
            for c in m.copies
            if c.dst_tensor == i
        ]
        feeds += [
            _feed(plan, program, c, None, spec.slot, spec.slot)
            for c in prog.local
            if c.dst_tensor == i
        ]
        out.append(
            ShardExplanation(
                model=plan.model,
                pool=spec.pool,
                rank=spec.rank,
                tensor=spec.name,
                canonical=spec.canonical,
                local_shape=spec.local_shape,
                dtype=spec.dtype,
                storage=spec.storage,
                slot=spec.slot,
                feeds=tuple(feeds),
            )
        )
    return out


def _feed(
    plan: Plan,
    program: Any,
    c: Copy,
    rnd: int | None,
    src_slot: int,
    dst_slot: int,
    path: str = LOCAL,
    message: int | None = None,
) -> Feed:
    src = plan.tensors[c.src_tensor]
    via = ""
    route = "local" if rnd is None else "direct"
    origin, region = src, c.src_offset
    if c.src_tensor >= plan.source_count:  # a relay: a destination replica forwards it
        via, route = _who(src), "relay" if rnd is not None else "local relay"
        origin, region = _origin(plan, program(src.slot), c)
    nbytes = segment_nbytes(c.wire, c.shape, origin.dtype)
    return Feed(
        source=_who(origin),
        source_tensor=origin.name,
        source_canonical=origin.canonical,
        source_box=_to_global(origin, region, c.shape),
        dest_box=tuple((o, o + n) for o, n in zip(c.dst_offset, c.shape, strict=True)),
        nbytes=nbytes,
        wire=c.wire,
        round=rnd,
        route=route,
        src_slot=src_slot,
        dst_slot=dst_slot,
        via=via,
        path=path,
        message=message,
    )


def _origin(plan: Plan, prog: SlotProgram, c: Copy) -> tuple[TensorSpec, tuple[int, ...]]:
    """The source spec and local offset a relayed region first came from (the copy into
    the forwarding tensor that covers its start)."""
    for m in prog.recvs:
        for d in m.copies:
            if d.dst_tensor == c.src_tensor and all(
                lo <= o < lo + n
                for o, lo, n in zip(c.src_offset, d.dst_offset, d.shape, strict=True)
            ):
                shift = tuple(o - lo for o, lo in zip(c.src_offset, d.dst_offset, strict=True))
                return plan.tensors[d.src_tensor], tuple(
                    a + b for a, b in zip(d.src_offset, shift, strict=True)
                )
    return plan.tensors[c.src_tensor], c.src_offset


def format_explanations(shards: Sequence[ShardExplanation]) -> str:
    """The compact text of every shard, one block each."""
    return "\n".join(line for s in shards for line in s.lines())
