"""What one device slot executes for one refit: the contract between planner and executor.

The planner builds a whole-cluster plan once per (model, membership epoch, layouts); the
controller ships to each transfer process the SlotProgram of its slot, and the executor
replays it every refit. Offsets in a Copy are local coordinates of the registered tensors
(see layout.Box); a copy's shape is the same on both ends.

Message k of a slot is packed from its copies' source regions in order, each as a wire
segment (wire.segment_parts) starting SEGMENT_ALIGN-aligned, and unpacked in the same order
into the destination regions. Messages carry a round: in round r each slot sends at most one
message to any peer and the executor may overlap round r+1 with round r.

Relays (plans built with PlanConfig.relay): a Copy whose src_tensor is a destination tensor
forwards a region this slot received earlier. Its message's round is greater than the
rounds that delivered that region: before packing it, the slot completes all its receives
of smaller rounds; local copies reading a destination tensor run after all receives.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from refitd.plan.layout import Box, TensorSpec
from refitd.plan.wire import RAW, segment_nbytes

PROGRAM_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Copy:
    """One block copied from a source tensor region to a destination tensor region."""

    src_tensor: int
    src_offset: tuple[int, ...]
    dst_tensor: int
    dst_offset: tuple[int, ...]
    shape: tuple[int, ...]
    wire: str = RAW


@dataclass(frozen=True, slots=True)
class Message:
    """Copies from one source slot to one destination slot, sent as one buffer."""

    id: int
    round: int
    src_slot: int
    dst_slot: int
    copies: tuple[Copy, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class SlotProgram:
    """Everything one transfer process needs for one refit of one plan.

    tensors maps the plan's tensor indices used here to their specs (the agent resolves a
    spec's (pool, rank, name) to the mapped memory of that worker). sends and recvs are
    ordered by (round, id); local holds the copies whose both ends sit on this slot.
    """

    digest: str
    slot: int
    tensors: dict[int, TensorSpec]
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    local: tuple[Copy, ...]

    def to_bytes(self) -> bytes:
        """Compact, language-neutral encoding (msgpack) for shipping to an agent."""
        return msgpack.packb(
            {
                "v": PROGRAM_FORMAT_VERSION,
                "digest": self.digest,
                "slot": self.slot,
                "tensors": [[i, _spec_to_list(s)] for i, s in self.tensors.items()],
                "sends": [_message_to_list(m) for m in self.sends],
                "recvs": [_message_to_list(m) for m in self.recvs],
                "local": [_copy_to_list(c) for c in self.local],
            },
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> SlotProgram:
        d = msgpack.unpackb(data, raw=False)
        if d.get("v") != PROGRAM_FORMAT_VERSION:
            raise ValueError(
                f"slot program format {d.get('v')!r}, expected {PROGRAM_FORMAT_VERSION}"
            )
        return cls(
            digest=d["digest"],
            slot=d["slot"],
            tensors={i: _spec_from_list(s) for i, s in d["tensors"]},
            sends=tuple(_message_from_list(m) for m in d["sends"]),
            recvs=tuple(_message_from_list(m) for m in d["recvs"]),
            local=tuple(_copy_from_list(c) for c in d["local"]),
        )


def message_nbytes(copies: tuple[Copy, ...], tensors: dict[int, TensorSpec]) -> int:
    """Wire size of a message made of these copies (source dtypes from the specs)."""
    return sum(segment_nbytes(c.wire, c.shape, tensors[c.src_tensor].dtype) for c in copies)


def _copy_to_list(c: Copy) -> list:
    return [
        c.src_tensor,
        list(c.src_offset),
        c.dst_tensor,
        list(c.dst_offset),
        list(c.shape),
        c.wire,
    ]


def _copy_from_list(x: list) -> Copy:
    return Copy(x[0], tuple(x[1]), x[2], tuple(x[3]), tuple(x[4]), x[5])


def _message_to_list(m: Message) -> list:
    return [m.id, m.round, m.src_slot, m.dst_slot, [_copy_to_list(c) for c in m.copies], m.nbytes]


def _message_from_list(x: list) -> Message:
    return Message(x[0], x[1], x[2], x[3], tuple(_copy_from_list(c) for c in x[4]), x[5])


def _spec_to_list(s: TensorSpec) -> list:
    return [
        s.model,
        s.pool,
        s.rank,
        s.slot,
        s.name,
        s.canonical,
        list(s.global_shape),
        s.dtype,
        list(s.local_shape),
        [[list(b.offset), list(b.shape), list(b.local_offset)] for b in s.boxes],
        s.storage,
        [list(kv) for kv in s.meta],
    ]


def _spec_from_list(x: list) -> TensorSpec:
    return TensorSpec(
        model=x[0],
        pool=x[1],
        rank=x[2],
        slot=x[3],
        name=x[4],
        canonical=x[5],
        global_shape=tuple(x[6]),
        dtype=x[7],
        local_shape=tuple(x[8]),
        boxes=tuple(Box(tuple(o), tuple(s), tuple(lo)) for o, s, lo in x[9]),
        storage=x[10],
        meta=tuple((k, v) for k, v in x[11]),
    )
