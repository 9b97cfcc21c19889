"""Slot programs from object form: Copy and Message tuples written by hand (tests, checks
and tools), turned into the same columns the planner builds and checked like a decoded one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from refitd.plan.layout import TensorSpec
from refitd.plan.links import PATHS
from refitd.plan.program.checks import check_program
from refitd.plan.program.columns import (
    DTYPES,
    STORAGES,
    WIRES,
    Copy,
    CopyColumns,
    Message,
    MessageColumns,
    ProgramTensor,
    SlotProgram,
    TensorColumns,
    copy_flags,
)
from refitd.plan.wire import NVFP4, PLAIN, segment_nbytes


def program_from_objects(
    digest: str,
    slot: int,
    tensors: Mapping[int, TensorSpec | ProgramTensor],
    sends: tuple[Message, ...],
    recvs: tuple[Message, ...],
    local: tuple[Copy, ...],
) -> SlotProgram:
    """A program from object form, checked (ProgramError names the slot and the field)."""
    copies = [c for m in sends for c in m.copies]
    copies += [c for m in recvs for c in m.copies]
    copies += list(local)
    d = max([len(c.shape) for c in copies] + [len(t.local_shape) for t in tensors.values()])
    cols = _ObjectColumns(max(d, 1))
    send = cols.messages(sends, 0)
    recv = cols.messages(recvs, sum(len(m.copies) for m in sends))
    cc = cols.copies(copies, tensors)
    prog = SlotProgram(
        digest, slot, cols.tensors(tensors, slot), cc, send, recv, len(copies) - len(local)
    )
    check_program(prog)
    return prog


def message_nbytes(copies: tuple[Copy, ...], tensors: Mapping[int, object]) -> int:
    """Wire size of a message made of these copies (source dtypes from the tensors)."""
    return sum(
        segment_nbytes(c.wire, c.shape, tensors[c.src_tensor].dtype)  # type: ignore[attr-defined]
        for c in copies
    )


@dataclass(frozen=True, slots=True)
class _ObjectColumns:
    """Object-form program parts as columns, shapes padded to d dims (program_from_objects)."""

    d: int

    def pad(self, t: tuple[int, ...], fill: int) -> list[int]:
        return list(t) + [fill] * (self.d - len(t))

    @staticmethod
    def arr(rows: list, dtype: type = np.int64) -> np.ndarray:
        return np.array(rows, dtype=dtype).reshape(-1)

    def mat(self, rows: list[list[int]]) -> np.ndarray:
        return np.array(rows, dtype=np.int64).reshape(len(rows), self.d)

    def copies(
        self, copies: list[Copy], tensors: Mapping[int, TensorSpec | ProgramTensor]
    ) -> CopyColumns:
        arr, mat, pad, spec = self.arr, self.mat, self.pad, tensors.__getitem__
        src_dt = arr([DTYPES.index(spec(c.src_tensor).dtype) for c in copies], np.uint8)
        dst_dt = arr([DTYPES.index(spec(c.dst_tensor).dtype) for c in copies], np.uint8)
        shape = mat([pad(c.shape, 1) for c in copies])
        ndim = arr([len(c.shape) for c in copies], np.uint8)
        wire = arr([WIRES.index(c.wire) for c in copies], np.uint8)
        return CopyColumns(
            src=arr([c.src_tensor for c in copies]),
            dst=arr([c.dst_tensor for c in copies]),
            src_off=mat([pad(c.src_offset, 0) for c in copies]),
            dst_off=mat([pad(c.dst_offset, 0) for c in copies]),
            shape=shape,
            ndim=ndim,
            wire=wire,
            src_dtype=src_dt,
            dst_dtype=dst_dt,
            flags=copy_flags(
                wire,
                src_dt,
                dst_dt,
                arr([spec(c.dst_tensor).storage == PLAIN for c in copies], bool),
                arr([spec(c.dst_tensor).storage == NVFP4 for c in copies], bool),
                shape,
                mat([pad(tuple(spec(c.src_tensor).local_shape), 1) for c in copies]),
                mat([pad(tuple(spec(c.dst_tensor).local_shape), 1) for c in copies]),
                ndim,
            ),
        )

    def messages(self, ms: tuple[Message, ...], first: int) -> MessageColumns:
        """Messages whose copies follow each other from copy row `first`."""
        ends = (first + np.cumsum([len(m.copies) for m in ms], dtype=np.int64)).tolist()
        starts = [first, *ends[:-1]] if ms else []
        arr = self.arr
        return MessageColumns(
            id=arr([m.id for m in ms]),
            round=arr([m.round for m in ms]),
            src_slot=arr([m.src_slot for m in ms]),
            dst_slot=arr([m.dst_slot for m in ms]),
            start=arr(starts),
            end=arr(ends),
            nbytes=arr([m.nbytes for m in ms]),
            path=arr([PATHS.index(m.path) for m in ms], np.uint8),
        )

    def tensors(
        self, tensors: Mapping[int, TensorSpec | ProgramTensor], slot: int
    ) -> TensorColumns:
        arr = self.arr
        idx = sorted(i for i, t in tensors.items() if t.slot == slot)
        specs = [tensors[i] for i in idx]
        pools = tuple(sorted({s.pool for s in specs}))
        return TensorColumns(
            index=arr(idx),
            slot=arr([s.slot for s in specs]),
            rank=arr([s.rank for s in specs]),
            pool=arr([pools.index(s.pool) for s in specs]),
            dtype=arr([DTYPES.index(s.dtype) for s in specs], np.uint8),
            storage=arr([STORAGES.index(s.storage) for s in specs], np.uint8),
            ndim=arr([len(s.local_shape) for s in specs], np.uint8),
            local_shape=self.mat([self.pad(tuple(s.local_shape), 1) for s in specs]),
            pools=pools,
        )
